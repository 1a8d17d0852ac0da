"""SWARM pipeline traffic: activations forward along a randomly routed chain of peers, gradients back.

A microbatch's life (path = the peers it visited, path[0] its stage-0 origin):
  origin embeds -> FORWARD to a peer of stage order[0] (hop 1) -> ... each peer runs its stage and
  forwards to a routed choice among the next stage's peers ... the last block stage sends the
  final hidden states back to the origin (hop len(order)+1), which computes the loss and sends
  BACKWARD to path[-1]; every peer backpropagates and passes the gradient to the peer before it,
  down to the origin, which finishes the embedding's backward. `order` is the stage order of this
  microbatch (CheckFree+ swaps edge block stages on odd microbatches).

Every attempt carries a random `token` chosen by its origin; only peers on the microbatch's path
see it, so only they can abort the microbatch or hand its results back to the origin (a stranger
who guesses a microbatch id cannot). A tensor a worker rejects (non-finite, absurd, misshapen) is
a strike against the peer that sent it (node/p2p/peer_conduct.py); repeated strikes ban it.

Each hop is posted (node/pipeline/hops.py): the receiver queues the work and answers only to refuse
it, so no peer waits for a round trip and a taken hop costs one frame. A send that errors, or is
refused with an ERROR, bans that peer until its DHT record expires and goes to another peer of the
stage; a send that times out or is refused BUSY goes to another peer without a ban, as SWARM does (a
slow or momentarily overloaded peer is not a faulty one; docs/algorithms.md, "SWARM routing"); all
within bounded retries. A microbatch lost past its hop's refusal window (a peer died or hung holding
it) is told to its origin where a peer on the path can, and otherwise noticed by the origin's
deadline, and run again from the start under a new id.

Here: what every peer's pipeline does alike (its services, the checks of a hop's order and path, the
sender of hops). What a peer does with a hop is its stage's role: stage 0 is the origin of its
microbatches (node/pipeline/origin.py), a block stage relays them (node/pipeline/block_relay.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from dht.announcer import PeerAnnouncer
from dht.records import PeerState, short_peer_id
from node.config import TrainingConfig
from node.p2p.swarm_peers import SwarmPeers
from node.p2p.transport import Transport
from node.pipeline.contracts import ABORT_CONTRACT, BACKWARD_CONTRACT, FORWARD_CONTRACT
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.in_flight import UNNAMED_ATTEMPT
from node.pipeline.link_compression import LinkCompression
from node.pipeline.order import visits_every_block_stage
from node.pipeline.routing import Router
from node.pipeline.verifier import Verifier
from node.runtime.tasks import BackgroundTasks
from node.stage.stage_worker import StageWorker
from protocol import ANCHOR_IDS, BackwardHeader, ForwardHeader, Message, MessageKind, ProtocolError


class PipelineService(StrEnum):
    """The stream handlers of pipeline traffic (one libp2p protocol each, node/p2p/transport.py)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    ABORT = "abort"


FORWARD, BACKWARD, ABORT = PipelineService.FORWARD, PipelineService.BACKWARD, PipelineService.ABORT


Handler = Callable[[str, Message], Message]
ForwardHandler = Callable[[str, ForwardHeader, Message], Message]
BackwardHandler = Callable[[str, BackwardHeader, Message], Message]


def _forward_service(on_forward: ForwardHandler, verifier: Verifier | None) -> Handler:
    """The FORWARD service's handler: `on_forward` with the hop's header read once, and a training
    microbatch's output from a block-stage peer, once taken, shown to the verifier: this peer is
    that hop's next peer (node/pipeline/hop_observations.py)."""

    def handle(sender: str, msg: Message) -> Message:
        header = ForwardHeader.from_meta(msg.meta)
        reply = on_forward(sender, header, msg)
        if verifier is not None and reply.kind == MessageKind.ACK and header.hop >= 2 and header.trains:
            stage = header.order[header.hop - 2]  # hop 1 came from the origin; the final hop from the last block stage
            verifier.forward_received(
                stage,
                sender,
                header.origin,
                header.microbatch_id,
                header.token,
                msg.tensors["hidden"],
                msg.tensors.get(ANCHOR_IDS),
            )
        return reply

    return handle


def _backward_service(on_backward: BackwardHandler, verifier: Verifier | None) -> Handler:
    """The BACKWARD service's handler: `on_backward` with the hop's header read once, and the
    gradient a block-stage peer returns for the input this peer sent it, once taken, shown to the
    verifier: this peer is that hop's previous peer."""

    def handle(sender: str, msg: Message) -> Message:
        header = BackwardHeader.from_meta(msg.meta)
        reply = on_backward(sender, header, msg)
        # from the next peer on the path, not the origin
        if verifier is not None and reply.kind == MessageKind.ACK and header.hop + 1 < len(header.path):
            verifier.backward_received(sender, header.origin, header.microbatch_id, msg.tensors["grad"])
        return reply

    return handle


def _hop_sender(
    training: TrainingConfig,
    transport: Transport,
    router: Router,
    stats: PipelineStats,
    peers: SwarmPeers,
    verifier: Verifier | None,
) -> HopSender:
    """The pipeline's sender of hops, with the swarm's retries and timeouts, and each hop's encoding
    chosen from this peer's uplink load (int8 while fp16 would keep its links busy)."""
    wire = LinkCompression(training.wire_compression, training.slow_link_compression, transport.channels.link_capacity)
    return HopSender(
        transport,
        router,
        stats,
        training.hop_timeout,
        training.max_retries,
        peers,
        verifier,
        compression=wire,
    )


