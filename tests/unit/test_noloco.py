"""node/averaging/noloco.py against independent implementations of NoLoCo's and DiLoCo's outer steps."""

import math

import pytest
import torch

from node.averaging.noloco import (
    OuterState,
    apply_to_parameters,
    diloco_outer_step,
    outer_step,
    pseudo_gradient,
    relative_distance,
    validate_partner_update,
)

SHAPES = [(3, 4), (5,), (2, 1, 3)]
ALPHA, BETA, GAMMA = 0.5, 0.7, 0.7


def rand_params(gen, scale=1.0):
    return [torch.randn(s, generator=gen) * scale for s in SHAPES]


def direct_noloco(phis, deltas_m, Deltas, group, alpha, beta, gamma):
    """The formula written out in float64, one replica at a time, for every member of `group`."""
    n = len(group)
    new_phis, new_m = dict(), dict()
    for i in group:
        out_phi, out_m = [], []
        for k in range(len(SHAPES)):
            sum_D = sum(Deltas[j][k].double() for j in group)
            mean_phi = sum(phis[j][k].double() for j in group) / n
            d = alpha * deltas_m[i][k].double() - (beta / n) * sum_D - gamma * (phis[i][k].double() - mean_phi)
            out_m.append(d)
            out_phi.append(phis[i][k].double() + d)
        new_phis[i], new_m[i] = out_phi, out_m
    return new_phis, new_m


def fake_inner_training(phi, gen, target):
    """H 'inner steps': gradient steps on ||x - target||^2 plus noise (different per replica)."""
    return [p - 0.1 * (p - t) + 0.05 * torch.randn(p.shape, generator=gen) for p, t in zip(phi, target)]


