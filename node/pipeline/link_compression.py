"""Which encoding a pipeline hop's tensors take on the wire: the usual one, or a smaller one while the
usual one would keep this peer's uplink busy.

SWARM's authors train over links under 200 Mbit/s by pairing their pipelines with 8-bit compression
of what crosses the network (docs/algorithms.md, "SWARM: compressing what crosses a slow link").
Compressing every hop would cost precision where bandwidth is plentiful; never compressing caps a
pipeline behind a home uplink at the link's rate: at 50 Mbit/s, the default model's fp16 traffic is
at most 47.7 microbatches/s however fast the stages compute (docs/benchmarks.md, issue 16). So the
choice is made from measurements, per peer:

    load = sum over the links this peer sent a hop on lately of
           (payload in the usual encoding) x (hops per second on the link) / (the link's rate)

is the share of its links' capacity the usual encoding keeps busy at the pace the pipeline runs. A
peer's links share its uplink (a home connection's upload is the narrowest part of every path out
of it), so the shares add up. Above ENGAGE the hops go in `slow_link`; they return to `usual` below
RELEASE. The gap between the two, and a load counted in the usual encoding's bytes whatever is in
use, keep the choice from swinging: compressing a link-bound pipeline lets it run faster, which only
raises the load. A link's rate is what its TCP connection measures of the path
(node/p2p/link_capacity.py); a link without one (through p2pd) or not yet measured adds nothing.
No networking here: the link rates come in as a callable.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

from protocol import Compression, wire_nbytes

logger = logging.getLogger(__name__)

# share of the links' capacity the usual encoding would keep busy above which hops are compressed:
# past half, a burst waits behind the one before it and the link starts to set the pipeline's pace
ENGAGE = 0.5
RELEASE = 0.3  # ... and below which they go back to the usual encoding
RECENT = 2.0  # seconds since a link's last hop for it to count toward the load
INTERVAL_EMA = 0.1  # weight of a new interval between two hops on a link in its running mean
MAX_LINKS = 256  # links remembered (a peer talks to a few stages' peers at a time)


@dataclass
class LinkLoad:
    """What one link (peer, service) carried lately, in the usual encoding."""

    payload: int  # bytes of its last hop
    last: float  # monotonic time of its last hop
    interval: float | None = None  # running mean of the seconds between its hops
    rate: float | None = None  # bytes/s the link carries, as last measured


def uplink_load(links: Iterable[LinkLoad], now: float) -> float:
    """The share of their capacity the links that carried a hop within RECENT seconds are kept busy
    (their payload / interval / rate, summed); links lacking a figure add nothing."""
    return sum(
        link.payload / link.interval / link.rate
        for link in links
        if now - link.last <= RECENT and link.interval and link.rate
    )


def choose_compression(load: float, current: Compression, usual: Compression, slow_link: Compression) -> Compression:
    """`slow_link` once `load` passes ENGAGE, `usual` again once it falls below RELEASE."""
    if current == slow_link:
        return slow_link if load > RELEASE else usual
    return slow_link if load > ENGAGE else usual


class LinkCompression:
    """Chooses each hop's encoding from this peer's uplink load; logs when the choice changes."""

    def __init__(
        self,
        usual: Compression,
        slow_link: Compression,
        link_rate: Callable[[str, str], float | None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.usual, self.slow_link = usual, slow_link
        self.current = usual
        self._link_rate = link_rate  # bytes/s of the open link to (peer, service), if measured
        self._clock = clock
        self._links: OrderedDict[tuple[str, str], LinkLoad] = OrderedDict()

    def for_hop(self, peer_id: str, service: str, tensors: Mapping[str, Tensor]) -> Compression:
        if self.slow_link == self.usual:
            return self.usual
        now = self._clock()
        payload = sum(wire_nbytes(t, self.usual) for t in tensors.values())
        key = (peer_id, service)
        link = self._links.pop(key, None)
        if link is None:
            link = LinkLoad(payload, now)
        else:
            gap = now - link.last
            link.interval = gap if link.interval is None else (1 - INTERVAL_EMA) * link.interval + INTERVAL_EMA * gap
            link.payload, link.last = payload, now
        link.rate = self._link_rate(peer_id, service)
        self._links[key] = link  # the most recent last
        while len(self._links) > MAX_LINKS or (self._links and now - next(iter(self._links.values())).last > RECENT):
            self._links.popitem(last=False)
        load = uplink_load(self._links.values(), now)
        chosen = choose_compression(load, self.current, self.usual, self.slow_link)
        if chosen != self.current:
            rates = [link.rate for link in self._links.values() if link.rate]
            logger.info(
                f"pipeline hops in {chosen}: in {self.usual} they would keep this peer's links {load:.0%} busy "
                f"({len(rates)} measured, the slowest {8 * min(rates, default=0) / 1e6:.1f} Mbit/s)"
            )
            self.current = chosen
        return chosen
