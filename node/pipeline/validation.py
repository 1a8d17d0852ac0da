"""Held-out loss on stage 0: every `validation.interval` seconds, a stage-0 peer sends the same
`validation.batches` held-out microbatches through the swarm as evaluation microbatches
(protocol/microbatch_header.py: forward only, normal stage order, no optimizer effect) and publishes
their mean loss, with its inner step at the time, in its record (`val_loss`, `val_step`).

The batches are drawn once, from node/model/data.py's `open_heldout` (a prepared directory's val.bin,
or another stream of the embedded chain), so successive values measure the same tokens and the
values of different stage-0 peers compare. A validation counts only when every batch came back:
the mean of a varying subset would move with which batches failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from node.config import SwarmConfig, TrainingConfig, ValidationConfig
from node.model.data import DataError, TokenSource, open_heldout

logger = logging.getLogger(__name__)

NOT_READY_POLL = 1.0  # seconds between two looks at a pipeline that has a stage without a peer

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    """Mean cross-entropy over every held-out token (nats/token)."""
    step: int
    """This peer's inner step when the validation started."""


def heldout_batches(t: TrainingConfig, validation: ValidationConfig, source: TokenSource) -> list[Batch]:
    """The fixed held-out microbatches: the first `validation.batches` of the source, each of the
    training microbatch's shape."""
    return [source.next_batch(t.microbatch_size, t.sequence_length) for _ in range(validation.batches)]


class Validator:
    """Measures this stage-0 peer's held-out loss through the swarm, periodically."""

    def __init__(
        self,
        interval: float,
        batches: list[Batch],
        evaluate: Callable[[torch.Tensor, torch.Tensor], Awaitable[float | None]],
        step: Callable[[], int],
    ) -> None:
        if interval <= 0 or not batches:
            raise ValueError("a validator needs an interval > 0 and at least one batch")
        self.interval, self.batches, self.evaluate, self.step = interval, batches, evaluate, step
        self.latest: ValidationResult | None = None
        self.failed = 0  # validations abandoned because a microbatch was dropped

    async def validate_once(self) -> ValidationResult | None:
        """Every batch through the swarm; the result (also kept as `latest`), or None if one was dropped."""
        step = self.step()
        losses = []
        for tokens, targets in self.batches:
            loss = await self.evaluate(tokens, targets)
            if loss is None:
                self.failed += 1
                logger.info(f"validation at step {step} abandoned: a held-out microbatch was dropped")
                return None
            losses.append(loss)
        self.latest = ValidationResult(sum(losses) / len(losses), step)  # equal-sized batches: the token mean
        logger.info(f"validation loss {self.latest.loss:.4f} at step {step}")
        return self.latest

    async def run(self, stop: asyncio.Event, ready: Callable[[], bool]) -> None:
        """Validate as soon as every stage is served, then every `interval` seconds, until `stop`."""
        while not stop.is_set():
            if not ready():
                await _wait(stop, NOT_READY_POLL)
                continue
            await self.validate_once()
            await _wait(stop, self.interval)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


def open_validator(
    config: SwarmConfig,
    data_path: str | None,
    evaluate: Callable[[torch.Tensor, torch.Tensor], Awaitable[float | None]],
    step: Callable[[], int],
) -> Validator | None:
    """A stage-0 peer's validator, or None (with the reason logged) when validation is off or its
    data has no held-out part: training goes on without it."""
    if config.validation.interval <= 0:
        return None
    try:
        source = open_heldout(config, data_path)
    except DataError as e:
        logger.warning(f"no validation loss: {e}")
        return None
    return Validator(
        config.validation.interval, heldout_batches(config.training, config.validation, source), evaluate, step
    )
