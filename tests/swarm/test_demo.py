"""`make demo` on a shortened schedule: both rebuilds show up (CheckFree for the middle block stage,
CheckFree+ for stage 1), the demo ends with a dashboard frame and a summary, and nothing it
started is left running."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from node.local_swarm import REPO


def processes_under(workdir: str) -> list[int]:
    """Pids of processes whose working directory or command line is inside `workdir` (the demo's peers)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if (proc.info["cwd"] or "").startswith(workdir) or workdir in cmdline:
                found.append(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.timeout(420)
def test_the_demo_shows_both_rebuilds_and_stops_everything(tmp_path):
    workdir = tmp_path / "demo"
    command = [
        sys.executable,
        "-m",
        "node.demo",
        "--peers-per-stage",
        "1",
        "--duration",
        "60",
        "--interval",
        "3",
        "--fail-middle-at",
        "10",
        "--fail-first-at",
        "30",
        "--workdir",
        str(workdir),
    ]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=400)
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    assert "killed all 1 peers of stage 2" in output and "killed all 1 peers of stage 1" in output, output
    # the rebuild events name the method: stage 2 from both neighbours, stage 1 from stage 2
    rebuilds = [line for line in output.splitlines() if line.strip().startswith("rebuild")]
    assert any("stage 2 by checkfree from stages 1" in line and "and 3" in line for line in rebuilds), output
    assert any("stage 1 by checkfree (copy) from stage 2" in line for line in rebuilds), output
    assert "stage 2 serves again" in output and "stage 1 serves again" in output, output
    assert "summary" in output and "tokens/s" in output and "stage-0 loss" in output, output
    assert "done: no process left behind" in output
    assert not processes_under(str(workdir)), "demo processes left behind"
    print(f"demo (shortened) ran {time.monotonic() - started:.0f} s; rebuild lines:\n" + "\n".join(rebuilds))
