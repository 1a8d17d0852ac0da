"""StageWorkers for a block of a unit test, closed after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from node.config import SwarmConfig
from node.stage.stage_worker import StageWorker


@contextlib.contextmanager
def stage_workers(config: SwarmConfig, *stages: int, **options: Any) -> Iterator[list[StageWorker]]:
    """A StageWorker of `config` for each of `stages`, in that order (`options` go to each, e.g.
    device); every one is closed (its compute thread ended) after the block, whatever it raised."""
    workers: list[StageWorker] = []
    try:
        for stage in stages:
            workers.append(StageWorker(config, stage, **options))
        yield workers
    finally:
        for worker in workers:
            worker.close()
