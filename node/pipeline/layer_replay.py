"""A checker's replay of one decoder layer of a block stage, from the weights and boundaries a
replica opened (pure torch, no networking; docs/verification.md). How a layer's weights are laid
out and the boundaries a replica commits to are the stage floor's: node/stage/layers.py.

Every function here runs on the caller's compute thread, on the tensors' device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.func import functional_call

from node.pipeline.spot_check import update_error
from node.stage.layers import LayerLayout, rotary_for


def replay_layer(
    layout: LayerLayout,
    weights: Mapping[str, Tensor],
    inputs: Tensor,
    claimed_output: Tensor,
    grad_output: Tensor | None = None,
    claimed_grad_input: Tensor | None = None,
) -> tuple[float, float | None]:
    """One decoder layer recomputed in fp32 at `weights`: the relative error of the claimed output's
    update (update_error) and, given the gradient at its output, of the claimed gradient at its
    input. One read of the device for both."""
    leaf = inputs.detach().requires_grad_(grad_output is not None)
    with torch.enable_grad():
        cos, sin = rotary_for(layout.model, leaf)
        output = functional_call(layout.reference, dict(weights), (leaf, cos, sin))
    errors = [update_error(claimed_output, output.detach(), inputs)]
    if grad_output is not None and claimed_grad_input is not None:
        (grad_input,) = torch.autograd.grad(output, [leaf], grad_output)
        errors.append(update_error(claimed_grad_input, grad_input, grad_output))
    values = torch.stack(errors).tolist()
    return values[0], (values[1] if len(values) > 1 else None)
