"""The checkpointing baseline (recovery.strategy = "checkpoint"): every stage saves its weights
every `checkpoint_every` inner steps; a lost stage is rebuilt from its last save, rolling that stage
back to the step of the save (the baseline CheckFree is compared against: docs/algorithms.md).

Layout: <checkpoint_dir>/<swarm_id>/stage<k>/step<inner_step, 10 digits>.pt, each file a plain
dict {"format", "stage", "inner_step", "weights": {name: tensor}} written with torch.save and read
with torch.load(weights_only=True) (no pickled code runs; safetensors is not installed). A save
goes to a temporary file in the same directory, is fsynced and then os.replace'd into place, so a
crash leaves either the old set of checkpoints or the new one, never a torn file under a real
name. The last `keep` saves are kept; a file that cannot be read is skipped in favour of an
older one. Only weights are saved: a reloaded stage starts a fresh inner optimizer, like every
other rebuild.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from node.stage.stage_worker import StageWorker

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_SUFFIX", "checkpoint_root", "load_latest", "run_checkpoints", "save_checkpoint", "stage_dir"]

FORMAT = "pipeswarm-checkpoint/1"
CHECKPOINT_SUFFIX = ".pt"
_NAME = re.compile(r"^step(\d{10})\.pt$")


def checkpoint_root(checkpoint_dir: str | os.PathLike, swarm_id: str) -> Path:
    """<checkpoint_dir>/<swarm_id>: the `root` every other function here takes."""
    return Path(checkpoint_dir) / swarm_id


def stage_dir(root: str | os.PathLike, stage: int) -> Path:
    return Path(root) / f"stage{stage}"


def _saved(directory: Path) -> list[tuple[int, Path]]:
    """(inner_step, path) of every checkpoint file in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(
    root: str | os.PathLike, stage: int, weights: dict[str, Tensor], inner_step: int, keep: int = 2
) -> Path:
    """Write `weights` as stage `stage`'s checkpoint at `inner_step` atomically; prune to the last
    `keep`. Blocking file IO: call it off the event loop (asyncio.to_thread)."""
    if keep < 1 or inner_step < 0:
        raise ValueError("keep must be >= 1 and inner_step >= 0")
    directory = stage_dir(root, stage)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"step{inner_step:010d}{CHECKPOINT_SUFFIX}"
    payload = {
        "format": FORMAT,
        "stage": stage,
        "inner_step": inner_step,
        "weights": {name: t.detach().to("cpu") for name, t in weights.items()},  # host: written to a file
    }
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=CHECKPOINT_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    for _, old in _saved(directory)[:-keep]:
        with contextlib.suppress(OSError):
            old.unlink()
    return target


def load_latest(root: str | os.PathLike, stage: int) -> tuple[dict[str, Tensor], int] | None:
    """(weights, inner_step) of stage `stage`'s newest readable checkpoint under `root`, or None."""
    for step, path in reversed(_saved(stage_dir(root, stage))):
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)  # host: the rebuild moves it
        except Exception as e:  # torn, truncated or foreign file: an older save may still be good
            logger.warning(f"skipping unreadable checkpoint {path}: {e!r}")
            continue
        if not _is_checkpoint(raw, stage, step):
            logger.warning(f"skipping {path}: not a stage-{stage} checkpoint at step {step}")
            continue
        weights = raw["weights"]
        return weights, step
    return None


def _is_checkpoint(raw: object, stage: int, step: int) -> bool:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return False
    weights = raw.get("weights")
    return (
        raw.get("stage") == stage
        and raw.get("inner_step") == step
        and isinstance(weights, dict)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in weights.items())
    )


async def run_checkpoints(
    worker: StageWorker,
    root: str | os.PathLike,
    every: int,
    check_period: float,
    on_saved: Callable[[int], None] | None = None,
) -> None:
    """Save `worker`'s weights each time its inner_step passes a multiple of `every`, until cancelled.

    The copy is taken on the worker's compute thread (consistent weights between two steps), the
    file written on another thread: training goes on while it is written.
    """
    last_saved = (worker.inner_step // every) * every
    while True:
        await asyncio.sleep(check_period)
        step = worker.inner_step
        if step // every * every <= last_saved:
            continue
        weights, step = await worker.compute(lambda: (worker.state_dict(), worker.inner_step))
        try:
            await asyncio.to_thread(save_checkpoint, root, worker.stage, weights, step)
        except OSError as e:
            logger.warning(f"checkpoint of stage {worker.stage} at step {step} failed: {e!r}")
            continue
        last_saved = step // every * every
        logger.info(f"saved checkpoint of stage {worker.stage} at step {step}")
        if on_saved is not None:
            on_saved(step)
