"""A test-only peer that joins honestly and then computes wrong: `python -m tests.helpers.faulty_node
KIND node-arguments...` runs the ordinary node with its block stages' computation altered.

KIND (FaultKind):
    scale     outputs multiplied by 1.5
    noise     outputs replaced by Gaussian noise of the same norm (the gradient to the input is 0)
    zeros     outputs replaced by zeros (the gradient to the input is 0)
    signflip  outputs right, gradients wrt the input sign-flipped

Only the computation changes: the peer speaks the protocol correctly, signs its records and
answers spot-checks the way it answers traffic, as a buggy or malicious GPU would.
"""

from __future__ import annotations

import sys
from enum import StrEnum

import torch
from torch import Tensor

from node.model import llama


class FaultKind(StrEnum):
    SCALE = "scale"
    NOISE = "noise"
    ZEROS = "zeros"
    SIGNFLIP = "signflip"


class _FlipGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return -grad


def corrupt(kind: FaultKind, out: Tensor) -> Tensor:
    """The altered output; kept in the autograd graph so the peer's backward still runs."""
    if kind == FaultKind.SCALE:
        return out * 1.5
    if kind == FaultKind.NOISE:
        noise = torch.randn_like(out)
        return out * 0.0 + noise * (out.detach().norm() / noise.norm().clamp_min(1e-12))
    if kind == FaultKind.ZEROS:
        return out * 0.0
    return _FlipGradient.apply(out)


def install(kind: FaultKind) -> None:
    honest_forward = llama.BlockStage.forward

    def faulty_forward(self: llama.BlockStage, hidden: Tensor) -> Tensor:
        return corrupt(kind, honest_forward(self, hidden))

    llama.BlockStage.forward = faulty_forward  # type: ignore[method-assign]


def main() -> int:
    kind = FaultKind(sys.argv[1])
    install(kind)
    from node.cli import main as node_main

    print(f"FAULTY NODE: {kind}", flush=True)
    return node_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
