"""NoLoCo gossip between real peers (own p2pd + DHT node each) inside one test process.

Rounds are started by hand (`Gossip.run_round`); the round loop stays idle because H is far above
the inner-step counts the tests set. "Training" is simulated: seeded noise added to the weights
through the worker's executor, and the inner-step counter moved so the replica counts as ripe.
Runtime: about 60 s for the file (each test starts its own 2-3 peer swarm).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from dht.identity_keys import Identity
from dht.records import PeerRecord, PeerState
from node.averaging.gossip import NOT_A_STAGE_MEMBER, Gossip
from node.averaging.gossip_codec import GossipCodec, PhiDither, pack_bits, unpack_bits
from node.averaging.gossip_wire import OPEN_TIMEOUT, STALL_TIMEOUT
from node.averaging.noloco import OuterState, diloco_outer_step, outer_step, pseudo_gradient, relative_distance
from node.config import GossipConfig, read_config
from node.p2p.tensor_stream import Session
from protocol import MessageKind, recv_message, send_message
from tests.helpers.inprocess_swarm import run_in_swarm

H = 1000  # the round loop needs H steps since the last round: never reached here
RIPE = 600  # >= H/2: enough to answer a partner


def gossip_config():
    return read_config(
        None,
        swarm_id="gossip-test",
        num_stages=2,
        **{"gossip.inner_steps": H, "gossip.round_timeout": 8.0, "heartbeat.period": 1.0, "heartbeat.ttl": 10.0},
    )


async def on_executor(gossip: Gossip, fn, *args):
    return await gossip.worker.compute(fn, *args)


def weights(gossip: Gossip) -> list[torch.Tensor]:
    return [p.detach().clone() for p in gossip.worker.module.parameters()]


async def train_a_little(gossip: Gossip, seed: int, scale: float = 0.01) -> None:
    """Stand-in for RIPE inner steps: move theta by seeded noise."""

    def move() -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in gossip.worker.module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale)

    await on_executor(gossip, move)
    gossip.worker.inner_step += RIPE


async def two_trained(peers) -> tuple[Gossip, Gossip]:
    """The gossips of a two-peer stage, each moved by its own RIPE steps' worth of training."""
    a, b = gossips(peers)
    await train_a_little(a, seed=1)
    await train_a_little(b, seed=2)
    return a, b


