"""Progress of long byte transfers: a joiner's state download, `node export`, `node prepare-data`.

One helper for all of them. On a terminal it draws a rich bar per transfer (bytes done / total,
rate, time left); anywhere else (a log file, a container, `--quiet`) it writes a plain log line per
transfer every `log_every` seconds and one when the transfer ends, so a long download never looks
hung in a log and never floods it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when a bar is drawn
    from rich.console import Console
    from rich.progress import Progress, TaskID

logger = logging.getLogger(__name__)

__all__ = ["ByteProgress", "ByteTask", "Outcome", "format_bytes"]


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as device memory is reported."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class Outcome(StrEnum):
    """How a transfer ended (its last log line says which)."""

    DONE = "done"
    FAILED = "failed"  # an error ended it (a donor died, a checksum failed)
    STOPPED = "stopped"  # left unfinished without an error (the caller stopped reading)


class ByteTask:
    """One transfer of `total` bytes. `advance(n)` as bytes arrive, `finish()` at the end."""

    def __init__(self, owner: ByteProgress, description: str, total: int) -> None:
        if total < 0:
            raise ValueError(f"a transfer of {total} bytes")
        self.owner = owner
        self.description = description
        self.total = total
        self.done = 0
        self.started = owner.clock()
        self.outcome: Outcome | None = None
        self._last_log = self.started
        self._bar_task: TaskID | None = None

    @property
    def elapsed(self) -> float:
        return self.owner.clock() - self.started

    @property
    def rate(self) -> float:
        """Bytes per second since the transfer started (0 before any time has passed)."""
        elapsed = self.elapsed
        return self.done / elapsed if elapsed > 0 else 0.0

    @property
    def fraction(self) -> float:
        return 1.0 if self.total == 0 else min(1.0, self.done / self.total)

    def advance(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"cannot advance a transfer by {count} bytes")
        if self.outcome is not None:
            raise RuntimeError(f"{self.description}: advanced after it ended ({self.outcome})")
        self.done += count
        self.owner.update(self)

    def finish(self, outcome: Outcome = Outcome.DONE) -> None:
        """End the transfer (once; later calls do nothing): its bar stops, its last line is logged."""
        if self.outcome is None:
            self.outcome = outcome
            self.owner.update(self)

    def line(self) -> str:
        """'stage 1 from 3xY...: 12.0 MiB of 48.0 MiB (25 %), 6.0 MiB/s'; the end adds the outcome and time."""
        text = (
            f"{self.description}: {format_bytes(self.done)} of {format_bytes(self.total)} "
            f"({100 * self.fraction:.0f} %), {format_bytes(self.rate)}/s"
        )
        if self.outcome is not None:
            text += f", {self.outcome} in {self.elapsed:.1f} s"
        return text


class ByteProgress:
    """Byte transfers shown as rich bars when `bar` is allowed and stderr is a terminal, as log lines
    otherwise. Use as a context manager around the transfers; `task(description, total)` starts one.

    rich allows one live display per console: callers that run inside another live view (the join
    panel of node/server/progress.py) pass bar=False and get log lines.
    """

    def __init__(
        self,
        bar: bool = True,
        *,
        log_every: float = 5.0,
        console: Console | None = None,
        log: logging.Logger = logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_every = log_every
        self.log = log
        self.clock = clock
        self.console = console
        self.show_bar = bar and (console.is_terminal if console is not None else sys.stderr.isatty())
        self.tasks: list[ByteTask] = []
        self._bars: Progress | None = None

    def __enter__(self) -> ByteProgress:
        if self.show_bar:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
            console = self.console or Console(file=sys.stderr)
            self._bars = Progress(*columns, TimeRemainingColumn(), console=console, transient=False)
            self._bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for task in self.tasks:  # a transfer still open here was cut short
            if task.outcome is None:
                complete = task.done >= task.total
                task.finish(Outcome.FAILED if error is not None else Outcome.DONE if complete else Outcome.STOPPED)
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    def task(self, description: str, total: int) -> ByteTask:
        task = ByteTask(self, description, total)
        self.tasks.append(task)
        if self._bars is not None:
            task._bar_task = self._bars.add_task(description, total=total)
        return task

    def advancer(self, description: str, total: int) -> Callable[[int], None]:
        """A new task's advance: for callers that only ever count bytes (node prepare-data)."""
        return self.task(description, total).advance

    def update(self, task: ByteTask) -> None:
        """Show `task`'s progress: redraw its bar, or log a line when `log_every` has passed or it ended."""
        if self._bars is not None and task._bar_task is not None:
            self._bars.update(task._bar_task, completed=task.done)
            if task.outcome == Outcome.FAILED:
                self._bars.update(task._bar_task, description=f"{task.description} [failed]")
            return
        now = self.clock()
        if task.outcome is not None or now - task._last_log >= self.log_every:
            task._last_log = now
            self.log.info(task.line())
