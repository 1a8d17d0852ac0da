"""In-process spot-checks over an in-memory wire that encodes and decodes every message as the
network would: real StageWorkers keep receipts of real microbatches (node/pipeline/receipts.py) and
answer checks (node/pipeline/check_server.py); a checker decides and strikes
(node/pipeline/verifier.py). Used by tests/unit/test_verifier.py and
tests/benchmarks/bench_verification.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random

import torch

from dht.records import EventKind
from node.config import SwarmConfig, VerificationConfig
from node.p2p.bans import BanList
from node.p2p.peer_conduct import PeerConduct
from node.p2p.transport import TransportError
from node.pipeline.check_server import CheckServer
from node.pipeline.hop_observations import Observed
from node.pipeline.receipts import ReceiptBook, ReceiptKeeper
from node.pipeline.spot_check import Finding
from node.pipeline.verifier import Verifier
from node.stage.stage_worker import StageWorker
from protocol import Message, MessageKind, decode_message, encode_message
from protocol.tensors import decode_tensor, encode_tensor
from tests.helpers.faulty_node import FaultKind, make_faulty, make_liar
from tests.helpers.known_peers import KnownPeers

SETTINGS = VerificationConfig()
CONFIG = SwarmConfig()
WIRE_CODEC = "fp16"  # what the transport does to float tensors (training.wire_compression)


def carried(tensor: torch.Tensor, codec: str = WIRE_CODEC) -> torch.Tensor:
    """A hop's tensor as its receiver decodes it."""
    return decode_tensor(encode_tensor(tensor, codec))


class Wire:
    def __init__(self) -> None:
        self.servers: dict[str, CheckServer] = {}


class FakeTransport:
    """Requests encoded, decoded, handled by the receiver's CheckServer, and the reply encoded and
    decoded again, as p2pd streams would carry them."""

    def __init__(self, wire: Wire, peer_id: str, stage: int):
        self.wire, self.peer_id, self.stage = wire, peer_id, stage
        self.bans = BanList()
        self.conduct = PeerConduct(ban_until=lambda peer: 0.0, bans=self.bans)
        self._ids = itertools.count(1)

    def message(self, kind, meta=None, tensors=None, request_id=None) -> Message:
        request_id = next(self._ids) if request_id is None else request_id
        return Message(kind, "unit", self.stage, request_id, meta or {}, tensors or {})

    def error(self, reason: str, request_id: int = 0) -> Message:
        return self.message(MessageKind.ERROR, {"reason": reason}, request_id=request_id)

    async def request(self, peer_id: str, service: str, message: Message, timeout: float) -> Message:
        receiver = self.wire.servers.get(peer_id)
        if receiver is None:
            raise TransportError(f"{peer_id} is unreachable")
        delivered = decode_message(encode_message(message, WIRE_CODEC), expected_swarm="unit")
        reply = await receiver.on_request(self.peer_id, delivered)
        reply = decode_message(encode_message(reply, WIRE_CODEC), expected_swarm="unit")
        if reply.kind == MessageKind.ERROR:
            raise TransportError(reply.meta["reason"])
        return reply


class Events:
    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []  # (detail, peer)

    def publish(self, kind: EventKind, stage: int | None, detail: str, peer_id: str | None = None) -> None:
        assert kind == EventKind.VERIFICATION
        self.published.append((detail, peer_id or ""))

    async def close(self) -> None:
        pass


@dataclasses.dataclass
class Replica:
    peer_id: str
    worker: StageWorker
    keeper: ReceiptKeeper
    server: CheckServer


class Swarm:
    """A checker (a stage-0 worker with a Verifier) and block-stage replicas answering checks."""

    def __init__(self, config: SwarmConfig = CONFIG, settings: VerificationConfig = SETTINGS) -> None:
        self.config, self.settings = config, settings
        self.wire, self.events = Wire(), Events()
        self.replicas: dict[str, Replica] = {}
        self.checker = self.verifier_for("checker", StageWorker(config, 0))
        self._ids = itertools.count(1)

    def verifier_for(self, peer_id: str, worker: StageWorker) -> Verifier:
        transport = FakeTransport(self.wire, peer_id, worker.stage)
        return Verifier(
            self.settings, transport, worker, transport.bans, self.events,  # type: ignore[arg-type]
            peer_id=peer_id, replicas=lambda stage: sorted(p for p in self.replicas if p != peer_id),
            hop_timeout=10.0, rng=random.Random(peer_id),
        )  # fmt: skip

    def add(self, peer_id: str, fault: FaultKind | None = None, active=lambda: True) -> Replica:
        worker = StageWorker(self.config, 1)
        keeper = ReceiptKeeper(worker, ReceiptBook(self.settings.max_receipts, self.settings.receipt_seconds))
        transport = FakeTransport(self.wire, peer_id, 1)
        server = CheckServer(self.settings, transport, keeper, KnownPeers())  # type: ignore[arg-type]
        if fault is not None:
            make_faulty(worker.module, fault, active)
            make_liar(keeper, server, fault, active)
        self.wire.servers[peer_id] = server
        self.replicas[peer_id] = replica = Replica(peer_id, worker, keeper, server)
        return replica

    def hop(self, peer_id: str, backward: bool = True, shape: tuple[int, int] = (2, 16)) -> Observed:
        """One training microbatch through `peer_id`, as the checker both sends it and receives its
        output (a pipeline of one block stage): every tensor crosses the wire. `shape`: batch, sequence."""
        replica, microbatch_id = self.replicas[peer_id], next(self._ids)
        key, token = ("checker", microbatch_id), f"token-{microbatch_id}"
        hidden = torch.randn(*shape, self.config.model.hidden_size)
        output = carried(replica.keeper.forward(key, token, carried(hidden)))
        observed = Observed(1, peer_id, "checker", microbatch_id, token, 0.0, sent_input=hidden, received_output=output)
        if backward:
            grad = 1e-3 * torch.randn_like(output)
            observed.sent_grad_output = grad
            observed.received_grad_input = carried(replica.keeper.backward(key, carried(grad)))
        return observed

    def check(self, observed: Observed) -> Finding | None:
        return asyncio.run(self.checker.check(observed))
