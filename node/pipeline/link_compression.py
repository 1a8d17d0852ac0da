"""Which encoding a pipeline hop's tensors take on the wire: the usual one, or a smaller one while the
usual one would keep this peer's uplink busy.

SWARM's authors train over links under 200 Mbit/s by pairing their pipelines with 8-bit compression
of what crosses the network (docs/algorithms.md, "SWARM: compressing what crosses a slow link").
Compressing every hop would cost precision where bandwidth is plentiful; never compressing caps a
pipeline behind a home uplink at the link's rate: at 50 Mbit/s, the default model's fp16 traffic is
at most 47.7 microbatches/s however fast the stages compute (docs/benchmarks.md, "Over 100 ms RTT / 50 Mbit/s"). So the
choice is made from measurements, per peer:

    load = (bytes/s the usual encoding sends over the links used in the last RECENT seconds)
           / (the slowest of those links' measured rates)

A peer's links share its uplink, a home connection's narrowest part, so what they carry adds up,
and the slowest link's reading is the closest to that uplink's sustained rate (a faster reading is
a burst a token-bucket shaper let through, or a path that bypasses the uplink). Above ENGAGE the
hops go in `slow_link` once the load has stayed there for SUSTAIN seconds; they return to `usual`
once it has stayed below RELEASE as long.

While compressed, the links' rates are not read again: small bursts fit in a shaper's bucket and
cross at line rate, so an int8 hop's reading says little about what fp16 would get (measured on a
50 Mbit/s namespace link, docs/changes.md). The load is still counted in the usual encoding's
bytes at the pace the pipeline runs, so compressing a link-bound pipeline, which then runs faster,
keeps it compressed rather than swinging back. After a hold in `slow_link` (HOLDS) the usual encoding
is tried again, to find a path that got faster; a still-slow one goes back to `slow_link` after
SUSTAIN_AFTER_PROBE instead of SUSTAIN, and the next hold is twice as long. A link's rate is what
its TCP connection measures (node/p2p/link_capacity.py); a link without one (through p2pd) or not
yet measured adds its bytes but no rate. No networking here: the rates come in as a callable.
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

# load (the share of the uplink the usual encoding keeps busy) above which hops are compressed:
# past half, a burst often waits behind the one before it and the link starts to set the pace
ENGAGE = 0.5
RELEASE = 0.3  # ... and below which they go back to the usual encoding
RECENT = 2.0  # seconds since a link's last hop for it to count toward the load
INTERVAL_EMA = 0.1  # weight of a new interval between two hops on a link in its running mean
# seconds the load must stay past ENGAGE (or under RELEASE) before the encoding changes: a start-up
# burst of hops into links still in slow start, or a receiver too busy to read, looks like a slow
# link for a moment, and a link that just came back has no pace yet
SUSTAIN = 5.0
# ... except back into `slow_link` right after a probe (within REPROBE_WINDOW): the link was slow a
# hold ago, its connection is warm, and each second of the probe is a second of the usual encoding
# on a link it fills (in a wide-area run the probes, 5 s each, took a quarter of a 60 s window)
SUSTAIN_AFTER_PROBE = 1.0
# seconds compressed before the usual encoding is measured again: the first hold, doubled each time
# the links prove still slow (compressed again within REPROBE_WINDOW of a probe), up to the last
HOLDS = (30.0, 60.0, 120.0, 300.0)
REPROBE_WINDOW = 30.0
MAX_LINKS = 256  # links remembered (a peer talks to a few stages' peers at a time)
# seconds between two reads of one link's rate, and between two decisions on the load: a hop costs
# ~1 ms of event-loop CPU, and reading TCP_INFO, summing the links and choosing on every one of
# them was ~5 % of a block stage's loop (py-spy, docs/changes.md), for a choice that waits
# SUSTAIN seconds before it changes anything
REFRESH = 0.1


@dataclass
class LinkLoad:
    """What one link (peer, service) carried lately, in the usual encoding."""

    payload: int  # bytes of its last hop
    last: float  # monotonic time of its last hop
    interval: float | None = None  # running mean of the seconds between its hops
    rate: float | None = None  # bytes/s the link carries, as last measured in the usual encoding
    rate_read: float = float("-inf")  # monotonic time `rate` was last read


def uplink_load(links: Iterable[LinkLoad], now: float) -> float:
    """The share of the uplink kept busy by the links that carried a hop within RECENT seconds: their
    bytes/s (payload / interval) over the slowest rate among them; 0 while none is measured."""
    recent = [link for link in links if now - link.last <= RECENT]
    rates = [link.rate for link in recent if link.rate]
    if not rates:
        return 0.0
    return sum(link.payload / link.interval for link in recent if link.interval) / min(rates)


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
        self._since = clock()  # when `current` was chosen
        self._differs_since: float | None = None  # since when the load has called for the other encoding
        self._hold = 0  # index into HOLDS of the current hold
        self._probed: float | None = None  # when the usual encoding was last tried again after a hold
        self._decided = float("-inf")  # when the load was last weighed
        self._links: OrderedDict[tuple[str, str], LinkLoad] = OrderedDict()

    def for_hop(self, peer_id: str, service: str, tensors: Mapping[str, Tensor]) -> Compression:
        if self.slow_link == self.usual:
            return self.usual
        now = self._clock()
        if self.current == self.slow_link and now - self._since > HOLDS[self._hold]:
            self._probed = now
            self._switch(self.usual, now, f"after {HOLDS[self._hold]:.0f} s, measuring the links again")
        self._record(peer_id, service, sum(wire_nbytes(t, self.usual) for t in tensors.values()), now)
        if now - self._decided < REFRESH:
            return self.current
        self._decided = now
        load = uplink_load(self._links.values(), now)
        chosen = choose_compression(load, self.current, self.usual, self.slow_link)
        if chosen == self.current:
            self._differs_since = None
            return self.current
        self._differs_since = now if self._differs_since is None else self._differs_since
        reprobed = chosen == self.slow_link and self._probed is not None and now - self._probed < REPROBE_WINDOW
        if now - self._differs_since < (SUSTAIN_AFTER_PROBE if reprobed else SUSTAIN):
            return self.current
        if chosen == self.slow_link:  # still slow right after a probe: hold longer next time
            self._hold = min(self._hold + 1, len(HOLDS) - 1) if reprobed else 0
        rates = [link.rate for link in self._links.values() if link.rate]
        slowest = f"the slowest of {len(rates)} at {8 * min(rates) / 1e6:.1f} Mbit/s" if rates else "none measured"
        self._switch(chosen, now, f"in {self.usual} they would keep this peer's links {load:.0%} busy ({slowest})")
        return self.current

    def _record(self, peer_id: str, service: str, payload: int, now: float) -> None:
        key = (peer_id, service)
        link = self._links.pop(key, None)
        if link is None or now - link.last > RECENT:  # new, or quiet for long: its old pace is gone
            link = LinkLoad(payload, now)
        else:
            gap = now - link.last
            link.interval = gap if link.interval is None else (1 - INTERVAL_EMA) * link.interval + INTERVAL_EMA * gap
            link.payload, link.last = payload, now
        # compressed hops' bursts say little (above)
        if (self.current == self.usual or link.rate is None) and now - link.rate_read >= REFRESH:
            link.rate, link.rate_read = self._link_rate(peer_id, service), now
        self._links[key] = link  # the most recent last
        while len(self._links) > MAX_LINKS or now - next(iter(self._links.values())).last > RECENT:
            self._links.popitem(last=False)

    def _switch(self, chosen: Compression, now: float, why: str) -> None:
        logger.info(f"pipeline hops in {chosen}: {why}")
        self.current, self._since, self._differs_since = chosen, now, None
