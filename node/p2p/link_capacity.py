"""How fast a direct link can carry bytes to its peer, as the kernel's TCP measures it.

Linux keeps, per TCP connection, a *delivery rate*: bytes the peer acknowledged over the time they
took, sampled on every ACK (`tcpi_delivery_rate` in `struct tcp_info`, Linux >= 4.9; what BBR
steers by). A pipeline hop leaves as one burst of 64-256 KiB, so even when the sender is idle
between hops (an "application-limited" sample) the rate of that burst is the path's bottleneck:
measured through this repository's namespace test bed, a 50 Mbit/s link read 47.8 Mbit/s with the
sender saturating it and 50.2 Mbit/s sending half that (docs/changes.md, deb3d0e). A sample taken
while the connection is still in slow start reads low, so the estimate waits for MIN_ACKED_BYTES to
be acknowledged, and it is the largest sample of the last HORIZON seconds (BBR's max filter): one
quiet gap between bursts does not make a fast link look slow. A link quiet for longer than TCP's
retransmission timeout restarts slow start (Linux's tcp_slow_start_after_idle) and reads low, at
17.5 Mbit/s for the same 50 Mbit/s link with a burst every 200 ms; it is quiet, so it matters little.

Only a direct link (node/p2p/direct.py) has a TCP socket of its own; a stream through p2pd is a unix
socket to the daemon, which says nothing about the path, and has no estimate.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h), stable since they were appended
_U64 = struct.Struct("=Q")
_BYTES_ACKED_AT, _DELIVERY_RATE_AT = 120, 160  # tcpi_bytes_acked, tcpi_delivery_rate
_TCP_INFO_SIZE = 168  # up to and including tcpi_delivery_rate
# bytes the peer must have acknowledged before a sample counts: slow start reads low until about
# then (at 100 ms round trips, ~1 s from a cold start), and a busy link crosses it in a few hops
MIN_ACKED_BYTES = 1 << 20
HORIZON = 10.0  # seconds a sample stays in the max filter


def _tcp_info(sock: Any) -> bytes | None:
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except (OSError, AttributeError):  # not Linux, or the socket just closed
        return None
    return info if len(info) >= _TCP_INFO_SIZE else None


class LinkCapacity:
    """The bytes/s one TCP connection's path carries: the largest delivery-rate sample of the last
    `horizon` seconds, sampled whenever it is asked. Owned by the channel that owns the socket."""

    def __init__(self, sock: Any, horizon: float = HORIZON, clock: Callable[[], float] = time.monotonic):
        self._sock, self._horizon, self._clock = sock, horizon, clock
        self._samples: deque[tuple[float, float]] = deque()  # (time, rate), rates decreasing

    @classmethod
    def of(cls, writer: Any) -> LinkCapacity | None:
        """The capacity of the TCP connection under a stream writer; None when it has none (p2pd)."""
        sock = writer.get_extra_info("socket")
        return cls(sock) if _tcp_info(sock) is not None else None

    def bytes_per_second(self) -> float | None:
        """The current estimate; None until the connection has carried MIN_ACKED_BYTES."""
        now = self._clock()
        info = _tcp_info(self._sock)
        if info is not None:
            acked = _U64.unpack_from(info, _BYTES_ACKED_AT)[0]
            rate = float(_U64.unpack_from(info, _DELIVERY_RATE_AT)[0])
            if acked >= MIN_ACKED_BYTES and rate > 0:
                self._add(now, rate)
        while self._samples and now - self._samples[0][0] > self._horizon:
            self._samples.popleft()
        return self._samples[0][1] if self._samples else None

    def _add(self, now: float, rate: float) -> None:
        # a monotonic queue: a sample hides every older, smaller one, so the head is the maximum
        while self._samples and self._samples[-1][1] <= rate:
            self._samples.pop()
        self._samples.append((now, rate))
