"""Deciding one check from a replica's commitment, its opening of one layer and what the checker
itself saw of the hop (pure: no networking; runs on the checker's compute thread, the replay on its
device; docs/verification.md, "What a check compares").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from node.pipeline.check_wire import WEIGHTS, CommitmentReply, backward_name, forward_name, from_exact
from node.pipeline.hop_observations import Observed
from node.pipeline.layer_replay import replay_layer
from node.pipeline.spot_check import Finding, RecomputeTolerance, arrived_as, digest
from node.runtime.device import DeviceTransfers
from node.stage.layers import LayerLayout


@dataclass(frozen=True)
class Judgement:
    """A check's finding, the evidence in words, and the replay's relative errors (None: not reached)."""

    finding: Finding
    detail: str
    forward_error: float | None = None
    backward_error: float | None = None
    tolerance: float | None = None


def boundaries_to_open(layer: int, layers: int, observed: Observed, has_backward: bool) -> tuple[list[int], list[int]]:
    """The forward and backward boundaries a checker asks to see: the picked layer's four, and the
    ends it can compare with what it sent or received itself."""
    forward = {layer, layer + 1}
    if observed.sent_input is not None:
        forward.add(0)
    if observed.received_output is not None:
        forward.add(layers)
    backward: set[int] = set()
    if has_backward:
        backward = {layer, layer + 1}
        if observed.received_grad_input is not None:
            backward.add(0)
        if observed.sent_grad_output is not None:
            backward.add(layers)
    return sorted(forward), sorted(backward)


def _hidden_shape(observed: Observed) -> tuple[int, ...]:
    seen = (observed.sent_input, observed.received_output, observed.received_grad_input, observed.sent_grad_output)
    return tuple(next(t for t in seen if t is not None).shape)


def judge(
    layout: LayerLayout,
    tolerance: RecomputeTolerance,
    commitment: CommitmentReply,
    layer: int,
    opening: dict[str, Tensor],
    observed: Observed,
    transfers: DeviceTransfers,
) -> Judgement:
    """The finding of one check. Every tensor in `opening` must hash to the commitment, the ends
    must be what the checker sent and received, and the layer recomputed at the committed weights
    must give the committed output and input gradient within the precision's tolerance."""
    layers = len(commitment.weights)
    saw_backward = observed.received_grad_input is not None or observed.sent_grad_output is not None
    if saw_backward and not commitment.has_backward:
        # its receipt is completed before its backward's gradient leaves it: this peer saw that backward
        return Judgement(Finding.MALFORMED, "it commits to no backward for a microbatch whose backward it ran")
    wanted_forward, wanted_backward = boundaries_to_open(layer, layers, observed, commitment.has_backward)
    shape = _hidden_shape(observed)
    try:
        weights = from_exact(opening[WEIGHTS], (layout.numel,), "the layer's weights")
        forward = {i: from_exact(opening[forward_name(i)], shape, f"h_{i}") for i in wanted_forward}
        backward = {j: from_exact(opening[backward_name(j)], shape, f"g_{j}") for j in wanted_backward}
    except (KeyError, ValueError) as e:
        return Judgement(Finding.MALFORMED, f"opening of layer {layer}: {e}")

    uncommitted = Finding.NOT_WHAT_IT_COMMITTED
    if digest(weights) != commitment.weights[layer]:
        return Judgement(uncommitted, f"the weights of layer {layer} it showed are not those it committed to")
    for shown, digests, symbol in ((forward, commitment.forward, "h"), (backward, commitment.backward, "g")):
        for index, tensor in shown.items():
            if digest(tensor) != digests[index]:
                return Judgement(uncommitted, f"{symbol}_{index} it showed is not what it committed to")

    # (what this peer sent, what the replica says it received), then (what it says it sent, what arrived)
    received = (
        (observed.sent_input, forward.get(0), "input", observed.token_ids),
        (observed.sent_grad_output, backward.get(layers), "gradient", None),
    )
    for sent, claimed, what, token_ids in received:
        if sent is not None and claimed is not None and not arrived_as(sent, claimed, token_ids):
            return Judgement(Finding.NOT_WHAT_IT_RECEIVED, f"the {what} it says it received is not what this peer sent")
    returned = (
        (forward.get(layers), observed.received_output, "output", observed.token_ids),
        (backward.get(0), observed.received_grad_input, "input gradient", None),
    )
    for claimed, arrived, what, token_ids in returned:
        if claimed is not None and arrived is not None and not arrived_as(claimed, arrived, token_ids):
            return Judgement(Finding.NOT_WHAT_IT_SENT, f"the {what} this peer received is not what it says it sent")

    to_device = transfers.to_device
    grad_output = backward.get(layer + 1)
    forward_error, backward_error = replay_layer(
        layout,
        layout.unflatten(to_device(weights)),
        to_device(forward[layer]),
        to_device(forward[layer + 1]),
        None if grad_output is None else to_device(grad_output),
        None if grad_output is None else to_device(backward[layer]),
    )
    allowed = tolerance.of(commitment.precision)
    errors = dict(forward_error=forward_error, backward_error=backward_error, tolerance=allowed)
    where = f"layer {layer} recomputed at its committed weights"
    precision = commitment.precision.value
    if not forward_error <= allowed:  # NaN included
        detail = f"{where}: output {forward_error:.3g} off (tolerance {allowed:g}, {precision})"
        return Judgement(Finding.WRONG_FORWARD, detail, **errors)
    if backward_error is not None and not backward_error <= allowed:
        detail = f"{where}: input gradient {backward_error:.3g} off (tolerance {allowed:g}, {precision})"
        return Judgement(Finding.WRONG_BACKWARD, detail, **errors)
    return Judgement(Finding.PASSED, where, **errors)
