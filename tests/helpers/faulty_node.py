"""A test-only peer that joins honestly and computes wrong: `python -m tests.helpers.faulty_node KIND
[--fault-after SECONDS] node-arguments...` runs the ordinary node with its block stage altered.

KIND (FaultKind):
    scale         every nn.Linear output of the block stage x1.5 (the fault of issue 40)
    noise         every decoder layer's output replaced by Gaussian noise of the same norm
    zeros         every decoder layer's output replaced by zeros
    signflip      outputs right, every decoder layer's gradient with respect to its input sign-flipped
    checks_aware  the stage's output x1.5 on its traffic, while what it tells checks is what an
                  honest replica would have computed: honest on checks only
    weights_lie   computes like `scale`; asked for a layer's weights, it shows them x1.5 (which
                  reproduce its outputs exactly) instead of those it committed to

`--fault-after` starts the fault that many seconds after the process started (a fault that appears
once the stage has settled). Only the block stage's own modules are altered: the peer speaks the
protocol correctly, signs its records, and replays other peers' layers honestly when it checks them.
The same alterations apply to one worker in-process (`make_faulty`, `make_liar`), for unit tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from enum import StrEnum

import torch
from torch import Tensor, nn

from node.model import llama

FAULT_SCALE = 1.5
Active = Callable[[], bool]


class FaultKind(StrEnum):
    SCALE = "scale"
    NOISE = "noise"
    ZEROS = "zeros"
    SIGNFLIP = "signflip"
    CHECKS_AWARE = "checks_aware"
    WEIGHTS_LIE = "weights_lie"


class _FlipGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return -grad


def _always() -> bool:
    return True


def _replaced(kind: FaultKind, out: Tensor) -> Tensor:
    """A decoder layer's altered output; kept in the autograd graph so the peer's backward still runs."""
    if kind == FaultKind.NOISE:
        noise = torch.randn_like(out)
        return out * 0.0 + noise * (out.detach().norm() / noise.norm().clamp_min(1e-12))
    if kind == FaultKind.ZEROS:
        return out * 0.0
    return _FlipGradient.apply(out)


def make_faulty(stage: nn.Module, kind: FaultKind, active: Active = _always, scale: float = FAULT_SCALE) -> None:
    """Alter one block stage module's computation (forward hooks: a stash's functional_call and a
    layer-by-layer recomputation go through them too); `scale` is the factor of the scaling kinds."""

    def scaled(module: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
        return out * scale if active() else out

    def replaced(module: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
        return _replaced(kind, out) if active() else out

    if kind in (FaultKind.SCALE, FaultKind.WEIGHTS_LIE):
        for module in stage.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(scaled)
    elif kind == FaultKind.CHECKS_AWARE:  # the whole stage's output: layer-by-layer recomputations stay honest
        stage.register_forward_hook(scaled)
    else:
        for layer in stage.layers:
            layer.register_forward_hook(replaced)


def make_liar(keeper, server, kind: FaultKind, active: Active = _always) -> None:
    """What a checks-aware or weight-lying replica tells its checkers (instance-level patches of its
    ReceiptKeeper and CheckServer, node/pipeline/receipts.py and check_server.py)."""
    if kind == FaultKind.CHECKS_AWARE:
        honest_receipt, honest_complete = keeper.receipt, keeper.book.complete

        def receipt(key, token, received, sent):  # the output x1.5 came from the fault: claim it without
            return honest_receipt(key, token, received, sent / FAULT_SCALE if active() else sent)

        def complete(key, grad_received, grad_sent):
            honest_complete(key, grad_received, grad_sent / FAULT_SCALE if active() else grad_sent)

        keeper.receipt, keeper.book.complete = receipt, complete
    elif kind == FaultKind.WEIGHTS_LIE:
        honest_layer = server.opened_layer

        def opened_layer(weights, layer: int) -> Tensor:
            flat = honest_layer(weights, layer).clone()
            if active():  # the Linear weights x1.5 reproduce its outputs: show those instead
                offset = 0
                for name, numel in zip(server.layout.names, server.layout.numels):
                    if name.endswith("_proj.weight"):
                        flat[offset : offset + numel] *= FAULT_SCALE
                    offset += numel
            return flat

        server.opened_layer = opened_layer


def install(kind: FaultKind, after: float = 0.0) -> None:
    """Make every block stage this process builds faulty, `after` seconds from now."""
    from node.pipeline import check_server

    started = time.monotonic()

    def active() -> bool:
        return time.monotonic() - started >= after

    honest_init = llama.BlockStage.__init__

    def faulty_init(self: llama.BlockStage, *args, **kwargs) -> None:
        honest_init(self, *args, **kwargs)
        make_faulty(self, kind, active)

    llama.BlockStage.__init__ = faulty_init  # type: ignore[method-assign]
    honest_server_init = check_server.CheckServer.__init__

    def lying_server_init(self, settings, transport, keeper, membership) -> None:
        honest_server_init(self, settings, transport, keeper, membership)
        make_liar(keeper, self, kind, active)

    if kind in (FaultKind.CHECKS_AWARE, FaultKind.WEIGHTS_LIE):
        check_server.CheckServer.__init__ = lying_server_init  # type: ignore[method-assign]


def main() -> int:
    kind = FaultKind(sys.argv[1])
    args = sys.argv[2:]
    after = 0.0
    if args[:1] == ["--fault-after"]:
        after, args = float(args[1]), args[2:]
    install(kind, after)
    from node.cli import main as node_main

    print(f"FAULTY NODE: {kind}, from {after:.0f} s", flush=True)
    return node_main(args)


if __name__ == "__main__":
    sys.exit(main())
