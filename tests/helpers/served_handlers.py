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
from node.p2p.membership import serve_liveness
from node.p2p.peer_conduct import ConductLimits, PeerConduct
from node.p2p.transport import Transport
from node.pipeline.block_relay import BlockRelay
from node.pipeline.check_server import CheckServer
from node.pipeline.origin import Origin
from node.pipeline.receipts import ReceiptBook, ReceiptKeeper
from node.pipeline.routing import Router
from node.pipeline.traffic import Pipeline, PipelineParts
from node.stage.stage_worker import StageWorker
from protocol import Message, recv_message
from tests.helpers.known_peers import KnownPeers

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
    router = Router(random.Random(0), config.num_stages, bans=bans)
    # a failed hop's peer is avoided for a record's lifetime, as a node's swarm view would have it
    peers = KnownPeers(members, ban_seconds=config.heartbeat.ttl)
    parts = PipelineParts(transport, worker, router, me, peers)  # type: ignore[arg-type]
    pipeline: Pipeline
    if stage == 0:
        pipeline = Origin(config, parts, rng=random.Random(0))
    else:
        pipeline = BlockRelay(config.training, config.num_stages, parts, receipts=receipts)
    await serve_liveness(transport)
    await pipeline.start()
    if receipts is not None:
        await CheckServer(config.verification, transport, receipts, peers).start()  # type: ignore[arg-type]
    return ServedNode(transport, table, pipeline, bans)
