"""Budgets for expensive answers (node/p2p/budgets.py), on their own and in the two services that
spend them: state uploads (node/recovery/state_transfer.py) and gossip exchanges (node/averaging),
each reached through a real Transport's session handler (tests/helpers/served_handlers.py), on a
fake clock."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
import torch

from dht.records import PeerRecord, PeerState
from node.averaging.gossip import Gossip
from node.config import GossipConfig, GossipMode, SwarmConfig
from node.p2p.bans import BanList
from node.p2p.budgets import AnswerBudget
from node.p2p.transport import Transport
from node.pipeline.stage_worker import StageWorker
from node.recovery.state_transfer import UPLOADS_PER_PEER, UPLOADS_TOTAL, join_live_stage, serve_state
from node.runtime.meter import Tally
from protocol import DEFAULT_LIMITS, Message, MessageKind, frame_header, seal_message
from protocol.stage_state import StageState, StatePart, StateUnavailable
from tests.helpers.served_handlers import SWARM, HandlerTable, ServedNode
from tests.unit.test_peer_conduct import Clock

A, B, C = "peer-a", "peer-b", "peer-c"


def test_one_identity_is_refused_past_its_budget_while_another_is_served():
    clock = Clock()
    budget = AnswerBudget("uploads", per_peer=3, total=10, clock=clock)
    assert [budget.spend(A) for _ in range(3)] == [None, None, None]
    assert budget.spend(A) == "at most 3 uploads per 60 s to peer-a"
    assert budget.spend(B) is None
    assert (budget.given(A), budget.given(B), budget.given(), budget.refused) == (3, 1, 4, 1)


def test_an_answer_counts_for_one_window_then_the_budget_is_back():
    clock = Clock()
    budget = AnswerBudget("uploads", per_peer=2, total=10, clock=clock)
    assert budget.spend(A) is None
    clock.now += 30
    assert budget.spend(A) is None and budget.spend(A) is not None
    clock.now += 30  # the first answer is 60 s old: out of the window, the second is not
    assert budget.spend(A) is None and budget.spend(A) is not None
    clock.now += 60
    assert budget.given(A) == 0 and budget.given() == 0
    assert budget.spend(A) is None and budget.spend(A) is None and budget.refused == 2


def test_the_total_budget_refuses_every_identity_until_answers_age_out():
    clock = Clock()
    budget = AnswerBudget("uploads", per_peer=2, total=5, clock=clock)
    for peer in ("p1", "p2", "p3", "p4", "p5"):
        assert budget.spend(peer) is None
        clock.now += 1
    assert budget.spend("p6") == "this peer gives at most 5 uploads per 60 s: ask another peer"
    assert budget.spend("p1") is not None and budget.refused == 2
    clock.now += 55  # p1's answer (60 s ago) is out of the window: one slot, whoever asks first
    assert budget.spend("p6") is None and budget.spend("p7") is not None
    assert (budget.given(), budget.given("p1"), budget.given("p6")) == (5, 0, 1)


def test_a_refund_gives_back_the_last_charge_only():
    clock = Clock()
    budget = AnswerBudget("uploads", per_peer=2, total=3, clock=clock)
    assert budget.spend(A) is None and budget.spend(A) is None
    budget.refund(A)
    budget.refund(B)  # charged nothing: changes nothing
    assert (budget.given(A), budget.given()) == (1, 1)
    assert budget.spend(A) is None and budget.spend(A) is not None


def test_many_identities_leave_at_most_total_entries_behind():
    clock = Clock()
    budget = AnswerBudget("uploads", per_peer=1, total=4, clock=clock)
    for i in range(1000):
        budget.spend(f"sybil-{i}")
        clock.now += 1
    # 4 answers a minute for 1000 s, a new identity each second: 17 windows' worth, 68 answers
    assert len(budget._given) == 4 and len(budget._all) == 4 and budget.refused == 1000 - 68
    with pytest.raises(ValueError, match="per_peer"):
        AnswerBudget("uploads", per_peer=5, total=4)


# ------------------------------------------------------------------------------------------------
# In the services


def served(stage: int) -> ServedNode:
    table = HandlerTable()
    transport = Transport(table, SWARM, stage)  # type: ignore[arg-type]
    return ServedNode(transport, table, None, BanList())  # type: ignore[arg-type]


def request(transport: Transport, kind: MessageKind, meta: dict, stage: int) -> bytes:
    message = Message(kind=kind, swarm_id=SWARM, sender_stage=stage, request_id=5, meta=meta)
    payload = seal_message(message, "none", DEFAULT_LIMITS, None)
    return frame_header(payload) + payload


def test_state_uploads_are_budgeted_per_asker_and_refused_busy_with_the_reason():
    async def scenario() -> list:
        node = served(1)
        clock = Clock()
        unavailable: set[StatePart] = {StatePart.EDGE_COPY}

        async def provide(part: StatePart) -> StageState:
            if part in unavailable:
                raise StateUnavailable("stage 1 keeps no edge copy")
            return StageState(stage=1, weights={"w": torch.ones(3)})

        await serve_state(node.transport, provide, budget=AnswerBudget("state uploads", 2, 3, clock=clock))
        ask = request(node.transport, MessageKind.STATE_REQUEST, {"stage": 1, "part": "stage"}, 1)
        edge = request(node.transport, MessageKind.STATE_REQUEST, {"stage": 1, "part": "edge_copy"}, 1)
        kinds = []
        for sender, frame in [(A, edge), (A, edge), (A, edge), (A, ask), (A, ask), (A, ask), (B, ask), (C, ask)]:
            reply, _ = await node.exchange(sender, "state", frame)
            kinds.append((reply.kind, reply.meta.get("reason", "")))
        refused = node.transport.meter.snapshot().tallies[Tally.STATE_ANSWERS_REFUSED]
        await node.transport.close()
        return [*kinds, refused]

    *kinds, refused = asyncio.run(scenario())
    unavailable = (MessageKind.ERROR, "stage 1 keeps no edge copy")
    header = (MessageKind.STATE_HEADER, "")
    assert kinds[:3] == [unavailable] * 3  # refunded: nothing was uploaded
    assert kinds[3:5] == [header, header]
    assert kinds[5] == (MessageKind.BUSY, "at most 2 state uploads per 60 s to peer-a")
    assert kinds[6] == header  # another asker is served while A is refused
    assert kinds[7] == (MessageKind.BUSY, "this peer gives at most 3 state uploads per 60 s: ask another peer")
    assert refused == 2


def test_the_default_upload_budget_lets_a_joiner_through_every_join_round():
    # a joiner asks one donor at most once per round: every round's ask, and a catch-up's, fit
    rounds = inspect.signature(join_live_stage).parameters["rounds"].default
    assert UPLOADS_PER_PEER == rounds + 1 and UPLOADS_TOTAL == 5 * UPLOADS_PER_PEER


# ------------------------------------------------------------------------------------------------
# Gossip


def gossip_node(mode: GossipMode, members: list[str]) -> tuple[Gossip, ServedNode, StageWorker]:
    config = SwarmConfig(num_stages=3, gossip=GossipConfig(mode=mode, inner_steps=4))
    node = served(1)
    worker = StageWorker(config, 1)
    me = SimpleNamespace(
        stage=1, peer_id="me", state=PeerState.ONLINE, record=lambda: PeerRecord(peer_id="me", stage=1)
    )
    view = SimpleNamespace(online=lambda stage, exclude=None: [PeerRecord(peer_id=p, stage=stage) for p in members])
    gossip = Gossip(config, me, worker, node.transport, view, node.bans, None, lambda p: 0.0)  # type: ignore[arg-type]
    return gossip, node, worker


async def trained(worker: StageWorker) -> None:
    """Two inner steps' worth of progress: ripe for a round (H = 4), with a Delta to send."""

    def step() -> None:
        with torch.no_grad():
            next(worker.module.parameters()).add_(0.01)
        worker.inner_step = 2

    await worker.compute(step)


