"""A node's real request handlers, served by a real Transport, reached without a network.

`HandlerTable` stands in for hivemind's P2P: it keeps the stream handlers the transport registers,
and `exchange` calls one with an in-memory stream holding a frame, as p2pd would for a stream from
`sender`, then reads the reply written back. Everything between (admission, decoding, the
service's contract, the handler, the reply's encoding) is the node's own code. A hop the handlers
send onwards fails at once (there is no p2pd to open a stream), as one to a vanished peer would.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection
from dataclasses import dataclass
from types import SimpleNamespace

from dht.records import PeerState
from node.config import SwarmConfig
from node.p2p.bans import BanList
from node.p2p.membership import NOT_A_MEMBER, serve_liveness
from node.p2p.peer_conduct import ConductLimits, PeerConduct
from node.p2p.transport import Transport
from node.pipeline.check_server import CheckServer
from node.pipeline.receipts import ReceiptBook, ReceiptKeeper
from node.pipeline.routing import Router
from node.pipeline.traffic import Pipeline
from node.stage.stage_worker import StageWorker
from protocol import Message, recv_message

SWARM = "served-handlers"


class HandlerTable:
    """The stream handlers a transport registered, by protocol name (all of P2P a server uses)."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    async def add_binary_stream_handler(self, name: str, handler) -> None:
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self.handlers.pop(name, None)


class CapturedWriter:
    """The server's end of a stream: what it writes is kept for the test to read."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@dataclass
class ServedNode:
    """One node's serving side: its transport, the handlers it registered, its pipeline."""

    transport: Transport
    table: HandlerTable
    pipeline: Pipeline
    bans: BanList

    async def exchange(self, sender: str, service: str, frame: bytes) -> tuple[Message | None, CapturedWriter]:
        """`frame` (header included) on a new stream from `sender` to `service`; the reply read back
        (None when nothing was written) and the stream's writer."""
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        writer = CapturedWriter()
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: sender))
        await self.table.handlers[self.transport.protocol_name(service)](info, reader, writer)
        if not writer.data:
            return None, writer
        replies = asyncio.StreamReader()
        replies.feed_data(bytes(writer.data))
        replies.feed_eof()
        return await recv_message(replies, self.transport.limits, SWARM), writer

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until the work the handlers queued (computation, onward hops) is done."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.pipeline._tasks) and loop.time() < deadline:
            await asyncio.sleep(0.002)

    async def close(self) -> None:
        await self.pipeline.close()
        await self.transport.close()
        self.pipeline.worker.close()


class MembersOnly:
    """node/p2p/membership.py's Membership as these handlers see it: `members` pass (their records
    and pings are taken as given; None: every peer), anyone else is refused with the node's words."""

    def __init__(self, members: Collection[str] | None):
        self.members = members

    def refusal(self, peer_id: str, stage: int | None = None) -> str | None:
        if self.members is None or peer_id in self.members:
            return None
        return f"{NOT_A_MEMBER}: no record of you here"

    async def admit(self, peer_id: str, stage: int | None = None, wait: float = 0.0) -> str | None:
        return self.refusal(peer_id, stage)


async def served_node(
    config: SwarmConfig,
    stage: int,
    peer_id: str,
    members: Collection[str],
    limits: ConductLimits | None = None,
    with_checks: bool = False,
) -> ServedNode:
    """A peer of `stage` serving its pipeline (and, `with_checks` on a block stage, its spot-check
    answers) as build_service wires them: one ban store for admission and routing. Call on a loop."""
    table, bans = HandlerTable(), BanList()
    transport = Transport(table, SWARM, stage, conduct=PeerConduct(limits, bans=bans))  # type: ignore[arg-type]
    worker = StageWorker(config, stage)
    receipts = ReceiptKeeper(worker, ReceiptBook(8, 30.0)) if with_checks else None
    me = SimpleNamespace(stage=stage, state=PeerState.ONLINE, peer_id=peer_id)
    pipeline = Pipeline(
        config,
        transport,
        worker,
        Router(random.Random(0), config.num_stages, bans=bans),
        me,  # type: ignore[arg-type]
        rng=random.Random(0),
        refusal=MembersOnly(members).refusal,
        receipts=receipts,
    )
    await serve_liveness(transport)
    await pipeline.start()
    if receipts is not None:
        gate = MembersOnly(members)
        await CheckServer(config.verification, transport, receipts, gate).start()  # type: ignore[arg-type]
    return ServedNode(transport, table, pipeline, bans)