@dataclass(frozen=True)
class PipelineParts:
    """What a peer's pipeline works with, whichever role its stage plays."""

    transport: Transport
    worker: StageWorker
    router: Router
    me: PeerAnnouncer
    peers: SwarmPeers  # the swarm's answers about other peers: bans, members, reach
    verifier: Verifier | None = None  # checks the block-stage peers this one exchanges hops with


class Pipeline(ABC):
    """A peer's pipeline traffic, whichever role its stage plays: the FORWARD, BACKWARD and ABORT
    services, each hop's checks that do not depend on the role, and the sender of hops. A stage-0
    peer is the `Origin` of its microbatches (node/pipeline/origin.py), a block stage's peer a
    `BlockRelay` (node/pipeline/block_relay.py). The role is its stage's for the pipeline's life: a
    peer that moves to another stage serves it with a new pipeline (node/server/stage_service.py)."""

    def __init__(self, training: TrainingConfig, num_stages: int, parts: PipelineParts):
        self.training = training
        self.transport, self.worker, self.router, self.me = parts.transport, parts.worker, parts.router, parts.me
        self.num_block_stages = num_stages - 1
        self.stats = PipelineStats()
        self.hops = _hop_sender(training, parts.transport, parts.router, self.stats, parts.peers, parts.verifier)
        self._tasks = BackgroundTasks()

    async def start(self) -> None:
        # many small hops to the same few peers: one long-lived stream each (node/p2p/channels.py)
        self.transport.multiplex(FORWARD, BACKWARD, ABORT)
        forward = _forward_service(self.on_forward, self.hops.verifier)
        await self.transport.serve_requests(FORWARD, forward, FORWARD_CONTRACT)
        backward = _backward_service(self.on_backward, self.hops.verifier)
        await self.transport.serve_requests(BACKWARD, backward, BACKWARD_CONTRACT)
        await self.transport.serve_requests(ABORT, self.on_abort, ABORT_CONTRACT)

    def _ack(self, request: Message) -> Message:
        return self.transport.message(MessageKind.ACK, request_id=request.request_id)

    def on_forward(self, sender: str, header: ForwardHeader, msg: Message) -> Message:
        """A FORWARD whose header `_forward_service` read: an unknown purpose was a ProtocolError
        there, not a failure later."""
        order, path, hop = header.order, header.path, header.hop
        if not visits_every_block_stage(order, self.num_block_stages):
            raise ProtocolError(f"bad stage order {list(order)}")
        # the path runs from its origin to the sender: abort notices and gradients follow it
        if not 1 <= hop <= len(order) + 1 or len(path) != hop or path[-1] != sender or path[0] != header.origin:
            raise ProtocolError(f"inconsistent hop {hop} for a path of {len(path)} peers from its origin")
        # a hop past the last block stage goes home to stage 0: only an origin takes one
        expected_stage = order[hop - 1] if hop <= len(order) else 0
        if expected_stage != self.me.stage or self.me.state != PeerState.ONLINE:
            return self.transport.error(
                f"this peer serves stage {self.me.stage} ({self.me.state}), not {expected_stage}"
            )
        return self._take_forward(sender, header, msg)

    def on_backward(self, sender: str, header: BackwardHeader, msg: Message) -> Message:
        path, hop = header.path, header.hop
        if not 0 <= hop < len(path) or path[hop] != self.me.peer_id:
            raise ProtocolError(f"backward hop {hop} does not match its path")
        if sender != header.sender:
            raise ProtocolError("backward arrived from a peer that is not the next hop of its path")
        if hop == 0 and not header.carries_token:  # home to an origin, where attempts are named by token
            raise ProtocolError(UNNAMED_ATTEMPT)
        if not self._expects_backward(header):
            return self.transport.error("unknown microbatch")  # not computed here: no work, no notice to anyone
        self._tasks.spawn(self._run_backward(header, msg))
        return self._ack(msg)

    def on_abort(self, sender: str, msg: Message) -> Message:
        """A peer on a microbatch's path gave up on it. Only an ERROR naming a microbatch by id and
        token gets here (ABORT_CONTRACT, checked by the transport)."""
        # the ERROR schema makes "reason" a string (protocol/messages.py); shown, never parsed
        reason = f"{short_peer_id(sender)} gave up: {msg.meta['reason'][:200]}"
        return self._ack(msg) if self._take_abort(msg.meta, reason) else self.transport.error("unknown microbatch")

    @abstractmethod
    def _take_forward(self, sender: str, header: ForwardHeader, msg: Message) -> Message:
        """A FORWARD for this peer's stage, its order and path checked: queue its work, or refuse it."""

    @abstractmethod
    def _expects_backward(self, header: BackwardHeader) -> bool:
        """Whether the gradient `header` names may come here: this peer sent that forward on."""

    @abstractmethod
    async def _run_backward(self, header: BackwardHeader, msg: Message) -> None:
        """The backward of a gradient `_expects_backward` let in."""

    @abstractmethod
    def _take_abort(self, meta: dict, reason: str) -> bool:
        """An abort notice naming a microbatch by id and token (its ERROR's `meta`); whether it named
        one this peer knows."""

    async def close(self) -> None:
        await self._tasks.close()
        await self.hops.close()
