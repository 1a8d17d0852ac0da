"""Whether other peers can dial this one, and what p2pd does about it.

A volunteer behind a home router (NAT, no port forwarding) cannot be dialed. hivemind's p2pd
(go-libp2p) offers circuit relay v2: a publicly reachable peer keeps a reservation for it, and
others reach it through `/ip4/<relay>/tcp/<port>/p2p/<relay id>/p2p-circuit/p2p/<its id>`
addresses. Every peer runs p2pd's relay service (on by default, with its limits on reservations
and circuits per peer), so the public peers of a swarm are its relays; a NAT'ed peer takes
reservations on its trusted relays (by default the peers it joined through). AutoNAT, also on,
asks other peers to dial us back to tell which case we are in. p2pd's hole punching never starts in
our case (go-libp2p waits for peers to see a public address), so relayed peers stay relayed on
libp2p; the direct links punch their own holes (node/p2p/traversal.py).

Which addresses a peer ends up with goes into its record (`dht.records.Reachability`).

Measured in the namespace bed (docs/operations.md): p2pd takes its reservation on a trusted relay
only after autorelay's boot delay (3 minutes while it knows fewer than 4 relay candidates), and it
never lists the resulting `/p2p-circuit` address among its own when the relay's address is a
private one, although a dialer that names the circuit itself gets through and streams flow. So a
peer that knows it is behind a NAT announces the circuits through its trusted relays itself
(`announced_addresses`); a dialer trying them before the reservation exists just fails and
retries later.

A relayed connection is a limited one: the relay resets it after 131072 bytes (measured; go-libp2p's
default per-circuit limit, which p2pd's -relayDataLimit flag did not raise), enough for the DHT,
records and control messages but not for activations, gradients or gossip. Two peers that are
both behind NATs therefore never train over p2pd (`carries_training`): they reach each other by
direct links, hole-punched or carried by a relay of the swarm (node/p2p/traversal.py), when the
other announces relays; otherwise they keep apart, and neither dials the other through p2pd.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from dht.announcer import PeerAnnouncer
from dht.records import CIRCUIT, Reachability
from dht.swarm_view import SwarmView


class NatReachability(StrEnum):
    """What the user tells p2pd about this peer's reachability (`--reachability`)."""

    AUTO = "auto"  # AutoNAT decides; relay reservations are made if it finds us unreachable
    PRIVATE = "private"  # behind a NAT for sure: reserve relay slots at once
    PUBLIC = "public"  # dialable (a public host or a forwarded port): never rely on relays

    def p2p_options(self) -> dict[str, object]:
        """Keyword arguments for hivemind's `P2P.create`."""
        if self == NatReachability.PUBLIC:
            return {"use_auto_relay": False, "force_reachability": "public"}
        if self == NatReachability.PRIVATE:
            return {"use_auto_relay": True, "force_reachability": "private"}
        return {"use_auto_relay": True, "force_reachability": None}


def relay_circuits(relays: Sequence[str]) -> list[str]:
    """`<relay>/p2p-circuit` for each relay multiaddr that names its peer (`/p2p/<id>`): where
    others reach us through that relay once we hold a reservation on it."""
    return [relay + CIRCUIT for relay in relays if "/p2p/" in relay and CIRCUIT not in relay]


def announced_addresses(visible: Sequence[str], relays: Sequence[str], reachability: NatReachability) -> list[str]:
    """The addresses a peer puts in its record: what p2pd sees, plus, for a peer that knows it
    is behind a NAT, the circuits through its trusted relays that p2pd may not list."""
    addresses = list(visible)
    if reachability == NatReachability.PRIVATE:
        addresses += [circuit for circuit in relay_circuits(relays) if circuit not in addresses]
    return addresses


def carries_training(mine: Reachability, theirs: Reachability, through_relays: bool = False) -> bool:
    """Whether a connection between two peers can carry training traffic: not when both can only be
    reached through p2pd's relays (no hole punching in this p2pd; relayed circuits cannot be relied on past 128 KiB),
    unless `through_relays`: a direct link reaches the other through a relay it is registered with,
    punched or carried by it (node/p2p/traversal.py)."""
    return through_relays or not (mine == Reachability.RELAYED and theirs == Reachability.RELAYED)


def unreachable_peers(me: PeerAnnouncer, view: SwarmView, through_relays: bool = False) -> set[str]:
    """Peers whose connection with this one could not carry training traffic: both behind NATs
    (unless, `through_relays`, the other announces relays our direct links reach it through).
    Asked on every routed hop: a peer whose connection even with a relayed peer carries training
    (the worst case) answers without reading the view."""
    mine = me.reachability
    if carries_training(mine, Reachability.RELAYED):
        return set()
    return {
        peer.peer_id
        for peers in view.peers_by_stage.values()
        for peer in peers
        if not carries_training(mine, peer.reachability, through_relays and bool(peer.relays))
    }
