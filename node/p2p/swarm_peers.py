"""The other peers, as a serving peer's parts ask about them: one object instead of a closure each.

`SwarmPeers` is what the pipeline asks (node/pipeline/): how long to avoid a peer that failed a hop,
whether a peer may send us work, which peers a hop cannot reach. `ViewedPeers` answers it, and the
transport's and verifier's questions too, from the swarm view (dht/swarm_view.py), the membership
checks (node/p2p/membership.py) and this peer's reachability (node/p2p/reachability.py).
`swarm_transport` builds a joined peer's transport together with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from dht.announcer import PeerAnnouncer
from dht.registry import swarm_key_of
from dht.swarm_view import SwarmView
from node.config import SwarmConfig
from node.p2p.dialer import PeerDialer
from node.p2p.direct import direct_addresses_of
from node.p2p.membership import LivenessChecks, LivenessSettings, Membership, transport_ping
from node.p2p.network import Network
from node.p2p.peer_conduct import PeerConduct
from node.p2p.reachability import unreachable_peers
from node.p2p.transport import Transport
from node.runtime.meter import Meter


class SwarmPeers(Protocol):
    """What the pipeline asks of the swarm about other peers."""

    def ban_until(self, peer_id: str) -> float:
        """When a ban of `peer_id` for a failed hop should end (time.time() seconds)."""
        ...

    def refusal(self, peer_id: str, stage: int) -> str | None:
        """Why `peer_id` may not send us work from `stage`; None: it may."""
        ...

    def unreachable(self) -> set[str]:
        """The peers a hop from here cannot reach."""
        ...


class ViewedPeers:
    """SwarmPeers answered from this peer's swarm view and membership checks, with the addresses
    its transport dials and the stage mates its verifier checks."""

    def __init__(
        self, view: SwarmView, me: PeerAnnouncer, membership: Membership, ban_seconds: float, through_relays: bool
    ):
        """`ban_seconds`: the least a ban lasts (a record's lifetime); `through_relays`: hops run on
        direct links, which reach a peer behind a NAT through its relays (node/p2p/traversal.py)."""
        self.view, self.me, self.membership = view, me, membership
        self.ban_seconds, self.through_relays = ban_seconds, through_relays

    def ban_until(self, peer_id: str) -> float:
        """Until its record expires: a peer banned for a failed hop comes back with a fresh record."""
        record = self.view.record_of(peer_id)
        return max(record.expires if record else 0.0, time.time() + self.ban_seconds)

    def refusal(self, peer_id: str, stage: int) -> str | None:
        return self.membership.refusal(peer_id, stage)

    def is_member(self, peer_id: str) -> bool:
        return self.membership.is_member(peer_id)

    def unreachable(self) -> set[str]:
        return unreachable_peers(self.me, self.view, through_relays=self.through_relays)

    def reachable(self, stage: int) -> list[str]:
        """The online peers of `stage` a stream from here reaches, this one excluded."""
        unreachable = unreachable_peers(self.me, self.view)
        return [p.peer_id for p in self.view.online(stage, exclude=self.me.peer_id) if p.peer_id not in unreachable]

    def addresses(self, peer_id: str) -> Sequence[str]:
        """Where its signed record says `peer_id` listens (none without a record)."""
        record = self.view.record_of(peer_id)
        return record.addrs if record else ()

    def direct_addresses(self, peer_id: str) -> list[tuple[str, int]]:
        return direct_addresses_of(self.view.record_of(peer_id))


def swarm_transport(
    network: Network, config: SwarmConfig, me: PeerAnnouncer, view: SwarmView, meter: Meter
) -> tuple[Transport, ViewedPeers]:
    """A joined peer's transport, and the other peers as its view and membership answer for them.
    Membership pings over the transport, whose stream admission asks who is a member: so the
    transport reaches `peers`, made last, by name."""
    conduct = PeerConduct(
        ban_until=lambda peer_id: peers.ban_until(peer_id),
        bans=network.bans,  # the node's one ban store: admission, routing, gossip and spot-checks
        # strangers share a quarter of the stream slots
        is_member=lambda peer_id: peers.is_member(peer_id),
    )
    transport = Transport(
        network.p2p,
        config.swarm_id,
        me.stage,
        compression=config.training.wire_compression,
        conduct=conduct,
        swarm_key=swarm_key_of(network.dht),  # a private swarm: every message carries a MAC
        # dial peers where their signed records say, not only where p2pd's routing thinks they are
        dialer=PeerDialer(network.p2p, lambda peer_id: peers.addresses(peer_id)),
        meter=meter,
        direct=network.direct,
        direct_addresses=lambda peer_id: peers.direct_addresses(peer_id),
    )
    # who may send us work: a record in our view and an answer to our ping
    membership = Membership(view, LivenessChecks(transport_ping(transport, LivenessSettings().timeout)), me.peer_id)
    view.on_refresh(membership.on_refresh)
    peers = ViewedPeers(view, me, membership, config.heartbeat.ttl, through_relays=network.traversal is not None)
    return transport, peers
