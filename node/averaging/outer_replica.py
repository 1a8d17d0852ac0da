"""One replica's outer optimizer, bound to its stage's parameters: the local half of a gossip round.

No networking and no event loop here: round_protocol.py and diloco.py move tensors between
replicas; this module captures where a round starts, checks what a partner sent and applies a new
outer state to the live weights (docs/gossip.md, "Training during a round"). The formulas are
node/averaging/noloco.py. Every method that reads or writes the parameters must run on the
worker's compute thread (StageWorker.compute), between two inner steps: that thread is what keeps
them consistent, no lock is taken.

Devices: phi, momentum, theta and Delta live on the parameters' device. What goes on the wire is
encoded at the round's start (node/averaging/gossip_codec.py: 4-bit Delta codes with error
feedback, phi as residues on a dithered grid) and copied to the host there (`RoundStart.wire`: the event loop sends
it and must not touch the device); what a partner sent arrives in host buffers (`host_buffers`)
that `receive` moves onto the device and decodes before anything is computed with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from node.averaging.gossip_codec import GossipCodec, PhiDither, WireLayout
from node.averaging.noloco import (
    OuterState,
    apply_to_parameters,
    diloco_outer_step,
    outer_step,
    pseudo_gradient,
    validate_partner_update,
)
from node.averaging.plausibility import PartnerMeasures, PlausibilityBounds, implausible, measure
from node.config import GossipConfig
from node.runtime.device import DeviceTransfers
from node.runtime.finite import is_finite

__all__ = ["STEPPED", "OuterReplica", "RoundOutcome", "RoundStart", "RoundStatus"]


class RoundStatus(StrEnum):
    """How one round attempt ended."""

    APPLIED = "applied"  # an outer step with one or more partners
    LONE = "lone"  # an outer step alone (n = 1): no free partner in time
    BUSY = "busy"  # every partner asked was exchanging (or this peer was)
    ABORTED = "aborted"  # timeout, disconnect, refusal, or the outer state replaced: weights untouched
    REJECTED = "rejected"  # the partner's tensors failed validation: it is banned
    SKIPPED = "skipped"  # no inner step since the last round: nothing to share


STEPPED = frozenset({RoundStatus.APPLIED, RoundStatus.LONE})  # the round counts: the next is H steps away


@dataclass
class RoundOutcome:
    """What one round attempt did."""

    status: RoundStatus
    round: int
    partners: tuple[str, ...] = ()
    detail: str = ""
    divergence: float | None = None
    sent_bytes: int | None = None  # framed bytes this replica sent in the exchange (None: no exchange)
    seconds: float | None = None  # from the exchange's first message to the outer step, on this side


@dataclass
class RoundStart:
    """This replica at a round's start: the outer state it started from, theta and Delta."""

    state: OuterState
    theta: list[Tensor]
    delta: list[Tensor]
    inner_step: int
    has_progress: bool  # Delta is not all zero
    key: PhiDither | None  # how this round codes phi (None: Delta alone, DiLoCo)
    wire: list[Tensor]  # what this replica sends, on the host: WireLayout order (gossip_codec.py)
    sent_delta: list[Tensor]  # Delta as partners decode `wire` (DiLoCo averages this one, as they do)
    residual: list[Tensor]  # the error-feedback residual once `wire` is sent: committed by `apply`
    capture_seconds: float = 0.0  # how long the capture took, waiting for the compute thread included


