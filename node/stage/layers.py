"""A block stage one decoder layer at a time: how a layer's weights are laid out, and the boundaries
a replica commits to when it answers a spot-check (pure torch, no networking; docs/verification.md).

A block stage is `layers_per_stage` decoder layers, h_0 -> layer 0 -> h_1 -> ... -> h_L, with the
rotary tables computed once from the stage's input (node/model/llama.py, BlockStage.forward). Its
backward runs the other way, g_L (the gradient that arrived from the next stage) -> ... -> g_0 (the
gradient sent to the previous one). A replica commits to all 2(L+1) boundaries and to each layer's
weights; a checker then needs one layer's weights and four boundaries to replay that layer
(node/pipeline/layer_replay.py), a tenth of a 10-layer stage's weights and compute.

Every function here runs on the caller's compute thread, on the tensors' device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call

from node.config import ModelConfig
from node.model.llama import DecoderLayer, rotary_cos_sin
from node.stage.precision import StagePrecision
from node.stage.stage_worker import StageWorker


class LayerLayout:
    """The parameters of one decoder layer, in a fixed order: how a layer's weights are laid out
    flat, hashed and sent (every block stage has the same layers, node/model/llama.py)."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        with torch.device("meta"):  # shapes only: a replay supplies every weight
            self.reference = DecoderLayer(model)
        named = list(self.reference.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.numel = sum(self.numels)

    def of_stage(self, named: Mapping[str, Tensor], index: int) -> dict[str, Tensor]:
        """Layer `index`'s weights out of a whole stage's (`layers.{index}.` names), detached."""
        return {name: named[f"layers.{index}.{name}"].detach() for name in self.names}

    def flatten(self, weights: Mapping[str, Tensor]) -> Tensor:
        """One layer's weights as a flat fp32 tensor, in this layout's order."""
        return torch.cat([weights[name].detach().reshape(-1).float() for name in self.names])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of a flat tensor as one layer's named weights; ValueError when the size is not a layer's."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"a layer has {self.numel} weights, got a tensor of shape {tuple(flat.shape)}")
        pieces = torch.split(flat, self.numels)
        return {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}


def rotary_for(model: ModelConfig, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """The rotary tables a block stage computes from its input (BlockStage.forward does the same)."""
    head_dim = model.hidden_size // model.num_attention_heads
    return rotary_cos_sin(hidden.shape[1], head_dim, model.rope_theta, hidden.device, hidden.dtype)


def stage_boundaries(
    stage: nn.Module | StageWorker,
    layout: LayerLayout,
    weights: Mapping[str, Tensor],
    inputs: Tensor,
    grad_output: Tensor | None,
    precision: StagePrecision,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """h_0..h_L and, with a gradient at the output, g_0..g_L of a block stage (`stage`: its module,
    whose `layers` run in turn, or the worker that holds it, as a replica's check answers do) at
    `weights` (a whole stage's, by name), in `precision` as the replica's training does. The ends
    are `inputs` and `grad_output` themselves."""
    module = stage.module if isinstance(stage, StageWorker) else stage
    layers = list(module.layers)
    leaves: list[Tensor] = []
    outputs: list[Tensor] = []
    with torch.enable_grad(), precision.autocast():
        cos, sin = rotary_for(layout.model, inputs)
        hidden = inputs
        for index, layer in enumerate(layers):
            leaf = hidden.detach().requires_grad_(grad_output is not None)
            hidden = functional_call(layer, layout.of_stage(weights, index), (leaf, cos, sin))
            leaves.append(leaf)
            outputs.append(hidden)
    forward = [inputs, *(out.detach().float() for out in outputs)]
    if grad_output is None:
        return forward, None
    backward: list[Tensor] = [grad_output]
    gradient = grad_output
    for leaf, out in zip(reversed(leaves), reversed(outputs)):
        (gradient,) = precision.grad(out, [leaf], gradient.to(out.dtype))
        backward.append(gradient.detach().float())
    return forward, backward[::-1]
