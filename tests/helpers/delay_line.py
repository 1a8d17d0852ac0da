"""A userspace delay line for kernels without the ``netem`` qdisc (started by ``tests/helpers/netns.py``).

It runs as its own process inside the test bed's ``core`` router namespace and owns a TUN device there.
The core routes every packet to or from a shaped address into the TUN; this process reads the packet,
looks up the IPv4 source and destination in its table of shaped addresses, drops it with the combined
loss probability, holds it for the summed delay (plus jitter) and writes it back into the same TUN. The
core sends packets that come back out of the TUN (``ip rule iif <tun>``) by its real routes.

How shaping composes, per packet A -> B, when both A and B are in the table:

    hold = sample(A) + sample(B)        sample(X) = delay_X + jitter drawn for X (never below 0)
    P(drop) = 1 - (1 - loss_A) * (1 - loss_B)

so a round trip between A and B takes 2 * (delay_A + delay_B) plus jitter, as if each address sat behind
its own link with that one-way delay. Packets between the same two addresses leave in the order they
came in (a later packet never overtakes an earlier one), so jitter does not reorder TCP segments.

Control: one JSON object per line on stdin, answered by one line on stdout.

    {"op": "set", "addr": "10.77.1.2", "delay": 0.05, "jitter": 0.01, "loss": 0.2, "dist": "uniform"}
    {"op": "clear", "addr": "10.77.1.2"}
    {"op": "stats"}                      -> {"forwarded": n, "lost": n, "overflow": n, "queued": n}

``set`` and ``clear`` answer ``ok`` (with ``--offload``, a ``set`` with loss answers an error).

``--offload``: the TUN takes segmentation offload (``IFF_VNET_HDR`` and ``TUNSETOFFLOAD``), so the kernel
hands over a TCP burst as one super-packet of up to 64 KiB with a virtio-net header, the way a NIC with
TSO/GRO sees it, instead of ~45 packets of 1500 bytes, and the line writes it back the same way. TCP still
runs with its 1500-byte MSS at both ends; only the line's per-packet work shrinks (the userspace loop cost
0.3 of this machine's 2 cores under a 3 x 1 swarm at 50 Mbit/s without it, docs/changes.md). Loss is
refused in that mode: dropping a super-packet would drop a whole burst of segments, not one packet. End of stdin (the test bed closed the pipe, or died) ends the process,
so it never outlives its bed. Standard library only, started as a script: it must not import the project.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
# struct virtio_net_hdr without num_buffers: the TUN's default header size
VNET_HDR_LEN = 10
# a super-packet of 64 KiB plus its header
READ_SIZE = 65536 + VNET_HDR_LEN
# netem's default queue is 1000 packets; 20000 holds 0.5 s of a 400 Mbit/s stream, far above what a
# Python loop forwards, so the limit only guards memory if the kernel outruns us
QUEUE_LIMIT = 20000
# bounded batches keep release deadlines honest while a burst is being read
READ_BATCH = 256


class Link:
    """The shaping of one address: one-way delay and jitter in seconds, loss probability."""

    __slots__ = ("delay", "dist", "jitter", "loss")

    def __init__(self, delay: float, jitter: float, loss: float, dist: str) -> None:
        self.delay = delay
        self.jitter = jitter
        self.loss = loss
        self.dist = dist

    def sample(self, rng: random.Random) -> float:
        if not self.jitter:
            return self.delay
        if self.dist == "normal":
            return max(0.0, rng.gauss(self.delay, self.jitter))
        return max(0.0, self.delay + rng.uniform(-self.jitter, self.jitter))


def open_tun(name: str, offload: bool = False) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    if offload:
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    os.set_blocking(fd, False)
    return fd


class DelayLine:
    def __init__(self, tun_fd: int, seed: int | None, offload: bool = False) -> None:
        self.fd = tun_fd
        self.offload = offload
        # where the IPv4 header starts in what the TUN reads: after the virtio-net header with offload
        self.ip_at = VNET_HDR_LEN if offload else 0
        self.rng = random.Random(seed)
        self.links: dict[bytes, Link] = {}
        self.heap: list[tuple[float, int, bytes]] = []
        self.seq = 0
        # last release time per (src, dst): keeps each pair in order under jitter
        self.last: dict[bytes, float] = {}
        self.stats = {"forwarded": 0, "lost": 0, "overflow": 0}

    def control(self, line: str) -> str:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "set":
            key = socket.inet_aton(msg["addr"])
            if self.offload and float(msg.get("loss", 0)):
                return "error loss needs a delay line without offload"
            link = Link(
                float(msg.get("delay", 0)),
                float(msg.get("jitter", 0)),
                float(msg.get("loss", 0)),
                msg.get("dist", "uniform"),
            )
            self.links[key] = link
            return "ok"
        if op == "clear":
            self.links.pop(socket.inet_aton(msg["addr"]), None)
            return "ok"
        if op == "stats":
            return json.dumps({**self.stats, "queued": len(self.heap)})
        return "error unknown op"

    def take(self, pkt: bytes, now: float) -> None:
        # anything but IPv4 (an IPv6 router solicitation, a runt) is not ours to forward
        at = self.ip_at
        if len(pkt) < at + 20 or pkt[at] >> 4 != 4:
            return
        pair = pkt[at + 12 : at + 20]
        a = self.links.get(pair[:4])
        b = self.links.get(pair[4:])
        hold = 0.0
        keep = 1.0
        rng = self.rng
        if a is not None:
            hold += a.sample(rng)
            keep *= 1.0 - a.loss
        if b is not None:
            hold += b.sample(rng)
            keep *= 1.0 - b.loss
        if keep < 1.0 and rng.random() >= keep:
            self.stats["lost"] += 1
            return
        due = now + hold
        prev = self.last.get(pair)
        if prev is not None and prev > due:
            due = prev
        self.last[pair] = due
        if due <= now and not self.heap:
            self.emit(pkt)
            return
        if len(self.heap) >= QUEUE_LIMIT:
            self.stats["overflow"] += 1
            return
        self.seq += 1
        heapq.heappush(self.heap, (due, self.seq, pkt))

    def emit(self, pkt: bytes) -> None:
        try:
            os.write(self.fd, pkt)
            self.stats["forwarded"] += 1
        except OSError:
            # the kernel refused it (queue full, device going away): a lost packet, as on a real link
            self.stats["overflow"] += 1

    def release(self, now: float) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            self.emit(heapq.heappop(heap)[2])

    def run(self, ctl_in, ctl_out) -> None:
        ctl_fd = ctl_in.fileno()
        buf = b""
        while True:
            timeout = None
            if self.heap:
                timeout = max(0.0, self.heap[0][0] - time.monotonic())
            readable, _, _ = select.select([self.fd, ctl_fd], [], [], timeout)
            if self.fd in readable:
                now = time.monotonic()
                for _ in range(READ_BATCH):
                    try:
                        pkt = os.read(self.fd, READ_SIZE)
                    except BlockingIOError:
                        break
                    self.take(pkt, now)
            if ctl_fd in readable:
                chunk = os.read(ctl_fd, 65536)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        ctl_out.write(self.control(line.decode()) + "\n")
                        ctl_out.flush()
            self.release(time.monotonic())


class DelayLineClient:
    """The test bed's end: starts a delay line in a namespace, which creates the TUN ``tun`` there."""

    def __init__(
        self, ns: str, tun: str, *, seed: int | None = None, offload: bool = False, timeout: float = 10.0
    ) -> None:
        argv = [sys.executable, "-u", os.path.abspath(__file__), "--tun", tun]
        if seed is not None:
            argv += ["--seed", str(seed)]
        if offload:
            argv.append("--offload")
        # its own session: a Ctrl-C meant for pytest must not kill it before the bed has cleaned up
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        self._buf = b""
        try:
            if self._read(timeout) != "ready":
                raise RuntimeError("delay line did not start")
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> str:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError("delay line did not answer")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"delay line exited with {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def call(self, msg: dict, timeout: float = 5.0) -> str:
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def set(self, addr: str, delay: float, jitter: float = 0.0, loss: float = 0.0, dist: str = "uniform") -> None:
        """Shape one address (seconds, probability); effective once this returns."""
        msg = {"op": "set", "addr": addr, "delay": delay, "jitter": jitter, "loss": loss, "dist": dist}
        if self.call(msg) != "ok":
            raise RuntimeError(f"delay line refused {msg}")

    def clear(self, addr: str) -> None:
        self.call({"op": "clear", "addr": addr})

    def stats(self) -> dict[str, int]:
        return json.loads(self.call({"op": "stats"}))

    def close(self) -> None:
        """End of stdin ends the delay line (its TUN and the routes through it go with it)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tun", required=True, help="name of the TUN device to create in this namespace")
    parser.add_argument("--seed", type=int, default=None, help="seed for loss and jitter draws")
    parser.add_argument("--offload", action="store_true", help="take TCP super-packets (no loss then)")
    args = parser.parse_args(argv)
    # a SIGTERM from the bed's cleanup ends the loop the same way end of stdin does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd = open_tun(args.tun, args.offload)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        DelayLine(fd, args.seed, args.offload).run(sys.stdin, sys.stdout)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
