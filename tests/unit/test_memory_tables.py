"""docs/model.md's generated tables (node/model/memory_tables.py) agree with the code and with the
measurements recorded in docs/model-memory.json; the estimate stays within 20 % of each measured
peak. Regenerate with `python tests/benchmarks/bench_memory.py --estimate-only` (the measurements:
`make memory-table`, minutes)."""

from __future__ import annotations

import pytest

from node.model.memory_tables import GeneratedTable, generated_part, generated_tables, replace_generated
from tests.benchmarks.bench_memory import MEASUREMENTS_PATH, MODEL_DOC, measured_cases

REGENERATE = "run `python tests/benchmarks/bench_memory.py --estimate-only`"


def test_each_generated_table_of_docs_model_md_is_what_the_code_gives_now():
    page = MODEL_DOC.read_text(encoding="utf-8")
    for name, table in generated_tables(measured_cases()).items():
        assert generated_part(page, name) == table, f"docs/model.md's {name} table is out of date: {REGENERATE}"


def test_the_estimate_is_within_20_percent_of_every_measured_peak():
    cases = measured_cases()
    assert {(case.preset, case.stage) for case in cases} >= {("15m", 0), ("15m", 1), ("125m", 0), ("125m", 1)}, (
        f"{MEASUREMENTS_PATH} lacks a stage-0 or block-stage measurement of 15m or 125m"
    )
    for case in cases:
        ratio = case.estimate().total / case.measured_bytes
        assert 0.8 <= ratio <= 1.2, (case, ratio)


def test_a_generated_part_is_replaced_between_its_markers_and_missing_markers_are_named():
    page = MODEL_DOC.read_text(encoding="utf-8")
    changed = replace_generated(page, {GeneratedTable.PRESETS: "| new |"})
    assert generated_part(changed, GeneratedTable.PRESETS) == "| new |"
    assert generated_part(changed, GeneratedTable.MEMORY) == generated_part(page, GeneratedTable.MEMORY)
    assert replace_generated(changed, {GeneratedTable.PRESETS: generated_part(page, GeneratedTable.PRESETS)}) == page
    with pytest.raises(ValueError, match="generated: presets"):
        replace_generated("no markers here", {GeneratedTable.PRESETS: "| x |"})