def assert_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.double(), y.double(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("group_size", [2, 3])
def test_outer_step_matches_direct_formula_over_rounds(group_size):
    gen = torch.Generator().manual_seed(group_size)
    replicas = 6
    target = rand_params(gen)
    start = rand_params(gen)
    # replicas start identical, as the authors do; they drift apart through noisy inner steps
    states = [OuterState.from_parameters(start) for _ in range(replicas)]
    ref_phi = {i: [p.double() for p in start] for i in range(replicas)}
    ref_m = {i: [torch.zeros(s, dtype=torch.float64) for s in SHAPES] for i in range(replicas)}
    for rnd in range(5):
        perm = torch.randperm(replicas, generator=gen).tolist()
        groups = [perm[g : g + group_size] for g in range(0, replicas, group_size)]
        thetas = [fake_inner_training(s.phi, gen, target) for s in states]
        Deltas = [pseudo_gradient(s, th) for s, th in zip(states, thetas)]
        new_states = list(states)
        for group in groups:
            exp_phi, exp_m = direct_noloco(
                {j: states[j].phi for j in group},
                {j: states[j].momentum for j in group},
                Deltas,
                group,
                ALPHA,
                BETA,
                GAMMA,
            )
            for i in group:
                partners = [j for j in group if j != i]
                new_states[i] = outer_step(
                    states[i],
                    Deltas[i],
                    [states[j].phi for j in partners],
                    [Deltas[j] for j in partners],
                    ALPHA,
                    BETA,
                    GAMMA,
                )
                assert_close(new_states[i].phi, exp_phi[i])
                assert_close(new_states[i].momentum, exp_m[i])
                assert new_states[i].round == rnd + 1
                ref_phi[i], ref_m[i] = exp_phi[i], exp_m[i]
        states = new_states
    # the momentum carried across rounds: it is not just the last round's update
    assert any(float(states[0].momentum[k].abs().max()) > 0 for k in range(len(SHAPES)))
    assert relative_distance(states[0].phi, states[1].phi) > 0


def test_outer_step_does_not_mutate_inputs():
    gen = torch.Generator().manual_seed(1)
    state = OuterState.from_parameters(rand_params(gen))
    state.momentum = rand_params(gen)
    own, pphi, pdelta = rand_params(gen), rand_params(gen), rand_params(gen)
    before = [t.clone() for t in state.phi + state.momentum + own + pphi + pdelta]
    new = outer_step(state, own, [pphi], [pdelta], ALPHA, BETA, GAMMA)
    assert all(torch.equal(a, b) for a, b in zip(before, state.phi + state.momentum + own + pphi + pdelta))
    assert all(n.data_ptr() != o.data_ptr() for n, o in zip(new.phi + new.momentum, state.phi + state.momentum))
    assert all(t.dtype == torch.float32 for t in new.phi + new.momentum)


def test_lone_step_is_heavy_ball_on_own_delta():
    gen = torch.Generator().manual_seed(2)
    state = OuterState.from_parameters(rand_params(gen))
    state.momentum = rand_params(gen)
    own = rand_params(gen)
    new = outer_step(state, own, [], [], ALPHA, BETA, GAMMA)
    exp_m = [ALPHA * m - BETA * d for m, d in zip(state.momentum, own)]
    assert_close(new.momentum, exp_m)
    assert_close(new.phi, [p + m for p, m in zip(state.phi, exp_m)])


def test_all_replicas_in_group_is_diloco():
    """Every replica in the group: the pull term vanishes whatever gamma is, replicas stay identical,
    and phi/momentum equal (a) the authors' DiLoCo outer step, (b) diloco_outer_step, (c) torch SGD
    with momentum (nesterov=False) on the averaged pseudo-gradient; torch's nesterov=True gives the
    look-ahead point phi + alpha * delta of the same trajectory."""
    gen = torch.Generator().manual_seed(3)
    replicas = 3
    target, start = rand_params(gen), rand_params(gen)
    states = [OuterState.from_parameters(start) for _ in range(replicas)]
    diloco = OuterState.from_parameters(start)
    # (a) the authors' PipelineDiLoCoOptimizer, written out
    gp = [p.clone() for p in start]
    gm = [torch.zeros_like(p) for p in start]
    # (c) torch's own optimizers fed the averaged pseudo-gradient
    sgd_params = [torch.nn.Parameter(p.clone()) for p in start]
    nes_params = [torch.nn.Parameter(p.clone()) for p in start]
    sgd = torch.optim.SGD(sgd_params, lr=BETA, momentum=ALPHA, nesterov=False)
    nes = torch.optim.SGD(nes_params, lr=BETA, momentum=ALPHA, nesterov=True)
    for _ in range(6):
        thetas = [fake_inner_training(s.phi, gen, target) for s in states]
        Deltas = [pseudo_gradient(s, th) for s, th in zip(states, thetas)]
        mean_D = [sum(D[k] for D in Deltas) / replicas for k in range(len(SHAPES))]
        states = [
            outer_step(
                states[i],
                Deltas[i],
                [states[j].phi for j in range(replicas) if j != i],
                [Deltas[j] for j in range(replicas) if j != i],
                ALPHA,
                BETA,
                GAMMA,
            )
            for i in range(replicas)
        ]
        diloco = diloco_outer_step(diloco, Deltas, ALPHA, BETA)
        for k in range(len(SHAPES)):
            gm[k].add_((ALPHA - 1.0) * gm[k] - BETA * mean_D[k])
            gp[k].add_(gm[k])
        for opt, params in ((sgd, sgd_params), (nes, nes_params)):
            opt.zero_grad()
            for p, g in zip(params, mean_D):
                p.grad = g.clone()
            opt.step()
        for s in states:
            assert_close(s.phi, states[0].phi, atol=1e-6)
            assert_close(s.phi, gp)
            assert_close(s.momentum, gm)
            assert_close(s.phi, diloco.phi)
            assert_close(s.momentum, diloco.momentum)
        assert_close(states[0].phi, [p.detach() for p in sgd_params])
        lookahead = [p + ALPHA * m for p, m in zip(states[0].phi, states[0].momentum)]
        assert_close(lookahead, [p.detach() for p in nes_params])


def test_gossip_pulls_two_replicas_together():
    """Two replicas that start apart and gossip every round: with gamma the distance shrinks
    geometrically (the difference obeys [d, dd] -> [(1-g) d + a dd, a dd - g d], spectral radius
    sqrt(alpha) ~ 0.71 for alpha = 0.5); without gamma the shared Delta sum leaves it unchanged."""
    gen = torch.Generator().manual_seed(4)
    target, start = rand_params(gen), rand_params(gen)
    offset = rand_params(gen, scale=0.5)
    results = {}
    for gamma in (0.0, GAMMA):
        g = torch.Generator().manual_seed(5)
        a = OuterState.from_parameters(start)
        b = OuterState.from_parameters([p + o for p, o in zip(start, offset)])
        for _ in range(12):
            Da = pseudo_gradient(a, fake_inner_training(a.phi, g, target))
            Db = pseudo_gradient(b, fake_inner_training(b.phi, g, target))
            a, b = (
                outer_step(a, Da, [b.phi], [Db], ALPHA, BETA, gamma),
                outer_step(b, Db, [a.phi], [Da], ALPHA, BETA, gamma),
            )
        results[gamma] = _dist(a.phi, b.phi)
        assert relative_distance(a.phi, b.phi) == pytest.approx(results[gamma] / _norm(a.phi), rel=1e-4)
    d0 = _dist(start, [p + o for p, o in zip(start, offset)])
    # without the pull the absolute distance stays where it started
    assert results[0.0] == pytest.approx(d0, rel=1e-4)
    # with it: 12 rounds at rate sqrt(0.5) (times a constant < 2) leave well under 5 %
    assert results[GAMMA] < 2 * math.sqrt(ALPHA) ** 12 * d0
    assert results[GAMMA] < 0.05 * results[0.0]


def _dist(xs, ys):
    return _norm([x - y for x, y in zip(xs, ys)])


def _norm(ts):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def test_relative_distance():
    x = [torch.tensor([3.0, 4.0])]
    assert relative_distance(x, x) == 0.0
    assert relative_distance(x, [torch.tensor([3.0, 0.0])]) == pytest.approx(4 / 5)
    assert relative_distance([torch.zeros(2)], [torch.ones(2)]) > 1e6  # eps, not a division by zero


def test_validate_partner_update():
    gen = torch.Generator().manual_seed(6)
    phi, delta = rand_params(gen), rand_params(gen, 0.01)
    ok_phi, ok_delta = rand_params(gen), rand_params(gen, 0.01)
    assert validate_partner_update(phi, delta, ok_phi, ok_delta, 10.0) is None
    half = [t.half() for t in ok_phi]  # compressed on the wire: still acceptable
    assert validate_partner_update(phi, delta, half, ok_delta, 10.0) is None
    zeros = [torch.zeros(s) for s in SHAPES]
    assert validate_partner_update(phi, zeros, ok_phi, zeros, 10.0) is None

    def bad(i, value):
        t = [x.clone() for x in ok_delta]
        t[i].view(-1)[0] = value
        return t

    assert "NaN" in validate_partner_update(phi, delta, ok_phi, bad(1, float("nan")), 10.0)
    assert "NaN or Inf" in validate_partner_update(phi, delta, ok_phi, bad(0, float("inf")), 10.0)
    assert "NaN or Inf" in validate_partner_update(phi, delta, bad(2, float("-inf")), ok_delta, 10.0)
    huge = [t * 1000 for t in ok_phi]
    assert "norm" in validate_partner_update(phi, delta, huge, ok_delta, 10.0)
    assert "norm" in validate_partner_update(phi, delta, ok_phi, [t * 1000 for t in ok_delta], 10.0)
    assert "norm" in validate_partner_update(phi, zeros, ok_phi, ok_delta, 10.0)
    assert "tensors" in validate_partner_update(phi, delta, ok_phi[:-1], ok_delta, 10.0)
    assert "tensors" in validate_partner_update(phi, delta, ok_phi, [*ok_delta, torch.zeros(1)], 10.0)
    reshaped = [ok_phi[0].reshape(4, 3), *ok_phi[1:]]
    assert "shape" in validate_partner_update(phi, delta, reshaped, ok_delta, 10.0)
    ints = [t.long() for t in ok_phi]
    assert "dtype" in validate_partner_update(phi, delta, ints, ok_delta, 10.0)


def test_state_roundtrip_with_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    state = OuterState.from_parameters(model.parameters())
    assert all(p.dtype == torch.float32 for p in state.phi) and state.round == 0
    assert all(float(m.abs().sum()) == 0 for m in state.momentum)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    D = pseudo_gradient(state, model.parameters())
    assert all(torch.allclose(d, torch.full_like(d, -1.0), atol=2e-2) for d in D)
    new = outer_step(state, D, [], [], ALPHA, BETA, GAMMA)
    apply_to_parameters(new, model.parameters())
    for p, phi in zip(model.parameters(), new.phi):
        assert p.dtype == torch.bfloat16 and torch.equal(p, phi.to(torch.bfloat16))
    with pytest.raises(ValueError):
        apply_to_parameters(new, list(model.parameters())[:-1])
    with pytest.raises(ValueError):
        outer_step(state, D[:-1], [], [], ALPHA, BETA, GAMMA)
