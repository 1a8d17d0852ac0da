"""The ways into a stage worker's module and optimizer for code outside node/stage/.

A StageWorker's module is the floor's own: averaging, recovery, the pipeline's checks, the server
and the simulation read its weights and moments through these functions (and the worker's
methods), never through `worker.module` (tests/unit/test_layout.py holds every package to it).
Most are reads: views, copies and shapes of the weights, the optimizer's moments. Two hand in or
hand out something that writes: `live_parameters`, which an outer replica steers in place
(node/averaging/outer_replica.py), and `load_optimizer_moments`, a donor's moments for a worker
that has just adopted its weights (StageWorker.adopt).

Like every use of the module, each function must run on the worker's compute thread
(`await worker.compute(weight_shapes, worker)`), except where the worker's thread contract says
otherwise (an outer replica built before the service trains, on a CPU worker).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from node.stage.inner_optimizer import adam_moments, load_adam_moments
from node.stage.stage_worker import StageWorker


def weight_views(worker: StageWorker) -> dict[str, Tensor]:
    """The module's state by name, detached views of its own tensors on the stage's device (no
    copy: read them before the next step or load changes them)."""
    return {name: tensor.detach() for name, tensor in worker.module.state_dict().items()}


def weight_shapes(worker: StageWorker) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the module's state, by name: what a download must match."""
    return {name: tuple(tensor.shape) for name, tensor in worker.module.state_dict().items()}


def weights_copy(worker: StageWorker) -> dict[str, Tensor]:
    """A copy of every parameter, by name, on the stage's device: the weights as they are now,
    kept however training goes on."""
    return {name: p.detach().clone() for name, p in worker.module.named_parameters()}


def live_parameters(worker: StageWorker) -> dict[str, nn.Parameter]:
    """The module's parameters themselves, by name in the module's order: what an outer replica
    reads and, applying an outer step, writes in place (between two inner steps, on the compute
    thread)."""
    return dict(worker.module.named_parameters())


def optimizer_moments(worker: StageWorker, dtype: torch.dtype) -> tuple[dict[str, Tensor], int]:
    """The inner AdamW's moments as `dtype` copies by weight name, and its step count (adam_moments)."""
    return adam_moments(worker.optimizer, worker.module.named_parameters(), dtype)


def load_optimizer_moments(worker: StageWorker, moments: Mapping[str, Tensor], steps: int) -> None:
    """Give the worker's fresh AdamW the moments another replica exported (load_adam_moments);
    ValueError, optimizer untouched, when they do not fit its weights."""
    load_adam_moments(worker.optimizer, worker.module.named_parameters(), moments, steps, worker.transfers)
