"""NoLoCo's outer step (and DiLoCo's, its all-replica special case), as pure functions.

Reads beside docs/algorithms.md ("NoLoCo: the outer step", "DiLoCo: all replicas average"). No
networking here: the gossip code (round_protocol.py, diloco.py) finds a partner, exchanges (phi,
Delta) with it, checks what it received with `validate_partner_update` (through OuterReplica) and
then calls `outer_step`.

Symbols for one replica i of a stage (as in docs/algorithms.md):

    phi_i    outer ("slow") weights, identical on all replicas at the start
    theta_i  weights after H inner optimizer steps started from phi_i
    Delta_i  = phi_i - theta_i                      (pseudo-gradient: points *against* progress)
    G        the group: i and its partner(s), n = |G|
    alpha    outer momentum (GossipConfig.outer_momentum, default 0.5)
    beta     outer learning rate (GossipConfig.outer_lr, default 0.7)
    gamma    pull coefficient (GossipConfig.pull_coefficient, default gamma = beta)

    delta_i <- alpha * delta_i - (beta / n) * sum_{j in G} Delta_j - gamma * (phi_i - mean_{j in G} phi_j)
    phi_i   <- phi_i + delta_i ;  theta_i <- phi_i

Sign convention: delta (the `momentum` buffer) is the *displacement* applied to phi, so it points
the way training moves: -beta * mean(Delta) = beta * mean(theta - phi). The pull term moves phi_i
toward the group mean (phi_i above the mean gives a negative contribution).

The formula is the NoLoCo paper's form and it is implemented literally. It is the "momentum as a
velocity" form: with velocity v = -delta / beta it is exactly
`torch.optim.SGD(lr=beta, momentum=alpha, nesterov=False)` fed the averaged pseudo-gradient, and it
is also exactly the authors' DiLoCo baseline code (docs/algorithms.md:
`gm += (alpha - 1) * gm - beta * mean(Delta); phi += gm`). DiLoCo's paper uses
`torch.optim.SGD(..., nesterov=True)`; fed the same sequence of averaged pseudo-gradients, that
optimizer's weights equal this form's phi + alpha * delta, i.e. the Nesterov "look-ahead" point of
the same trajectory (tests/unit/test_noloco.py checks both identities). We follow the authors' code.

With every replica of the stage in the group all phi_j are equal (they start equal and receive the
same update), so the last term is exactly zero and the step is DiLoCo's outer step on the averaged
pseudo-gradient: `diloco_outer_step` is literally `outer_step` with the group = all replicas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from node.runtime.finite import all_finite, is_finite

__all__ = [
    "OuterState",
    "apply_to_parameters",
    "diloco_outer_step",
    "outer_step",
    "pseudo_gradient",
    "relative_distance",
    "validate_partner_update",
]

_NORM_EPS = 1e-12


@dataclass
class OuterState:
    """One replica's outer-optimizer state for its stage.

    phi: fp32 copies of the outer weights, one tensor per parameter (module.parameters() order).
    momentum: delta, the last outer displacement (zeros at start); same shapes, fp32.
    round: number of outer steps taken so far.
    """

    phi: list[Tensor]
    momentum: list[Tensor] = field(default_factory=list)
    round: int = 0

    def __post_init__(self) -> None:
        if not self.momentum:
            self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p in self.phi]
        _check_same_shapes(self.phi, self.momentum, "momentum")

    @classmethod
    def from_parameters(cls, params: Iterable[Tensor]) -> OuterState:
        """fp32 detached copies of `params` as phi, zero momentum, round 0."""
        with torch.no_grad():
            phi = [p.detach().to(dtype=torch.float32, copy=True) for p in params]
        return cls(phi=phi, momentum=[torch.zeros_like(p) for p in phi], round=0)


def _check_same_shapes(reference: Sequence[Tensor], other: Sequence[Tensor], what: str) -> None:
    if len(reference) != len(other):
        raise ValueError(f"{what}: expected {len(reference)} tensors, got {len(other)}")
    for k, (r, o) in enumerate(zip(reference, other)):
        if r.shape != o.shape:
            raise ValueError(f"{what}: tensor {k} has shape {tuple(o.shape)}, expected {tuple(r.shape)}")


def pseudo_gradient(state: OuterState, theta: Sequence[Tensor]) -> list[Tensor]:
    """Delta = phi - theta (fp32, new tensors), theta being the weights after the inner steps."""
    theta = list(theta)
    _check_same_shapes(state.phi, theta, "theta")
    with torch.no_grad():
        return [phi - t.detach().to(torch.float32) for phi, t in zip(state.phi, theta)]


def outer_step(
    state: OuterState,
    own_delta: Sequence[Tensor],
    partner_phis: Sequence[Sequence[Tensor]],
    partner_deltas: Sequence[Sequence[Tensor]],
    alpha: float,
    beta: float,
    gamma: float,
) -> OuterState:
    """NoLoCo's outer step for replica i; returns a new OuterState (round + 1).

    own_delta is this replica's Delta_i; partner_phis[j] / partner_deltas[j] are partner j's phi and
    Delta as received. n = 1 + len(partner_phis); with no partner it is the lone step (n = 1, the
    pull term is zero). No input is mutated: the result owns two fresh fp32 buffers per parameter,
    and all arithmetic is in-place on them (partner tensors of another float dtype, e.g. fp16 off
    the wire, are promoted to fp32 as they are added).

    Computed as: delta' = alpha*delta - (beta/n) * sum_j Delta_j
                          - gamma*((n-1)/n) * phi_i + (gamma/n) * sum_{partners} phi_j
    which is the formula above with phi_i - mean_G(phi) expanded, so no extra model-sized
    temporary is needed.
    """
    own_delta = list(own_delta)
    partner_phis = [list(p) for p in partner_phis]
    partner_deltas = [list(d) for d in partner_deltas]
    if len(partner_phis) != len(partner_deltas):
        raise ValueError(f"{len(partner_phis)} partner phis but {len(partner_deltas)} partner deltas")
    _check_same_shapes(state.phi, own_delta, "own delta")
    for j, (pp, pd) in enumerate(zip(partner_phis, partner_deltas)):
        _check_same_shapes(state.phi, pp, f"partner {j} phi")
        _check_same_shapes(state.phi, pd, f"partner {j} delta")
    n = 1 + len(partner_phis)
    new_phi: list[Tensor] = []
    new_momentum: list[Tensor] = []
    with torch.no_grad():
        for k, (phi, momentum) in enumerate(zip(state.phi, state.momentum)):
            d = momentum.to(torch.float32).mul(alpha)  # fresh buffer
            d.add_(own_delta[k].to(torch.float32), alpha=-beta / n)
            for pd in partner_deltas:
                d.add_(pd[k].to(torch.float32), alpha=-beta / n)
            if gamma != 0.0 and n > 1:
                d.add_(phi, alpha=-gamma * (n - 1) / n)
                for pp in partner_phis:
                    d.add_(pp[k].to(torch.float32), alpha=gamma / n)
            new_momentum.append(d)
            new_phi.append(phi.to(torch.float32).add(d))
    return OuterState(phi=new_phi, momentum=new_momentum, round=state.round + 1)


def diloco_outer_step(
    state: OuterState, all_deltas: Sequence[Sequence[Tensor]], alpha: float, beta: float
) -> OuterState:
    """DiLoCo's outer step (gossip mode "diloco"): all_deltas holds every replica's Delta, this
    replica's own included (order does not matter).

    Implemented as `outer_step` with the group = all replicas and gamma = 0: in DiLoCo every
    replica holds the same phi, so the pull term is identically zero whatever gamma is, and
    delta <- alpha*delta - beta*mean_all(Delta); phi <- phi + delta.
    """
    all_deltas = [list(d) for d in all_deltas]
    if not all_deltas:
        raise ValueError("diloco_outer_step needs at least this replica's own Delta")
    others = all_deltas[1:]
    return outer_step(state, all_deltas[0], [state.phi] * len(others), others, alpha, beta, 0.0)


def apply_to_parameters(state: OuterState, params: Iterable[Tensor]) -> None:
    """theta <- phi: copy the outer weights into the live parameters (in place, cast to their dtype)."""
    params = list(params)
    _check_same_shapes(state.phi, params, "parameters")
    with torch.no_grad():
        for p, phi in zip(params, state.phi):
            p.copy_(phi)


def _global_norm(tensors: Iterable[Tensor]) -> float:
    """The norm of all `tensors` concatenated, summed in float64 where they are; one host read."""
    squares = [torch.linalg.vector_norm(t.detach().to(torch.float32)).to(torch.float64) ** 2 for t in tensors]
    return math.sqrt(torch.stack(squares).sum().item()) if squares else 0.0


def relative_distance(phi_a: Sequence[Tensor], phi_b: Sequence[Tensor], eps: float = _NORM_EPS) -> float:
    """||phi_a - phi_b|| / max(||phi_a||, eps), norms over all tensors concatenated.

    The divergence indicator peers publish: 0 for identical replicas.
    """
    phi_a, phi_b = list(phi_a), list(phi_b)
    _check_same_shapes(phi_a, phi_b, "phi_b")
    with torch.no_grad():
        diff = _global_norm(a.to(torch.float32) - b.to(torch.float32) for a, b in zip(phi_a, phi_b))
        return diff / max(_global_norm(phi_a), eps)


def validate_partner_update(
    own_phi: Sequence[Tensor],
    own_delta: Sequence[Tensor],
    partner_phi: Sequence[Tensor],
    partner_delta: Sequence[Tensor],
    max_norm_factor: float,
    eps: float = 1e-6,
) -> str | None:
    """None if a partner's (phi, Delta) may enter `outer_step`, else the reason to reject it.

    Rejects: a different tensor count, a different shape, a non-float dtype, any NaN/Inf, or a
    global norm of partner phi (resp. Delta) above max_norm_factor * own norm + eps. eps keeps a
    round in which both Deltas are zero acceptable; a replica that took no inner step since its last
    round should not gossip (its zero Delta would make it reject every honest partner). The gossip
    code bans the sender and skips the round when a reason is returned.
    """
    for what, own, theirs in (("phi", own_phi, partner_phi), ("delta", own_delta, partner_delta)):
        own, theirs = list(own), list(theirs)
        if len(own) != len(theirs):
            return f"{what}: {len(theirs)} tensors, expected {len(own)}"
        for k, (o, t) in enumerate(zip(own, theirs)):
            if not isinstance(t, Tensor):
                return f"{what}: tensor {k} is a {type(t).__name__}, not a tensor"
            if t.shape != o.shape:
                return f"{what}: tensor {k} has shape {tuple(t.shape)}, expected {tuple(o.shape)}"
            if not t.is_floating_point():
                return f"{what}: tensor {k} has non-float dtype {t.dtype}"
        if not all_finite(theirs):  # one host read for every tensor
            bad = next(k for k, t in enumerate(theirs) if not is_finite(t))
            return f"{what}: tensor {bad} holds NaN or Inf"
        own_norm, their_norm = _global_norm(own), _global_norm(theirs)
        limit = max_norm_factor * own_norm + eps
        if not their_norm <= limit:
            return f"{what}: norm {their_norm:.4g} exceeds {max_norm_factor:g} x own norm {own_norm:.4g}"
    return None
