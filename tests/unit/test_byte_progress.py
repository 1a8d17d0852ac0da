"""node/runtime/byte_progress.py: the byte accounting behind the state download's, `node export`'s
and `node prepare-data`'s progress, as log lines (no terminal) and as a rich bar (a terminal)."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from node.runtime.byte_progress import ByteProgress, Outcome, format_bytes
from tests.helpers.clock import FakeClock

MiB = 1 << 20


def log_progress(caplog: pytest.LogCaptureFixture, clock: FakeClock, log_every: float = 5.0) -> ByteProgress:
    caplog.set_level(logging.INFO, logger="test.bytes")
    return ByteProgress(bar=False, log_every=log_every, log=logging.getLogger("test.bytes"), clock=clock)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.bytes"]


def test_chunks_add_up_to_the_total_and_the_rate_is_bytes_over_time(caplog):
    clock = FakeClock(100.0)
    with log_progress(caplog, clock) as progress:
        task = progress.task("stage 1 from abc", 10 * MiB)
        for _ in range(4):  # 4 + 4 + 2 MiB, one second apart
            clock.now += 1.0
            task.advance(min(4 * MiB, task.total - task.done))
        assert task.done == 10 * MiB
        assert task.fraction == 1.0
        assert task.rate == pytest.approx(10 * MiB / 4.0)
        task.finish()
    assert task.outcome == Outcome.DONE
    # no line before log_every passed; the last line tells the whole transfer
    assert lines(caplog) == ["stage 1 from abc: 10.0 MiB of 10.0 MiB (100 %), 2.5 MiB/s, done in 4.0 s"]


def test_log_lines_come_every_log_every_seconds_not_per_chunk(caplog):
    clock = FakeClock(100.0)
    with log_progress(caplog, clock, log_every=5.0) as progress:
        task = progress.task("export stage 0", 100 * MiB)
        for _ in range(20):  # a 1 MiB chunk every 0.5 s: 10 s in all
            clock.now += 0.5
            task.advance(MiB)
        task.finish()
    assert lines(caplog) == [
        "export stage 0: 10.0 MiB of 100.0 MiB (10 %), 2.0 MiB/s",
        "export stage 0: 20.0 MiB of 100.0 MiB (20 %), 2.0 MiB/s",
        "export stage 0: 20.0 MiB of 100.0 MiB (20 %), 2.0 MiB/s, done in 10.0 s",
    ]


def test_tasks_count_apart_and_an_open_task_fails_on_exit(caplog):
    clock = FakeClock(100.0)
    with pytest.raises(ConnectionError), log_progress(caplog, clock) as progress:
        first = progress.task("stage 1 from a", 3 * MiB)
        second = progress.task("stage 1 from b", 5 * MiB)
        first.advance(MiB)
        second.advance(2 * MiB)
        second.advance(3 * MiB)
        second.finish()
        raise ConnectionError("donor vanished")
    assert (first.done, second.done) == (MiB, 5 * MiB)
    assert (first.outcome, second.outcome) == (Outcome.FAILED, Outcome.DONE)
    assert lines(caplog)[-1].startswith("stage 1 from a: 1.0 MiB of 3.0 MiB (33 %)")
    assert lines(caplog)[-1].endswith("failed in 0.0 s")


def test_an_open_task_ends_done_or_stopped_on_a_clean_exit(caplog):
    clock = FakeClock(100.0)
    with log_progress(caplog, clock) as progress:
        whole = progress.task("whole", 2 * MiB)
        whole.advance(2 * MiB)
        short = progress.task("short", 2 * MiB)
        short.advance(MiB)
    assert (whole.outcome, short.outcome) == (Outcome.DONE, Outcome.STOPPED)
    assert lines(caplog)[-1] == "short: 1.0 MiB of 2.0 MiB (50 %), 0 B/s, stopped in 0.0 s"


def test_bad_counts_are_refused():
    progress = ByteProgress(bar=False)
    task = progress.task("x", 10)
    with pytest.raises(ValueError):
        task.advance(-1)
    task.finish()
    task.finish(Outcome.FAILED)  # a second finish changes nothing
    assert task.outcome == Outcome.DONE
    with pytest.raises(RuntimeError):
        task.advance(1)
    with pytest.raises(ValueError):
        progress.task("y", -5)
    assert progress.task("empty", 0).fraction == 1.0


def test_on_a_terminal_a_bar_shows_the_same_bytes_and_nothing_is_logged(caplog):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    caplog.set_level(logging.INFO, logger="test.bytes")
    with ByteProgress(console=console, log=logging.getLogger("test.bytes")) as progress:
        assert progress.show_bar
        task = progress.task("stage 2 from xyz", 4 * MiB)
        task.advance(3 * MiB)
        bar = progress._bars.tasks[0]
        assert (bar.completed, bar.total) == (3 * MiB, 4 * MiB)
        task.advance(MiB)
        task.finish()
        assert bar.completed == 4 * MiB and bar.finished
    assert "stage 2 from xyz" in out.getvalue()
    assert "4.2/4.2 MB" in out.getvalue()  # rich's DownloadColumn, decimal units
    assert lines(caplog) == []


def test_no_terminal_means_no_bar():
    console = Console(file=io.StringIO(), force_terminal=False)
    assert not ByteProgress(console=console).show_bar
    assert not ByteProgress(bar=False, console=Console(file=io.StringIO(), force_terminal=True)).show_bar


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * MiB, 3 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]
