"""The gossip session's messages, shared by the NoLoCo pairwise round and the DiLoCo group round.

One libp2p stream (service "gossip") per exchange; docs/gossip.md ("A round on the wire") lists
the steps. Tensors travel as GOSSIP_CHUNKs through node/p2p/tensor_stream.py: each tensor is
flattened and cut into CHUNK_ELEMENTS elements, `index` = the tensor's place (node/averaging/
gossip_codec.py's WireLayout: phi samples, then each parameter's Delta codes and scales, in
`module.parameters()` order), `offset` = the element offset in it. The receiver knows every shape
and dtype from its own module and the codec (same stage, same config), never from the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from torch import Tensor

from node.averaging.gossip_codec import MAX_PHI_SEED, PhiDither
from node.averaging.outer_replica import OuterReplica
from node.config import GossipConfig, GossipMode
from node.p2p.tensor_stream import ChunkIndex, Session, TensorStream
from node.p2p.transport import Transport
from protocol import Compression, Message, MessageKind

__all__ = [
    "CHUNK_ELEMENTS",
    "COMPUTE_SLACK",
    "GOSSIP_CHUNKS",
    "GOSSIP_COMPRESSION",
    "GOSSIP_SERVICE",
    "MIN_GOSSIP_BANDWIDTH",
    "OPEN_TIMEOUT",
    "STALL_COOLDOWN",
    "STALL_LATENCY",
    "STALL_TIMEOUT",
    "GossipWire",
]

GOSSIP_SERVICE = "gossip"
CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32 (256 KiB of codes) per GOSSIP_CHUNK
# A partner that sends nothing for STALL_TIMEOUT seconds while a message is due ends the round
# (docs/gossip.md, "Timeouts and failures"): the time one chunk takes at the slowest link we
# serve, plus slack for a loaded event loop. Waits for the partner's compute thread (its capture
# before ACCEPT, its validation before DONE) get COMPUTE_SLACK x what the same work took us on top.
MIN_GOSSIP_BANDWIDTH = 1 << 20  # bytes/s (8.4 Mbit/s), per direction: a slow home uplink
STALL_LATENCY = 2.0  # seconds
STALL_TIMEOUT = STALL_LATENCY + CHUNK_ELEMENTS * 4 / MIN_GOSSIP_BANDWIDTH  # 3 s
# a round's transfer is given its payload at MIN_GOSSIP_BANDWIDTH, or at the partner's measured
# link rate when one is known, times this, on top of gossip.round_timeout (round_budget)
TRANSFER_SLACK = 2.0
COMPUTE_SLACK = 4.0
STALL_COOLDOWN = 60.0  # seconds a partner that stalled is neither asked nor answered (not a ban)
# Opening the stream to a partner: its record may outlive it (a crash, or a record that claims a
# stage nobody serves), and while an initiator dials, its one exchange slot answers everyone BUSY.
# A live peer's stream opens in a few seconds, a fresh dial through a relay included.
OPEN_TIMEOUT = 10.0
GOSSIP_CHUNKS = TensorStream(MessageKind.GOSSIP_CHUNK, CHUNK_ELEMENTS, ChunkIndex.TENSOR)
# phi travels uncompressed: replicas' phi differ by far less than fp16's relative 5e-4 rounding,
# so a compressed phi would swamp the very differences the pull term averages away
GOSSIP_COMPRESSION = Compression.NONE


class GossipWire:
    """Builds, checks, sends and receives the gossip messages of one replica."""

    def __init__(self, transport: Transport, settings: GossipConfig, replica: OuterReplica):
        self.transport = transport
        self.settings = settings
        self.replica = replica

    def session(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stall_timeout: float | None = None
    ) -> Session:
        """A session on a stream; each message in or out must move within `stall_timeout` seconds
        (None: no per-message limit), and every round is bounded as a whole by its caller."""
        return Session(self.transport, reader, writer, timeout=stall_timeout, compression=GOSSIP_COMPRESSION)

    @contextlib.asynccontextmanager
    async def open(self, peer: str, stall_timeout: float | None = None) -> AsyncIterator[Session]:
        """A new gossip session with `peer` (StreamNotOpened if it cannot be opened within
        OPEN_TIMEOUT, or the round timeout if that is shorter)."""
        opening = min(OPEN_TIMEOUT, self.settings.round_timeout)
        async with self.transport.session(peer, GOSSIP_SERVICE, opening) as (reader, writer):
            yield self.session(reader, writer, stall_timeout)

    @staticmethod
    async def recv_within(session: Session, seconds: float | None, kind: MessageKind | None = None) -> Message:
        """The next message (which must be of `kind` if given, as `Session.expect`) within
        `seconds` instead of the session's per-message limit: for a reply the partner computes
        first. Only while nothing else reads or writes the session."""
        saved, session.timeout = session.timeout, seconds
        try:
            return await (session.recv() if kind is None else session.expect(kind))
        finally:
            session.timeout = saved

    # ---- messages ------------------------------------------------------------------------------

    def request_meta(self, round_: int, steps: int = 0, phi_seed: int = 0) -> dict:
        """`steps`: the inner steps the sender's Delta covers (lets the partner judge ripeness);
        `phi_seed`: the seed of the dither both sides code phi with this round (gossip_codec.PhiDither)."""
        return {
            "round": round_,
            "num_tensors": len(self.replica.params),
            "total_numel": self.replica.total_numel,
            "mode": str(self.settings.mode),
            "steps": steps,
            "phi_seed": phi_seed,
        }

    def request(self, round_: int, steps: int = 0, phi_seed: int = 0) -> Message:
        return self.transport.message(MessageKind.GOSSIP_REQUEST, self.request_meta(round_, steps, phi_seed))

    def round_budget(self, key: PhiDither | None, peer: str) -> float:
        """Seconds a round with `peer` may last: gossip.round_timeout, plus its payload (one
        direction; both go at once) at the rate a link to `peer` measures (node/p2p/channels.py),
        never taken below MIN_GOSSIP_BANDWIDTH, times TRANSFER_SLACK."""
        payload = self.replica.wire_layout(key is not None).nbytes
        rate = max(self.transport.channels.peer_link_rate(peer) or 0.0, MIN_GOSSIP_BANDWIDTH)
        return self.settings.round_timeout + TRANSFER_SLACK * payload / rate

    def refusal(self, request: Message, stage: int, sender_banned: bool, sender_stalled: bool = False) -> str | None:
        """Why a replica of `stage` refuses a request outright (None: it may serve it)."""
        if request.kind != MessageKind.GOSSIP_REQUEST:
            return f"expected gossip_request, got {request.kind.value}"
        if self.settings.mode == GossipMode.NONE:
            return "gossip is disabled on this peer"
        if request.sender_stage != stage:
            return f"this peer serves stage {stage}, not {request.sender_stage}"
        if sender_banned:
            return "banned"
        if sender_stalled:
            return "you stalled a recent round: try again later"
        mine = self.request_meta(0)
        for key in ("num_tensors", "total_numel", "mode"):
            if request.meta.get(key) != mine[key]:
                return f"{key} {request.meta.get(key)!r} != {mine[key]!r}"
        if not 0 <= request.meta["phi_seed"] <= MAX_PHI_SEED:  # an int: the schema's check
            return f"phi_seed {request.meta['phi_seed']} outside 0..{MAX_PHI_SEED}"
        return None

    def accept(self, round_: int) -> Message:
        return self.transport.message(MessageKind.GOSSIP_ACCEPT, {"round": round_})

    def done(self, round_: int, reason: str | None) -> Message:
        """The DONE of the pairwise handshake: whether this side accepts the partner's tensors."""
        meta = {"round": round_, "accept": reason is None, "reason": (reason or "")[:500]}
        return self.transport.message(MessageKind.GOSSIP_DONE, meta)

    # ---- tensors -------------------------------------------------------------------------------

    async def send_tensors(self, session: Session, round_: int, tensors: Sequence[Tensor]) -> None:
        """Send host tensors (RoundStart.wire_phi / wire_delta: never the device's own)."""
        await GOSSIP_CHUNKS.send(session, tensors, {"round": round_})

    async def recv_tensors(self, session: Session, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Fill `buffers` (host fp32 tensors shaped like my parameters, phi..., then Delta..., from
        OuterReplica.host_buffers) from the partner's chunks, in order."""
        await GOSSIP_CHUNKS.receive(session, buffers)
        return list(buffers)

    async def swap(
        self, session: Session, round_: int, tensors: Sequence[Tensor], buffers: Sequence[Tensor]
    ) -> list[Tensor]:
        """Send `tensors` while receiving as many of the partner's into `buffers` (both at once)."""
        sending = asyncio.create_task(self.send_tensors(session, round_, tensors))
        receiving = asyncio.create_task(self.recv_tensors(session, buffers))
        try:
            done, _ = await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await sending
            return await receiving
        finally:
            for task in (sending, receiving):
                task.cancel()
            await asyncio.gather(sending, receiving, return_exceptions=True)