def gossip_request(gossip: Gossip, stage: int = 1) -> bytes:
    return request(gossip.transport, MessageKind.GOSSIP_REQUEST, gossip.wire.request_meta(0, 4, 1), stage)


@pytest.mark.parametrize("mode", [GossipMode.NOLOCO, GossipMode.DILOCO])
def test_gossip_is_refused_to_an_identity_without_an_online_record_of_the_stage(mode: GossipMode):
    async def scenario() -> list:
        gossip, node, worker = gossip_node(mode, members=[A])
        try:
            await gossip.start()
            await trained(worker)  # the member gets past every check but the budget's
            gossip.rounds.answers = AnswerBudget("gossip exchanges", 1, 2, clock=Clock())
            gossip.rounds.answers.spend(A)
            replies = []
            for sender in (B, A):
                reply, _ = await node.exchange(sender, "gossip", gossip_request(gossip))
                replies.append((reply.kind, reply.meta.get("reason", "")))
            return [*replies, node.transport.meter.snapshot().tallies[Tally.GOSSIP_ANSWERS_REFUSED]]
        finally:
            await gossip.close()
            await node.transport.close()
            worker.close()

    stranger, member, refused = asyncio.run(scenario())
    reason = "no online record of stage 1 for you here: gossip partners are the stage's members"
    assert stranger == (MessageKind.ERROR, reason)
    assert member == (MessageKind.BUSY, "at most 1 gossip exchanges per 60 s to peer-a")
    assert refused == 1


def test_a_member_within_its_gossip_budget_is_answered_and_charged_once():
    async def scenario() -> tuple:
        gossip, node, worker = gossip_node(GossipMode.NOLOCO, members=[A, B])
        try:
            await gossip.start()
            await trained(worker)
            gossip.rounds.answers = AnswerBudget("gossip exchanges", 1, 2, clock=Clock())
            first, _ = await node.exchange(A, "gossip", gossip_request(gossip))  # ends when our stream does
            again, _ = await node.exchange(A, "gossip", gossip_request(gossip))
            other, _ = await node.exchange(B, "gossip", gossip_request(gossip))
            return first.kind, again.kind, other.kind, gossip.rounds.answers.given()
        finally:
            await gossip.close()
            await node.transport.close()
            worker.close()

    assert asyncio.run(scenario()) == (MessageKind.GOSSIP_ACCEPT, MessageKind.BUSY, MessageKind.GOSSIP_ACCEPT, 2)
