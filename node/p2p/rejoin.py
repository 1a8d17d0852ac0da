"""Where a peer re-enters the DHT after losing contact with it (a partition, a rebooted router).

hivemind drops a node from its routing table after one unanswered request and never re-bootstraps,
so a peer cut off for longer than a few requests ends with an empty table, and so do its former
neighbours for it: after the heal each side keeps its own half of the DHT and no record crosses.
`Network.keep_joined` (node/p2p/network.py) therefore pings, every period, the peers it knows of
that are not in its routing table: the initial peers first (the usual way in), then the peers p2pd
still holds a connection to, then every peer whose signed record it read (the swarm view feeds
`remember`), so that the swarm heals even when the initial peers are gone. One answered ping
re-adds that peer on both sides; a lookup of our own id then refills the table from its neighbours.

A peer that does not answer is tried again after a delay that doubles up to `max_delay`: a dead
peer's address costs a ping every few minutes, not every period. Two exceptions, both measured in
the partition test (tests/netns/test_swarm_links.py): the initial peers are tried every round (a
few addresses, and the usual way in), and a peer whose table is empty tries everyone it knows every
round, delays or not. Otherwise, after a heal, the two cut-off stage-1 peers found each other first
(each one's remembered address for the other), while the initial peer they had failed to reach
during the cut waited out its delay: the two formed an island that saw stage 0 lost, and one of
them left its stage for stage 0 seconds before the island merged with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hivemind.utils.multiaddr import Multiaddr


def peer_id_of_maddr(maddr: str) -> str | None:
    """The peer id in a multiaddr's last /p2p/ part (None if it has none or does not parse)."""
    try:
        return Multiaddr(maddr).value_for_protocol("p2p")
    except Exception:  # multiaddr raises its own errors for unknown protocols and a missing /p2p/
        return None


@dataclass
class RejoinBook:
    """The peers this one may re-enter the DHT through, with a retry delay per peer (pure logic:
    the caller passes the clock, the open connections and the routing-table test)."""

    initial_peers: Sequence[str] = ()  # multiaddrs with /p2p/<peer id>, as given to `node join`
    base_delay: float = 20.0  # after a first failure, wait this long before trying that peer again
    max_delay: float = 300.0
    max_known: int = 256  # peers remembered from records; the least recently seen are forgotten
    forget_after: float = 1800.0  # a peer whose record we have not read for this long is forgotten
    _known: dict[str, tuple[list[str], float]] = field(default_factory=dict)  # peer -> (addrs, seen at)
    _retry: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (not before, delay)

    def remember(self, peer_id: str, addrs: Sequence[str], now: float) -> None:
        """A signed record of `peer_id` announced `addrs`: keep them for after it expires."""
        self._known.pop(peer_id, None)  # re-insert: the dict stays ordered by when a peer was seen
        self._known[peer_id] = (list(addrs), now)
        while len(self._known) > self.max_known:
            del self._known[next(iter(self._known))]

    def candidates(
        self,
        now: float,
        connected: Mapping[str, Sequence[str]],
        in_table: Callable[[str], bool],
        me: str,
        limit: int = 8,
        isolated: bool = False,
    ) -> list[tuple[str, list[str]]]:
        """Up to `limit` (peer id, addresses) to ping now: initial peers, then connected peers, then
        remembered ones (most recently seen first); never this peer, nor one in the routing table
        already, nor one whose retry delay runs (initial peers have none, nor has anyone when this
        peer is `isolated`: its routing table is empty)."""
        for peer_id in [p for p, (_, seen) in self._known.items() if now - seen > self.forget_after]:
            del self._known[peer_id]
        for peer_id in [p for p, (not_before, _) in self._retry.items() if now - not_before > self.max_delay]:
            del self._retry[peer_id]  # not tried for long (no longer a candidate): bounded
        ordered: dict[str, list[str]] = {}
        for maddr in self.initial_peers:
            peer_id = peer_id_of_maddr(maddr)
            if peer_id is not None:
                ordered.setdefault(peer_id, []).append(maddr)
        initial = set(ordered)
        for peer_id, addrs in connected.items():
            ordered.setdefault(peer_id, list(addrs))
        for peer_id, (addrs, _) in reversed(self._known.items()):
            ordered.setdefault(peer_id, addrs)
        chosen = []
        for peer_id, addrs in ordered.items():
            if peer_id == me or in_table(peer_id):
                continue
            if not isolated and peer_id not in initial and self._retry.get(peer_id, (0.0, 0.0))[0] > now:
                continue
            chosen.append((peer_id, addrs))
            if len(chosen) >= limit:
                break
        return chosen

    def failed(self, peer_id: str, now: float) -> None:
        """`peer_id` did not answer: try it again after twice the last delay (at most `max_delay`)."""
        _, delay = self._retry.get(peer_id, (0.0, 0.0))
        delay = min(self.max_delay, max(self.base_delay, 2 * delay))
        self._retry[peer_id] = (now + delay, delay)

    def answered(self, peer_id: str) -> None:
        """`peer_id` answered: no delay the next time we lose it."""
        self._retry.pop(peer_id, None)
