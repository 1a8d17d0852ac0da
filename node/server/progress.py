"""`node join`'s own live status line: stage, step, microbatches/s, loss, peers seen."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.live import Live
from rich.table import Table

from node.server.reading import ServiceReading

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceSummary:
    """What the stage service shows of itself on its own terminal (derived every refresh)."""

    stage: int
    state: str
    step: int
    rate: float  # stage 0: microbatches completed per second; others: measured compute capacity
    loss: float | None
    peers: int
    done: int
    retried: int
    dropped: int

    @classmethod
    def of(cls, reading: ServiceReading) -> ServiceSummary:
        return cls(
            stage=reading.stage,
            state=reading.state,
            step=reading.inner_step,
            rate=reading.completion_rate if reading.stage == 0 else reading.throughput,
            loss=reading.loss,
            peers=reading.peers_seen,
            done=reading.completed,
            retried=reading.retried,
            dropped=reading.dropped,
        )


class ProgressDisplay:
    """A compact rich panel on a terminal; a log line every `log_every` seconds otherwise (or --quiet)."""

    def __init__(self, read: Callable[[], ServiceReading], quiet: bool = False, log_every: float = 10.0):
        self.read = read
        self.console = Console(file=sys.stderr)
        self.live_view = not quiet and self.console.is_terminal
        self.log_every = log_every
        self._live: Live | None = None

    def summary(self) -> dict:
        return asdict(ServiceSummary.of(self.read()))

    def line(self) -> str:
        s = self.summary()
        loss = "-" if s["loss"] is None else f"{s['loss']:.3f}"
        unit = "microbatches/s (completed)" if s["stage"] == 0 else "microbatches/s (compute)"
        return (
            f"stage {s['stage']} {s['state']} | step {s['step']} | {s['rate']:.2f} {unit} | loss {loss} | "
            f"peers seen {s['peers']} | done {s['done']} retried {s['retried']} dropped {s['dropped']}"
        )

    def render(self) -> Table:
        s = self.summary()
        table = Table.grid(padding=(0, 2))
        for key in ("stage", "state", "step", "rate", "loss", "peers", "done", "retried", "dropped"):
            value = s[key]
            table.add_row(key, "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value))
        return table

    async def run(self) -> None:
        if self.live_view:
            with Live(self.render(), console=self.console, refresh_per_second=2) as live:
                self._live = live
                while True:
                    await asyncio.sleep(0.5)
                    live.update(self.render())
        while True:
            await asyncio.sleep(self.log_every)
            logger.info(self.line())

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
