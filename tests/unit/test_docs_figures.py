"""The rules a reader of docs/ relies on, kept where a test can keep them: the reference pages hold no
dated diary (history is docs/changes.md's, one line per change, each naming its commit), every
generated page has a freshness test, and figures copied from a record agree with it."""

import ast
import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
HISTORY = "changes.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

# every generated page (or generated part of one) and the test that fails while it is out of date
GENERATED = {
    "config.md": "tests/unit/test_config.py::test_docs_config_md_is_the_generated_reference",
    "model.md": "tests/unit/test_memory_tables.py::test_each_generated_table_of_docs_model_md_is_what_the_code_gives_now",
    "results.md": "tests/unit/test_simulate_experiments.py::test_docs_results_md_is_what_its_summaries_render",
}
GENERATED_MARK = re.compile(r"^Generated (from|by)|<!-- generated:", re.MULTILINE)


def reference_pages() -> list[Path]:
    return sorted(path for path in DOCS.glob("*.md") if path.name != HISTORY)


def dated_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if DATE.search(line)]


def test_the_docs_directory_is_where_this_test_looks():
    assert (DOCS / HISTORY).exists() and len(reference_pages()) >= 10


@pytest.mark.parametrize("page", reference_pages(), ids=lambda path: path.name)
def test_a_reference_page_holds_no_date(page: Path):
    """A figure names its command and commit, not the day it was measured; a dated heading or entry
    is a diary, and history goes to docs/changes.md."""
    assert dated_lines(page.read_text()) == [], f"docs/{page.name}: dated lines (name the commit instead)"


def test_the_date_rule_catches_a_dated_heading_and_entry():
    assert dated_lines("# Staleness\n\n### Issue 16, 2026-11-28 (morning)\n") == ["### Issue 16, 2026-11-28 (morning)"]
    assert dated_lines("measured at c3001a5 (2 cores); 20.5 s, 2026 tokens") == []


def test_each_line_of_the_changes_page_names_its_commit():
    """docs/changes.md: one line per change, newest first, each starting with its commit(s)."""
    entries = [line for line in (DOCS / HISTORY).read_text().splitlines() if line.startswith("- ")]
    assert entries, "docs/changes.md has no entries"
    unnamed = [line for line in entries if not re.match(r"- [0-9a-f]{7}\b", line)]
    assert unnamed == [], "docs/changes.md: entries that do not start with their commit"


def test_every_generated_page_has_a_freshness_test():
    marked = {page.name for page in reference_pages() if GENERATED_MARK.search(page.read_text())}
    assert marked == set(GENERATED), "a generated page without a freshness test here (or a stale entry)"
    for test in GENERATED.values():
        path, name = test.split("::")
        tree = ast.parse((DOCS.parent / path).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, f"{test} is gone"


def hop_codec_rows(text: str) -> dict[str, list[float]]:
    """docs/wire.md's loss table: variant -> the three held-out losses and their mean."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`[\w+-]+`", cells[0]) and "+-" in cells[3]:
            rows[cells[0].strip("`")] = [float(x) for x in cells[2].split(",")] + [float(cells[3].split()[0])]
    return rows


def test_the_hop_codec_losses_in_wire_md_are_the_recorded_run():
    """docs/wire.md copies its loss table from docs/results/hop_codec.json (`make bench-hop-codec`):
    a rerun that rewrites the record must rewrite the table."""
    record = json.loads((DOCS / "results" / "hop_codec.json").read_text())["results"]
    rows = hop_codec_rows((DOCS / "wire.md").read_text())
    assert set(rows) == set(record), "docs/wire.md's hop-codec table and hop_codec.json name other variants"
    for variant, figures in rows.items():
        recorded = [*record[variant]["losses"], record[variant]["mean"]]
        assert figures == [round(value, 4) for value in recorded], f"docs/wire.md, {variant}: not the recorded run"


def test_the_real_text_hop_codec_table_is_its_recorded_run_or_says_it_has_none():
    """docs/results.md renders docs/results/hop_codec_real_text.json (`make bench-hop-codec-text`; the
    page's freshness test keeps the table the file's): a summary there names its commit in
    commits.json, and without one the page says so rather than show another run's figures."""
    commits = json.loads((DOCS / "results" / "commits.json").read_text())
    page = (DOCS / "results.md").read_text()
    missing = "Not run: no hop_codec_real_text.json"
    if (DOCS / "results" / "hop_codec_real_text.json").exists():
        assert "hop_codec_real_text" in commits and missing not in page
    else:
        assert "hop_codec_real_text" not in commits and missing in page


def architecture_tree() -> str:
    """The code block under docs/architecture.md's "The tree, and who owns what"."""
    text = (DOCS / "architecture.md").read_text()
    section = text[text.index("## The tree, and who owns what") :]
    return section.split("```")[1]


def test_the_architecture_tree_names_every_module():
    """A newcomer reads the tree to find where a concern lives: a module missing from it is one they
    cannot find. A module counts as named when its file name appears in the tree, or its stem does
    (a subpackage's line may list its modules by stem, as dashboard/ does)."""
    tree = architecture_tree()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.py)?", tree))
    root = DOCS.parent
    missing = [
        str(path.relative_to(root))
        for package in ("protocol", "dht", "node")
        for path in sorted((root / package).rglob("*.py"))
        if path.name != "__init__.py" and path.name not in words and path.stem not in words
    ]
    assert not missing, f"docs/architecture.md's tree does not name: {missing}"
