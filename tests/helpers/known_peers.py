"""The swarm as a test states it: node/p2p/swarm_peers.py's SwarmPeers, and Membership's `admit` for
the services that ask it (node/pipeline/check_server.py), without a swarm view or pings."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from node.p2p.membership import NOT_A_MEMBER


class KnownPeers:
    """`members` pass (their records and pings are taken as given; None: every peer), anyone else
    is refused with the node's words; `unreachable` no hop reaches; a ban for a failed hop lasts
    `ban_seconds` on `clock` (the ban store's own least, BanList's min_seconds, when longer)."""

    def __init__(
        self,
        members: Collection[str] | None = None,
        unreachable: Collection[str] = (),
        ban_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ):
        self.members, self._unreachable = members, set(unreachable)
        self.ban_seconds, self.clock = ban_seconds, clock

    def ban_until(self, peer_id: str) -> float:
        return self.clock() + self.ban_seconds

    def refusal(self, peer_id: str, stage: int | None = None) -> str | None:
        if self.members is None or peer_id in self.members:
            return None
        return f"{NOT_A_MEMBER}: no record of you here"

    async def admit(self, peer_id: str, stage: int | None = None, wait: float = 0.0) -> str | None:
        return self.refusal(peer_id, stage)

    def unreachable(self) -> set[str]:
        return set(self._unreachable)