class OuterReplica:
    """The outer state (phi, momentum, round) of one replica and the parameters it steers."""

    def __init__(self, parameters: Mapping[str, torch.nn.Parameter], settings: GossipConfig):
        """`parameters`: the live parameters this replica steers, by name in the module's order (a
        worker's come from node/stage/access.py's live_parameters)."""
        self.settings = settings
        self.bounds = PlausibilityBounds()
        self.params = list(parameters.values())
        self.names = list(parameters)
        self.transfers = DeviceTransfers(self.params[0].device)
        self.codec = GossipCodec(settings.delta_block, settings.phi_bits, settings.phi_step)
        with torch.no_grad():  # built before the service trains: safe off the compute thread
            self.state = OuterState.from_parameters(self.params)
        # what rounding left out of the Delta this replica sent so far (error feedback, gossip_codec.py)
        self.residual = [torch.zeros_like(phi) for phi in self.state.phi]

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @property
    def total_numel(self) -> int:
        return sum(p.numel() for p in self.params)

    # ---- a round -------------------------------------------------------------------------------

    def capture_start(self, inner_step: int, key: PhiDither | None = None) -> RoundStart:
        """theta now (fp32 copies), Delta = phi - theta against the current outer state, and what
        this replica sends in the round, encoded and on the host (one device sync for all of it):
        Delta's 4-bit codes and, with `key` (none: a DiLoCo round), phi's residues."""
        state = self.state
        with torch.no_grad():
            theta = [p.detach().to(torch.float32, copy=True) for p in self.params]
            delta = pseudo_gradient(state, theta)
            codes, sent_delta, residual = self.codec.encode(delta, self.residual, state.phi, key)
            has_progress = bool(torch.stack([d.abs().amax() for d in delta]).amax() > 0)
        wire = self.transfers.to_host(codes)
        return RoundStart(state, theta, delta, inner_step, has_progress, key, wire, sent_delta, residual)

    def wire_layout(self, with_phi: bool) -> WireLayout:
        """What a partner's tensors of a round look like (shapes and dtypes, in order)."""
        return self.codec.layout([p.numel() for p in self.params], with_phi)

    def host_buffers(self, with_phi: bool) -> list[Tensor]:
        """Host buffers for a partner's tensors of a round (pinned on a GPU, so `receive` needs no
        staging copy), sized from this replica's own shapes: never from the wire."""
        layout = self.wire_layout(with_phi)
        return [self.transfers.host_empty(shape, dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]

    def receive(self, received: Sequence[Tensor], start: RoundStart) -> tuple[list[Tensor], list[Tensor], float]:
        """A partner's tensors (host buffers from `host_buffers`) on this replica's device, decoded:
        (its phi, decoded against ours at the round's start: ours in a DiLoCo round, where every
        replica shares phi; its Delta, shaped like the parameters; the share of its phi values at
        the edge of the codec's reach, for `check_partner`)."""
        on_device = self.transfers.to_device_all(received)
        phi, delta, edge_share = self.codec.decode(on_device, start.state.phi, start.key)
        return (phi if start.key is not None else start.state.phi), delta, edge_share

    def check_partner(
        self,
        start: RoundStart,
        phi: list[Tensor],
        delta: list[Tensor],
        distance_limit: float | None = None,
        edge_share: float = 0.0,
    ) -> tuple[str | None, PartnerMeasures | None]:
        """(why the partner's phi and Delta are unacceptable, what was measured if it got that far),
        None as the reason if they may enter the outer step. First their form
        (`validate_partner_update`), then whether its phi was within the codec's reach
        (`edge_share`, from `receive`), then whether an honest replica could have sent them
        (plausibility.py); `distance_limit` (None: the bounds' ceiling) caps the relative distance
        of the partner's phi from ours."""
        own_phi = start.state.phi
        reason = validate_partner_update(own_phi, start.delta, phi, delta, self.settings.max_norm_factor)
        if reason is not None:
            return reason, None
        b = self.bounds
        measures = measure(own_phi, start.delta, phi, delta, b.tensor_norm_floor, b.min_tensor_share)
        if not edge_share <= b.max_phi_edge_share:
            return (
                f"phi: {edge_share:.0%} of its values at the edge of the codec's reach "
                f"> {b.max_phi_edge_share:.0%} (out of reach of our weights, or garbage)"
            ), measures
        limit = self.bounds.distance_limit(None) if distance_limit is None else distance_limit
        return implausible(measures, self.bounds, limit), measures

    def pairwise_step(
        self, start: RoundStart, phis: Sequence[list[Tensor]], deltas: Sequence[list[Tensor]]
    ) -> OuterState:
        """NoLoCo's outer step with these partners (none: the lone step, n = 1)."""
        s = self.settings
        return outer_step(
            start.state,
            start.delta,
            list(phis),
            list(deltas),
            s.outer_momentum,
            s.outer_lr,
            s.pull_coefficient,
        )

    def group_step(self, start: RoundStart, deltas: Sequence[list[Tensor]]) -> OuterState:
        """DiLoCo's outer step over every replica's Delta, mine included (all share phi). Give it
        the Deltas as every member decodes them (mine: `start.sent_delta`), so that every member
        takes the same step and the replicas stay identical."""
        s = self.settings
        return diloco_outer_step(start.state, list(deltas), s.outer_momentum, s.outer_lr)

    def apply(self, start: RoundStart, new_state: OuterState) -> bool:
        """phi <- new phi; theta <- new phi + the inner progress made since the round started, so
        no local step is lost. False (nothing changed) if the outer state was replaced meanwhile."""
        if self.state is not start.state:  # an imported outer state replaced ours meanwhile
            return False
        with torch.no_grad():
            progress = [p.detach().to(torch.float32) - t for p, t in zip(self.params, start.theta)]
            apply_to_parameters(new_state, self.params)
            for p, d in zip(self.params, progress):
                p.add_(d.to(p.dtype))
        self.state = new_state
        self.residual = start.residual  # what this round sent is sent: the rest goes out with the next
        return True

    # ---- the outer state for state transfer (docs/gossip.md, "State download") ---------------

    def export_outer(self) -> dict[str, Tensor]:
        """{"phi.<param name>", "momentum.<param name>"} -> fp32 tensors (not copies: an OuterState's
        tensors are never modified in place, every outer step makes new ones)."""
        out = {f"phi.{n}": t for n, t in zip(self.names, self.state.phi)}
        out.update({f"momentum.{n}": t for n, t in zip(self.names, self.state.momentum)})
        return out

    def import_outer(self, tensors: Mapping[str, Tensor], round: int) -> None:
        """Adopt a downloaded outer state; ValueError if names, shapes or values are wrong."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise ValueError(f"round must be an int >= 0, got {round!r}")
        expected = {f"{kind}.{n}" for kind in ("phi", "momentum") for n in self.names}
        if set(tensors) != expected:
            raise ValueError(
                f"outer state names differ: missing {sorted(expected - set(tensors))[:3]}, "
                f"unexpected {sorted(set(tensors) - expected)[:3]}"
            )
        columns = {}
        for kind in ("phi", "momentum"):
            column = []
            for name, param in zip(self.names, self.params):
                t = tensors[f"{kind}.{name}"]
                if not isinstance(t, Tensor) or t.shape != param.shape or not t.is_floating_point():
                    raise ValueError(f"{kind}.{name}: expected a float tensor of shape {tuple(param.shape)}")
                if not is_finite(t):
                    raise ValueError(f"{kind}.{name}: holds NaN or Inf")
                # a copy on the parameters' device: the caller's tensors may change after this
                column.append(self.transfers.to_device(t.detach().to(torch.float32, copy=True)))
            columns[kind] = column
        self.state = OuterState(phi=columns["phi"], momentum=columns["momentum"], round=round)
        self._forget_residual()

    def restart_from_weights(self) -> None:
        """phi <- the current weights, zero momentum, same round."""
        state = OuterState.from_parameters(self.params)
        state.round = self.state.round
        self.state = state
        self._forget_residual()

    def _forget_residual(self) -> None:
        """A replaced outer state: the progress left unsent belonged to the old one."""
        self.residual = [torch.zeros_like(phi) for phi in self.state.phi]