async def outer_and_weights(gossip: Gossip) -> tuple[OuterState, list[torch.Tensor]]:
    return gossip.outer_state, await on_executor(gossip, weights, gossip)


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def break_sends_after_half(gossip: Gossip, why: str) -> Callable[[], None]:
    """Make `gossip` send half of a round's tensors, then close the stream and fail with `why`
    (a crash mid-exchange); returns what undoes it."""
    original = gossip.wire.send_tensors

    async def send_half_then_vanish(session, round_, tensors):
        await original(session, round_, tensors[: len(tensors) // 2])
        session.writer.close()
        raise ConnectionError(why)

    gossip.wire.send_tensors = send_half_then_vanish
    return lambda: setattr(gossip.wire, "send_tensors", original)


def gossips(peers) -> list[Gossip]:
    return [peer.service.gossip for peer in peers]


@pytest.mark.timeout(90)
def test_exchange_applies_exactly_the_outer_step_on_both_sides():
    """Exactly the outer step on what arrived: the partner's phi as its residues decode against our
    own, and its Delta as its 4-bit codes decode (node/averaging/gossip_codec.py); the initiator's
    dither seed is fixed here so the test can code the same way."""
    config = gossip_config()
    g = config.gossip
    codec = GossipCodec(g.delta_block, g.phi_bits, g.phi_step)
    key = PhiDither(12345)

    def as_received(sender: OuterState, delta: list[torch.Tensor], receiver: OuterState) -> list[list[torch.Tensor]]:
        """[phi, Delta] of `sender` as `receiver` decodes them (a fresh outer state: no residual yet)."""
        wire = codec.encode(delta, [torch.zeros_like(d) for d in delta], sender.phi, key)[0]
        phi, decoded, _edge_share = codec.decode(wire, receiver.phi, key)
        return [phi, decoded]

    async def scenario(peers):
        a, b = gossips(peers)
        # distinct outer weights (as after earlier rounds) so the pull term is exercised
        for gossip, seed in ((a, 1), (b, 2)):
            gen = torch.Generator().manual_seed(seed)
            outer = {
                k: v + 0.02 * torch.randn(v.shape, generator=gen)
                if k.startswith("phi.")
                else 0.01 * torch.randn(v.shape, generator=gen)
                for k, v in gossip.export_outer().items()
            }
            gossip.import_outer(outer, round=3)
        await train_a_little(a, seed=10)
        await train_a_little(b, seed=20)
        (state_a, theta_a), (state_b, theta_b) = await outer_and_weights(a), await outer_and_weights(b)
        delta_a, delta_b = pseudo_gradient(state_a, theta_a), pseudo_gradient(state_b, theta_b)

        a.rng.randrange = lambda *_: key.seed  # the initiator's draw of the round's dither seed
        outcome = await a.run_round(partner=b.me.peer_id)
        assert outcome.status == "applied", outcome
        # b applies its step, then records its outcome: wait for both
        await wait_until(lambda: b.outer_state.round == 4 and len(b.rounds.history) > 0)
        # what each side reports it moved: its codec's payload, plus a frame and meta per message
        # (request or accept, one chunk per wire tensor at this size, done)
        layout = a.rounds.replica.wire_layout(True)
        for reported in (outcome, b.rounds.history[-1]):
            assert reported.status == "applied" and reported.seconds > 0, reported
            assert layout.nbytes < reported.sent_bytes < layout.nbytes + 512 * (len(layout.shapes) + 2), reported

        step = (g.outer_momentum, g.outer_lr, g.pull_coefficient)
        phi_b, sent_b = as_received(state_b, delta_b, state_a)
        phi_a, sent_a = as_received(state_a, delta_a, state_b)
        expected_a = outer_step(state_a, delta_a, [phi_b], [sent_b], *step)
        expected_b = outer_step(state_b, delta_b, [phi_a], [sent_a], *step)
        for gossip, expected, partner in ((a, expected_a, b), (b, expected_b, a)):
            assert gossip.outer_state.round == expected.round == 4
            assert_same(gossip.outer_state.phi, expected.phi)
            assert_same(gossip.outer_state.momentum, expected.momentum)
            assert_same(await on_executor(gossip, weights, gossip), expected.phi)  # theta <- phi
            assert gossip.last_partner == partner.me.peer_id
        # the divergence each side measures: from the partner's phi as it decoded it
        assert a.divergence == pytest.approx(relative_distance(state_a.phi, phi_b))
        assert b.divergence == pytest.approx(relative_distance(state_b.phi, phi_a))
        assert a.divergence > 0
        # the DHT record carries the round, the partner and the divergence
        peers[0].service.publish_progress()
        record = peers[0].me.record()
        assert (record.outer_round, record.last_partner) == (4, b.me.peer_id)
        assert record.divergence == a.divergence

    run_in_swarm(config, [1, 1], scenario)


@pytest.mark.timeout(90)
def test_peer_in_an_exchange_answers_busy():
    async def scenario(peers):
        a, b, c = gossips(peers)
        for seed, gossip in enumerate((a, b, c)):
            await train_a_little(gossip, seed)
        # c is slow to send (every chunk a little late, never silent for long): the a <-> c
        # exchange stays open for a few seconds
        original_send = c.wire.send_tensors

        async def slow_send(session, round_, tensors):
            send = session.send

            async def late(message):
                await asyncio.sleep(0.15)
                await send(message)

            session.send = late
            try:
                await original_send(session, round_, tensors)
            finally:
                session.send = send

        c.wire.send_tensors = slow_send
        exchange = asyncio.create_task(a.run_round(partner=c.me.peer_id))
        await wait_until(lambda: a.exchanging and c.exchanging)
        before = await on_executor(a, weights, a)

        # on the wire: a request to a busy peer gets BUSY back
        t = b.transport
        async with t.session(a.me.peer_id, "gossip", 5.0) as (reader, writer):
            request = t.message(MessageKind.GOSSIP_REQUEST, b.wire.request_meta(b.outer_state.round))
            await send_message(writer, request, "none", t.limits)
            reply = await recv_message(reader, t.limits, t.swarm_id)
        assert reply.kind == MessageKind.BUSY
        # and the requester's round reports it, without touching anyone's weights
        busy = await b.run_round(partner=a.me.peer_id)
        assert busy.status == "busy"
        assert b.outer_state.round == 0

        assert (await exchange).status == "applied"
        assert a.outer_state.round == 1
        assert not all(torch.equal(x, y) for x, y in zip(before, await on_executor(a, weights, a)))

    run_in_swarm(gossip_config(), [1, 1, 1], scenario)


@pytest.mark.timeout(90)
def test_only_a_peer_with_a_record_of_the_stage_gets_an_exchange():
    """A request from a peer that holds no record of this stage (a stranger, or a peer of another
    stage claiming this one) is answered BUSY with the reason, before any slot or tensor is given."""
    config = gossip_config().replace(num_stages=3)

    async def scenario(peers):
        a, b, c = gossips(peers)
        for seed, gossip in enumerate((a, b)):
            await train_a_little(gossip, seed)
        await a.rounds.view.refresh()

        # c serves stage 2 and claims stage 1 in its request
        t = c.transport
        async with t.session(a.me.peer_id, "gossip", 5.0) as (reader, writer):
            request = t.message(MessageKind.GOSSIP_REQUEST, a.wire.request_meta(0))
            request.sender_stage = 1
            await send_message(writer, request, "none", t.limits)
            reply = await recv_message(reader, t.limits, t.swarm_id)
        assert reply.kind == MessageKind.BUSY
        assert reply.meta["reason"] == f"{NOT_A_STAGE_MEMBER} 1 here" and not a.exchanging

        # b, unknown to a's view (no record read yet), is turned away; once a knows it, served
        record_of = a.rounds.view.record_of
        a.rounds.view.record_of = lambda peer_id: None if peer_id == b.me.peer_id else record_of(peer_id)
        assert (await b.run_round(partner=a.me.peer_id)).status == "busy"
        assert a.outer_state.round == b.outer_state.round == 0
        a.rounds.view.record_of = record_of
        assert (await b.run_round(partner=a.me.peer_id)).status == "applied"
        await wait_until(lambda: a.outer_state.round == 1)  # the responder steps after the DONEs, on its own thread
        assert a.outer_state.round == b.outer_state.round == 1

    run_in_swarm(config, [1, 1, 2], scenario)


@pytest.mark.timeout(90)
def test_mutual_pick_does_not_deadlock():
    async def scenario(peers):
        a, b = await two_trained(peers)
        before = [await outer_and_weights(a), await outer_and_weights(b)]
        # both pick each other at the same moment: each is busy with its own round
        outcomes = await asyncio.wait_for(
            asyncio.gather(a.run_round(partner=b.me.peer_id), b.run_round(partner=a.me.peer_id)), 5.0
        )
        statuses = sorted(o.status for o in outcomes)
        assert statuses in (["busy", "busy"], ["applied", "busy"]), statuses
        if statuses == ["busy", "busy"]:
            for gossip, (state, theta) in zip((a, b), before):
                assert gossip.outer_state is state
                assert_same(await on_executor(gossip, weights, gossip), theta)
            # a random pause (what the round loop does) and the next try pairs them
            assert (await a.run_round(partner=b.me.peer_id)).status == "applied"
        await wait_until(lambda: a.outer_state.round == b.outer_state.round == 1)

    run_in_swarm(gossip_config(), [1, 1], scenario)


@pytest.mark.timeout(90)
def test_partner_disconnecting_mid_exchange_leaves_both_untouched():
    async def scenario(peers):
        a, b = await two_trained(peers)
        before = [await outer_and_weights(a), await outer_and_weights(b)]
        recover = break_sends_after_half(b, "simulated crash mid-exchange")
        # b as the responder, then b as the initiator
        assert (await a.run_round(partner=b.me.peer_id)).status == "aborted"
        assert (await b.run_round(partner=a.me.peer_id)).status == "aborted"
        await asyncio.sleep(0.5)  # let the other side's handler finish
        for gossip, (state, theta) in zip((a, b), before):
            assert gossip.outer_state is state and gossip.outer_state.round == 0
            assert_same(await on_executor(gossip, weights, gossip), theta)
            assert not gossip.exchanging
        assert not a.bans.is_banned(b.me.peer_id)  # a crash is not misbehaviour

        recover()  # b recovers: the next round works
        assert (await a.run_round(partner=b.me.peer_id)).status == "applied"

    run_in_swarm(gossip_config(), [1, 1], scenario)


@pytest.mark.timeout(120)
def test_a_partner_whose_rounds_keep_breaking_after_taking_our_tensors_is_paced_in_inner_steps():
    """Rounds that do not finish leave a responder ripe: an initiator that takes our tensors and
    breaks off gets two such answers within H/2 of our inner steps, then BUSY until we trained
    on (node/averaging/answer_pacing.py); another replica is answered meanwhile."""

    async def scenario(peers):
        a, b, c = gossips(peers)
        for seed, gossip in enumerate((a, b, c)):
            await train_a_little(gossip, seed)
        before = await outer_and_weights(a)
        recover = break_sends_after_half(b, "simulated break after the partner's tensors came in")
        for _ in range(2):
            assert (await b.run_round(partner=a.me.peer_id)).status == "aborted"
            await wait_until(lambda: not a.exchanging)
        step = a.worker.inner_step
        assert a.pairwise.unfinished.refusal(b.me.peer_id, step).startswith("2 rounds with you did not finish")
        recover()
        assert (await b.run_round(partner=a.me.peer_id)).status == "busy"  # paced, whatever it sends now
        assert a.outer_state is before[0]
        assert_same(await on_executor(a, weights, a), before[1])
        assert (await c.run_round(partner=a.me.peer_id)).status == "applied"  # others are answered
        await train_a_little(a, seed=7)  # H/2 of a's inner steps later b is answered again
        await train_a_little(b, seed=8)
        assert (await b.run_round(partner=a.me.peer_id)).status == "applied"

    run_in_swarm(gossip_config(), [1, 1, 1], scenario)


REFUSED_ATTEMPTS = 10  # a refusal closed too early was lost about one time in ten


def test_an_overdue_round_steps_alone_when_its_partner_refuses():
    """A partner that refuses us (it banned us) ends the attempt, and says so every time; an
    overdue round takes the lone step then instead of letting Delta grow until every partner
    rejects it."""

    async def scenario(peers):
        a, b = await two_trained(peers)
        b.bans.ban(a.me.peer_id, 0.0, "test: b refuses a")
        for _ in range(REFUSED_ATTEMPTS):  # each must read the refusal, not a reset stream
            not_overdue = await a.run_round(partner=b.me.peer_id)
            assert not_overdue.status == "aborted" and "refused" in not_overdue.detail, not_overdue
        assert a.outer_state.round == 0
        overdue = await a.run_round(partner=b.me.peer_id, alone_if_no_partner=True)
        assert overdue.status == "lone", overdue
        assert a.outer_state.round == 1 and a.steps_since_round == 0
        assert b.outer_state.round == 0
        assert [o.status for o in a.rounds.history][-2:] == ["aborted", "lone"]

    run_in_swarm(gossip_config(), [1, 1], scenario)


def poisoned(poison: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a poisoner sends instead of its round's tensors: per parameter its Delta codes, scales
    and phi residues (gossip_codec.WireLayout)."""
    tensors = list(tensors)
    if poison == "nan":
        tensors[1] = torch.full_like(tensors[1], float("nan"))  # a scale: its block decodes to NaN
    elif poison == "huge":
        tensors[1::3] = [t * 1e4 for t in tensors[1::3]]
    elif poison == "far":  # every phi value half the grid's period away: the farthest phi the wire can carry
        bits, period = GossipConfig.phi_bits, 1 << GossipConfig.phi_bits
        for k in range(2, len(tensors), 3):
            values = unpack_bits(tensors[k], tensors[k].numel() * 8 // bits, bits)
            tensors[k] = pack_bits((values + period // 2) % period, bits)
    else:
        assert poison == "random"  # random residues: a phi unrelated to ours
        gen = torch.Generator().manual_seed(99)
        tensors[2::3] = [torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8) for t in tensors[2::3]]
    return tensors


POISON_REASON = {"nan": "NaN", "huge": "norm", "far": "reach", "random": "reach"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("poison", list(POISON_REASON))
def test_a_poisoned_round_is_rejected_and_the_sender_banned(poison, caplog):
    async def scenario(peers):
        a, b, evil = gossips(peers)
        for seed, gossip in enumerate((a, b, evil)):
            await train_a_little(gossip, seed)
        before = [await outer_and_weights(a), await outer_and_weights(b)]
        original_send = evil.wire.send_tensors

        async def poisoned_send(session, round_, tensors):
            await original_send(session, round_, poisoned(poison, tensors))

        evil.wire.send_tensors = poisoned_send
        evil_id = evil.me.peer_id
        # a asks the poisoner; the poisoner asks b: rejected both ways
        outcome = await a.run_round(partner=evil_id)
        assert outcome.status == "rejected", outcome
        assert POISON_REASON[poison] in outcome.detail
        assert (await evil.run_round(partner=b.me.peer_id)).status == "aborted"
        await asyncio.sleep(0.5)
        for gossip, (state, theta) in zip((a, b), before):
            assert gossip.outer_state is state
            assert_same(await on_executor(gossip, weights, gossip), theta)
            assert gossip.bans.is_banned(evil_id)
        assert evil_id not in a.rounds.candidates()
        assert "rejected gossip from" in caplog.text

        # the dashboard's event list names the banned peer
        registry = a.registry

        async def ban_events():
            return [e for e in await registry.fetch_events() if e.kind == "ban" and e.peer_id == evil_id]

        for _ in range(50):
            if len(await ban_events()) >= 2:
                break
            await asyncio.sleep(0.1)
        assert len(await ban_events()) >= 2
        # honest peers still gossip with each other
        assert (await a.run_round()).partners == (b.me.peer_id,)

    with caplog.at_level(logging.WARNING, logger="node.averaging"):
        run_in_swarm(gossip_config(), [1, 1, 1], scenario)


@pytest.mark.timeout(120)
def test_a_replica_far_behind_its_stage_catches_up_instead_of_banning(caplog):
    """Two honest replicas that did not meet for many steps fail each other's plausibility check;
    the one behind takes the stage's state again (node/recovery/catch_up.py), the leader bans it."""

    async def scenario(peers):
        ahead, behind = gossips(peers)
        # the leader's outer weights moved 8x their norm away (far beyond the reach of the phi
        # codec, 64 Delta scales: well-formed, implausible) and its weights with them
        gen = torch.Generator().manual_seed(5)
        outer = {
            k: v + 8.0 * v.norm() / v.numel() ** 0.5 * torch.randn(v.shape, generator=gen)
            if k.startswith("phi.")
            else torch.zeros_like(v)
            for k, v in ahead.export_outer().items()
        }
        ahead.import_outer(outer, round=7)

        def theta_to_phi() -> None:
            with torch.no_grad():
                for p, phi in zip(ahead.worker.module.parameters(), ahead.outer_state.phi):
                    p.copy_(phi)

        await on_executor(ahead, theta_to_phi)
        await train_a_little(ahead, seed=1)
        await train_a_little(behind, seed=2)
        ahead.worker.inner_step += 3 * H  # 3 rounds' worth ahead (the catch-up needs 2) ...
        ahead.rounds.round_start_step = ahead.worker.inner_step - RIPE  # ripe, but its loop not due
        peers[0].service.publish_progress()
        await peers[0].me.announce_now()
        await peers[1].service.view.refresh()
        ahead_id, behind_id = ahead.me.peer_id, behind.me.peer_id

        outcome = await behind.run_round(partner=ahead_id)
        assert outcome.status == "rejected", outcome
        assert "reach" in outcome.detail  # the leader's phi is out of the codec's reach of ours
        assert not behind.bans.is_banned(ahead_id)
        # the leader sees the same from its side, and declines the stale replica without a ban:
        # the round was declined, nothing applied on either side
        assert ahead.outer_state.round == 7 and not ahead.bans.is_banned(behind_id)
        # the catch-up downloads the leader's state: weights, outer state, counters
        # (the adoption sets the step, then the outer state, in one compute call: wait for both)
        await wait_until(
            lambda: behind.worker.inner_step == ahead.worker.inner_step and behind.outer_state.round == 7,
            timeout=30.0,
        )
        assert_same(behind.outer_state.phi, ahead.outer_state.phi)
        assert_same(await on_executor(behind, weights, behind), await on_executor(ahead, weights, ahead))
        assert not behind.behind.is_set()
        assert "caught up with stage 1" in caplog.text

    with caplog.at_level(logging.INFO, logger="node"):
        run_in_swarm(gossip_config(), [1, 1], scenario)


@pytest.mark.timeout(90)
def test_diloco_mode_averages_all_replicas():
    config = gossip_config().replace(gossip={"mode": "diloco"})
    g = config.gossip

    async def scenario(peers):
        replicas = gossips(peers)
        for seed, gossip in enumerate(replicas):
            await train_a_little(gossip, seed)
        deltas = []
        for gossip in replicas:
            state, theta = await outer_and_weights(gossip)
            deltas.append(pseudo_gradient(state, theta))
        start = replicas[0].outer_state
        # one replica starts round 0; the others join it when asked for their Delta
        outcome = await replicas[0].diloco.start_round(0)
        assert outcome.status == "applied" and len(outcome.partners) == 2, outcome
        await wait_until(lambda: all(r.outer_state.round == 1 for r in replicas))
        # every member averages the Deltas as they decode (theirs and its own as sent: no residual yet)
        codec = GossipCodec(g.delta_block, g.phi_bits, g.phi_step)
        sent = [codec.encode(d, [torch.zeros_like(t) for t in d], [], None)[1] for d in deltas]
        expected = diloco_outer_step(start, sent, g.outer_momentum, g.outer_lr)
        for gossip in replicas:
            for got, want in zip(gossip.outer_state.phi, expected.phi):
                assert torch.allclose(got, want, rtol=0, atol=1e-6)
            for got, want in zip(await on_executor(gossip, weights, gossip), expected.phi):
                assert torch.allclose(got, want, rtol=0, atol=1e-6)

    run_in_swarm(config, [1, 1, 1], scenario)


@pytest.mark.timeout(90)
def test_a_silent_partner_frees_the_slot_within_the_stall_timeout():
    margin = 2.5

    async def scenario(peers):
        loop = asyncio.get_running_loop()
        a, b, silent = gossips(peers)
        for seed, gossip in enumerate((a, b, silent)):
            await train_a_little(gossip, seed)
        before = await outer_and_weights(a)
        silent_id = silent.me.peer_id

        # 1. silent initiator: asks a for a round, reads the ACCEPT, then sends nothing and
        # keeps the stream open
        t = silent.transport
        async with t.session(a.me.peer_id, "gossip", 5.0) as (reader, writer):
            session = Session(t, reader, writer, timeout=5.0)
            await session.send(t.message(MessageKind.GOSSIP_REQUEST, silent.wire.request_meta(0, RIPE)))
            assert (await session.recv()).kind == MessageKind.GOSSIP_ACCEPT
            accepted = loop.time()
            assert a.exchanging
            assert (await b.run_round(partner=a.me.peer_id)).status == "busy"  # the slot is held...
            await wait_until(lambda: not a.exchanging, timeout=STALL_TIMEOUT + margin)
            assert loop.time() - accepted < STALL_TIMEOUT + margin  # ... for the stall timeout at most
            # the silent stream is still open; an honest round goes through at once
            assert (await b.run_round(partner=a.me.peer_id)).status == "applied"
        stalled = [o for o in a.rounds.history if o.partners == (silent_id,)]
        assert stalled[-1].status == "aborted" and "went silent" in stalled[-1].detail
        # the responder applies after the DONE handshake, a moment after b's run_round returns
        await wait_until(lambda: a.outer_state.round == 1, timeout=5.0)
        assert a.outer_state is not before[0] and a.outer_state.round == 1  # only b's round counted
        # silence is not misbehaviour: no ban, but a cool-down (not picked, not answered)
        assert not a.bans.is_banned(silent_id)
        assert a.rounds.cooling_down(silent_id)
        assert silent_id not in a.rounds.candidates()
        refused = await silent.run_round(partner=a.me.peer_id)
        assert refused.status == "aborted" and "stalled" in refused.detail

        # 2. silent responder: accepts b's request, then never sends its tensors
        async def never_send(session, round_, tensors):
            await asyncio.sleep(3600)

        silent.wire.send_tensors = never_send
        await train_a_little(b, seed=5)
        state_b, theta_b = await outer_and_weights(b)
        started = loop.time()
        outcome = await b.run_round(partner=silent_id)
        assert outcome.status == "aborted" and "went silent" in outcome.detail, outcome
        assert loop.time() - started < STALL_TIMEOUT + margin
        assert b.outer_state is state_b and not b.exchanging
        assert_same(await on_executor(b, weights, b), theta_b)
        assert b.rounds.cooling_down(silent_id) and not b.bans.is_banned(silent_id)

    run_in_swarm(gossip_config(), [1, 1, 1], scenario)


@pytest.mark.timeout(90)
def test_a_partner_whose_stream_never_opens_is_skipped_and_not_asked_again():
    """An online record nobody answers for (a crashed peer's, or a hostile one's) costs the
    initiator at most OPEN_TIMEOUT: it asks its next candidate, and leaves the ghost alone for
    STALL_COOLDOWN."""

    async def scenario(peers):
        a, b = await two_trained(peers)
        ghost = Identity.generate().peer_id
        records = [PeerRecord(ghost, 1, PeerState.ONLINE), PeerRecord(b.me.peer_id, 1, PeerState.ONLINE)]
        a.rounds.view = SimpleNamespace(online=lambda stage, exclude=None: list(records))
        a.rounds.rng.shuffle = lambda peers: None  # the ghost is asked first
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcome = await a.run_round()
        assert outcome.status == "applied" and outcome.partners == (b.me.peer_id,), outcome
        assert loop.time() - started < OPEN_TIMEOUT + 6.0
        unreached = [o for o in a.rounds.history if o.partners == (ghost,)]
        assert unreached and unreached[0].status == "aborted" and "stream" in unreached[0].detail
        assert ghost not in a.rounds.candidates() and b.me.peer_id in a.rounds.candidates()
        assert not a.bans.is_banned(ghost)

    run_in_swarm(gossip_config(), [1, 1], scenario)


@pytest.mark.timeout(120)
def test_live_round_benchmark_measures_applied_exchanges(tmp_path):
    """tests/benchmarks/bench_gossip_round.py (`make results`: the live N <= 8 points of
    docs/results.md) at its smallest: two peers, one swarm round, a small stage."""
    from tests.benchmarks import bench_gossip_round

    assert bench_gossip_round.main(["--replicas", "2", "--rounds", "1", "--hidden", "64", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sync_scaling_live.json").read_text())
    (row,) = result["rows"]
    assert row["replicas"] == 2 and row["rounds"] == 1
    # both replicas stepped through one applied exchange (the other one was its partner), none alone
    assert row["exchanges"] == 1 and row["lone_steps"] == 0
    assert 0 < row["exchange_seconds_median"] <= row["live_seconds_median"] < bench_gossip_round.ROUND_DEADLINE
    assert row["solo_exchange_seconds_median"] > 0  # one more exchange, applied, with the other replica idle
    assert row["link_latency_ms"] > 0 and row["link_mbit"] > 0
    # N = 2: the tree is one hop up and one down, NoLoCo one swap both ways: one latency less
    assert row["model_tree_seconds"] == pytest.approx(row["model_noloco_seconds"] + row["link_latency_ms"] / 1000)
    assert result["payload_bytes"] == row["payload_bytes"] > 0
