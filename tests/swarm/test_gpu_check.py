"""`make gpu-check DEVICE=cpu PRESET=15m` in the default suite: the volunteer's real case at the `15m`
preset's shapes on the CPU (tests/benchmarks/gpu_check.py): one peer per stage of a 4-stage
pipeline training, a joiner's state download, a NoLoCo round between two replicas, a stage killed
and rebuilt by CheckFree, an export, no traceback in any log. About two and a half minutes here."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import gpu_check

STEPS = ("stage-0 tokens/s", "state download", "gossip", "rebuild", "export")


@pytest.mark.timeout(900)
def test_the_gpu_check_passes_on_the_cpu_at_the_15m_preset(tmp_path):
    figures_path = tmp_path / "figures.json"
    code = gpu_check.main(
        ["--device", "cpu", "--preset", "15m", "--workdir", str(tmp_path / "swarm"), "--json", str(figures_path)]
    )
    figures = json.loads(figures_path.read_text())
    assert code == 0, "\n".join(figures["failures"])
    shown = {what for what, _ in figures["rows"]}
    assert set(STEPS) <= shown, f"steps missing from the report: {set(STEPS) - shown}"
    assert "by checkfree" in dict(figures["rows"])["rebuild"]
