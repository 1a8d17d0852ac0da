"""The partner check beyond form (node/averaging/plausibility.py): honest replicas pass, copies of
our own weights that a stranger steered (negated, re-scaled, random, one tensor flipped) do not."""

from __future__ import annotations

import math

import pytest
import torch

from node.averaging.outer_replica import OuterReplica
from node.averaging.plausibility import DivergenceMemory, PlausibilityBounds, implausible, lagging_behind, measure
from node.config import GossipConfig

BOUNDS = PlausibilityBounds()
CEILING = BOUNDS.distance_limit(None)


def stage_like(seed: int = 0) -> list[torch.Tensor]:
    """Tensors shaped and initialised like a block stage: 0.02-std matrices and RMSNorm ones."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 64)] * 4 + [(176, 64), (176, 64), (64, 176)]
    return [0.02 * torch.randn(shape, generator=gen) for shape in shapes] + [torch.ones(64), torch.ones(64)]


def noise_like(tensors: list[torch.Tensor], relative: float, seed: int) -> list[torch.Tensor]:
    """Random tensors whose global norm is `relative` x that of `tensors`, each scaled like its tensor."""
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randn(t.shape, generator=gen) * (t.abs().mean() + 1e-3) for t in tensors]
    scale = relative * global_norm(tensors) / global_norm(raw)
    return [r * scale for r in raw]


def global_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in tensors))


def plus(a: list[torch.Tensor], b: list[torch.Tensor], k: float = 1.0) -> list[torch.Tensor]:
    return [x + k * y for x, y in zip(a, b)]


@pytest.fixture
def own():
    phi = stage_like()
    delta = noise_like(phi, 0.05, seed=1)
    return phi, delta


def honest_partner(phi, delta, distance: float, seed: int):
    """Another replica: phi `distance` away (relative), a Delta sharing part of ours."""
    partner_phi = plus(phi, noise_like(phi, distance, seed))
    partner_delta = plus([0.4 * d for d in delta], noise_like(delta, 1.0, seed + 100))
    return partner_phi, partner_delta


def verdict(own, partner, limit=CEILING):
    (phi, delta), (p_phi, p_delta) = own, partner
    return implausible(measure(phi, delta, p_phi, p_delta, BOUNDS.tensor_norm_floor), BOUNDS, limit)


@pytest.mark.parametrize("distance", [0.0, 0.01, 0.05, 0.2, 0.6])
def test_honest_like_partners_pass(own, distance):
    partner = honest_partner(*own, distance, seed=7)
    m = measure(*own, *partner)
    assert m.distance == pytest.approx(distance, rel=1e-3, abs=1e-6)
    assert verdict(own, partner) is None
    # an honest Delta nearly orthogonal to ours (as measured in stage 1) passes too
    phi, _ = partner
    assert verdict(own, (phi, noise_like(own[1], 3.0, seed=8))) is None


def test_a_stale_honest_replica_passes_when_the_stage_is_diverging(own):
    # the worst measured honest case: a starved replica, relative distance 1.2, cosine ~0.6
    phi, delta = own
    stale = plus(phi, noise_like(phi, 1.2, seed=3))
    limit = BOUNDS.distance_limit(0.35)  # what such a stage publishes meanwhile
    assert verdict(own, (stale, delta), limit) is None


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        ("negated", "cosine"),
        ("scaled x3", "norm 3"),
        ("scaled x0.1", "norm 0.1"),
        ("random, equal norm", "cosine"),
    ],
)
def test_steered_copies_of_our_weights_fail(own, attack, why):
    phi, delta = own
    if attack == "negated":
        partner = ([-p for p in phi], [-d for d in delta])
    elif attack == "scaled x3":
        partner = ([3 * p for p in phi], delta)
    elif attack == "scaled x0.1":
        partner = ([0.1 * p for p in phi], delta)
    else:
        gen = torch.Generator().manual_seed(5)
        raw = [torch.randn(p.shape, generator=gen) for p in phi]
        partner = ([r * global_norm(phi) / global_norm(raw) for r in raw], delta)
    reason = verdict(own, partner)
    assert reason is not None and why in reason, reason
    assert reason.startswith("phi")


def test_a_negated_delta_fails_even_with_honest_weights(own):
    phi, delta = own
    partner_phi, _ = honest_partner(phi, delta, 0.05, seed=2)
    reason = verdict(own, (partner_phi, [-d for d in delta]))
    assert reason is not None and reason.startswith("delta") and "cosine" in reason


def test_one_steered_tensor_fails(own):
    phi, delta = own
    flipped = [p.clone() for p in phi]
    flipped[0] = -flipped[0]  # q_proj negated: the global cosine is still ~0.98
    assert measure(phi, delta, flipped, delta).cosine > 0.95
    assert "a tensor has cosine" in verdict(own, (flipped, delta))
    scaled = [p.clone() for p in phi]
    scaled[2] = 8 * scaled[2]
    assert "tensor 2 norm" in verdict(own, (scaled, delta))


def test_the_distance_limit_follows_the_stage_divergence(own):
    phi, delta = own
    partner = honest_partner(phi, delta, 0.5, seed=4)
    calm = BOUNDS.distance_limit(0.02)  # a settled stage publishes ~0.02
    assert calm == BOUNDS.distance_floor
    assert "relative distance" in verdict(own, partner, calm)
    assert verdict(own, partner, BOUNDS.distance_limit(0.2)) is None
    # the ceiling holds whatever is published
    assert BOUNDS.distance_limit(100.0) == BOUNDS.distance_ceiling
    far = honest_partner(phi, delta, 1.6, seed=4)
    assert "relative distance" in verdict(own, far, BOUNDS.distance_limit(100.0))


def test_zero_deltas_and_tiny_tensors_are_not_judged_on_noise():
    phi = [*stage_like(), 1e-6 * torch.randn(32)]  # a tensor whose norm is negligible
    zero = [torch.zeros_like(p) for p in phi]
    partner = [p.clone() for p in phi]
    partner[-1] = -partner[-1]
    m = measure(phi, zero, partner, zero)
    assert m.delta_cosine == 1.0 and m.tensor_cosine > 0.99
    assert implausible(m, BOUNDS, CEILING) is None


def test_divergence_memory():
    memory = DivergenceMemory(window=100.0)
    assert memory.reference(0.0) is None
    memory.note_published("peer-a", 0.3, now=1.0)
    memory.note_published("peer-a", 0.3, now=2.0)  # the same record again: not a new observation
    memory.note_published("evil", 9.0, now=2.0)
    assert memory.reference(3.0, exclude="evil") == 0.3
    assert memory.reference(3.0, exclude="peer-a") == 9.0
    assert memory.reference(3.0, min_own=1) is None  # no round of our own yet
    memory.note_own(0.05, now=4.0)
    assert memory.reference(5.0, exclude="evil", min_own=1) == 0.3
    assert memory.own_count(5.0) == 1
    # beyond the window everything is forgotten
    assert memory.reference(150.0) is None
    memory.note_published("peer-a", 0.3, now=151.0)  # noted again: the old note is gone
    assert memory.reference(152.0) == 0.3
    memory.note_own(float("nan"), now=152.0)
    memory.note_published("peer-b", -1.0, now=152.0)
    assert memory.reference(152.0) == 0.3


def test_outer_replica_checks_form_first_then_plausibility():
    module = torch.nn.Linear(64, 64)
    replica = OuterReplica(dict(module.named_parameters()), GossipConfig())
    with torch.no_grad():
        module.weight.add_(0.01)
    start = replica.capture_start(inner_step=10)
    phi, delta = start.state.phi, start.delta
    reason, measures = replica.check_partner(start, [p.clone() for p in phi], [d.clone() for d in delta])
    assert reason is None and measures is not None and measures.distance == 0.0
    reason, measures = replica.check_partner(start, [p * float("nan") for p in phi], delta)
    assert "NaN" in reason and measures is None
    reason, measures = replica.check_partner(start, [-p for p in phi], delta)
    assert "cosine" in reason and measures.cosine == pytest.approx(-1.0)
    # an explicit distance limit is applied
    moved = [p + 0.1 * p.norm() / math.sqrt(p.numel()) for p in phi]
    assert replica.check_partner(start, moved, delta, distance_limit=1e-3)[0].startswith("phi: relative distance")


def test_lagging_behind_needs_the_partner_and_a_majority_of_the_stage_ahead():
    lead = 100
    # a stage of two: the partner's published step decides
    assert lagging_behind(300, "a", {"a": 1056}, lead)
    assert not lagging_behind(300, "a", {"a": 399}, lead)  # ahead, but by less than the lead
    assert lagging_behind(300, "a", {"a": 400}, lead)
    assert not lagging_behind(1056, "a", {"a": 300}, lead)  # the leader bans the stale one as before
    # a stranger publishing a large step count is outvoted by the rest of the stage
    assert not lagging_behind(300, "evil", {"evil": 10**9, "b": 310, "c": 290}, lead)
    assert not lagging_behind(300, "evil", {"evil": 10**9, "b": 310}, lead)  # half is no majority
    assert lagging_behind(300, "a", {"a": 900, "b": 950, "c": 290}, lead)
    # the partner itself must be ahead, however far the others are
    assert not lagging_behind(300, "c", {"a": 900, "b": 950, "c": 290}, lead)
    assert not lagging_behind(300, "gone", {"a": 900}, lead)  # a partner the view does not hold
