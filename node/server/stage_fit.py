"""Which stages this peer's device can hold, by node/model/memory.py's estimate: what `node join`
checks before serving (`--stage N`: that stage, refused when it does not fit) and before choosing
(`--stage auto`: the neediest stage among those that fit, refused when none does), and what
`node doctor` reports.

A stage fits when its estimate at `training.min_in_flight` microbatches does; the window then
widens to what the memory holds, up to `training.max_in_flight` (`fitting_in_flight`). The estimate
is that of the precision `training.precision` resolves to on the device (bf16 on a bf16 GPU under
`auto`, fp32 on a CPU) and of the device's kind (host memory holds the edge copies and glibc's slack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from node.config import SwarmConfig, TrainingConfig
from node.model.memory import DeviceMemory, StageMemory, available_memory, fitting_in_flight, format_bytes
from node.stage.precision import resolve_precision

__all__ = ["DeviceUnusable", "StageFit", "fitting_stages", "measure_device", "no_stage_fits", "stage_fits"]


class DeviceUnusable(RuntimeError):
    """The device's free memory cannot be read: torch does not have it (a CUDA device on a CPU build)."""


@dataclass(frozen=True)
class StageFit:
    """One stage on this device: the widest window that fits (None: not even min_in_flight) and the
    estimate at that window (at min_in_flight when none fits)."""

    stage: int
    in_flight: int | None
    estimate: StageMemory

    @property
    def fits(self) -> bool:
        return self.in_flight is not None


def measure_device(device: str, available: Callable[[str], DeviceMemory] | None = None) -> DeviceMemory:
    """`device`'s free memory now (`available`: how to read it, available_memory by default);
    DeviceUnusable with torch's reason when it cannot be read."""
    try:
        return (available or available_memory)(device)
    except (RuntimeError, AssertionError, ValueError) as e:  # torch's answers for a device it lacks
        raise DeviceUnusable(f"cannot use device {device}: {e}") from None


def stage_fits(config: SwarmConfig, stages: Sequence[int], memory: DeviceMemory) -> list[StageFit]:
    """How each of `stages` fits in `memory` (the device's free bytes), in the precision the swarm's
    training.precision resolves to there."""
    precision = resolve_precision(config.training.precision, memory.device)
    fits = []
    for stage in stages:
        in_flight, estimate = fitting_in_flight(config, stage, memory.free, precision=precision, device=memory.device)
        fits.append(StageFit(stage, in_flight, estimate))
    return fits


def fitting_stages(fits: Sequence[StageFit]) -> frozenset[int]:
    return frozenset(fit.stage for fit in fits if fit.fits)


def no_stage_fits(swarm_id: str, training: TrainingConfig, fits: Sequence[StageFit], memory: DeviceMemory) -> str:
    """One line with the numbers: the least demanding stage, what it needs, what the device has."""
    least = min(fits, key=lambda fit: fit.estimate.total)
    return (
        f"no stage of swarm {swarm_id} fits {memory.device}: the least demanding, stage {least.stage}, "
        f"needs about {format_bytes(least.estimate.total)} with {training.min_in_flight} microbatches "
        f"in flight but {memory.device} has {format_bytes(memory.free)} free: use a larger device, or a swarm "
        f"with more stages or a smaller training.min_in_flight"
    )
