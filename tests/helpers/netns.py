"""A multi-host test bed made of Linux network namespaces: real processes on a small, shapeable internet.

Topology (every name below is a namespace; NN = the site's index 1..254, K = host on that LAN 0..)::

    public host "a"   10.77.NN.2/24 eth0 ──veth── sNN 10.77.NN.1/24 ┐
    public host "b"   10.77.MM.2/24 eth0 ──veth── sMM 10.77.MM.1/24 ┤ core: a router (IPv4 forwarding,
    LAN router "home" 10.77.LL.2/24 wan  ──veth── sLL 10.77.LL.1/24 ┘ not a bridge) with no route into
       │ bridge "lan" 10.78.LL.1/24, masquerade out of wan,           10.78.0.0/16, so LAN hosts are
       │ drops NEW connections coming in on wan (no port forwards)    reachable only from inside
       ├── pK ──veth── eth0 10.78.LL.(K+2)/24  home host "h1"
       └── ...                                  home host "h2" (when several hosts share lan=)

Public hosts and LAN routers are *sites*, each with one veth link to the core; a home host's own link is
its veth to the LAN bridge. Only 10.77/16 and 10.78/16 are used, only inside the bed's namespaces (the
root namespace is never touched). IPv6 is off in every namespace, so a peer has exactly one address to
see and advertise; loopback is up everywhere.

``shape(name, ...)`` sets the whole shaping of a node. Rate is a ``tbf`` on both ends of the node's own
link (upload and download). Delay, jitter and loss belong to a site link (a home host's are its LAN's, so
its LAN must not be shared: shape a shared LAN by its name) and apply per direction: a packet from A to B
waits delay(A) + delay(B) and is lost with 1 - (1-loss(A))(1-loss(B)), so two sites at 50 ms each have a
200 ms round trip. This is netem on both ends of the link where the kernel has netem, else the userspace
``delay_line.py``: a TUN in the core into which policy routing sends every packet to or from a shaped site.

``cut(name)`` silently drops everything to and from a node (senders see timeouts, never errors: a
partition); ``cut_between(a, b)`` only the traffic between two nodes; ``heal``/``heal_between`` undo them.

``popen(host, argv)`` runs a process in a host (``ip netns exec``). ``close()`` (also by ``__exit__`` and at
interpreter exit) kills those and anything else in the bed's namespaces, then deletes them. Names carry
the creator's pid (``ps<pid>x<n>-``), so ``sweep_stale()`` removes what a killed run left behind and never
a parallel run's bed. Needs root, iproute2, and nftables for home hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .delay_line import DelayLineClient

_FAMILY = re.compile(r"^ps(\d+)x(\d+)-")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
_beds = itertools.count()
_DELAY_TUN = "dl0"
_REAL_TABLE = "100"  # the core's routes to sites, for packets coming back out of the delay line
_DELAY_TABLE = "200"  # default route into the delay line
_PRIO_CUT, _PRIO_REAL, _PRIO_DELAY = "50", "100", "200"
_NETEM: list[bool] = []


# empties the conntrack table of the namespace it runs in (standard library only: no conntrack
# tool needed): a netlink IPCTNL_MSG_CT_DELETE with no attributes, as `conntrack -F` sends
_FLUSH_CONNTRACK = r"""
import socket, struct
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
header = struct.pack("=LHHLL", 16 + 4, (1 << 8) | 2, 1 | 4, 1, 0)  # ctnetlink DELETE, REQUEST|ACK
s.send(header + struct.pack("=BBH", socket.AF_INET, 0, 0))
reply = s.recv(4096)
error = struct.unpack_from("=i", reply, 16)[0]
assert error == 0, f"conntrack flush failed: errno {-error}"
"""

# the opening of every TCP probe server run in a host (standard library only, for `python -S -c`):
# `srv` listens on argv[1] on every address, and says "ready" once it does
TCP_LISTEN = r"""
import socket, sys, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(64)
print("ready", flush=True)
"""

# a TCP sink: counts each connection's bytes until the sender shuts down its side, and answers the
# count (a sender that closed instead gets nothing, and the sink goes on)
TCP_SINK = (
    TCP_LISTEN
    + r"""
while True:
    conn, _ = srv.accept()
    got = 0
    while data := conn.recv(1 << 16):
        got += len(data)
    try:
        conn.sendall(str(got).encode())
    except OSError:
        pass
    conn.close()
"""
)


def _run(argv: list[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip(ns: str, *commands: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip`` commands ("link set lo up", ...) in one namespace, in one process (``ip -batch``)."""
    return _run(["ip", "-n", ns, "-batch", "-"], input="\n".join(commands) + "\n", check=check)


def _tc(ns: str, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["tc", "-n", ns, *command.split()], check=check)


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _signal(pid: int, sig: int) -> bool:
    """Send a signal; False when the process does not exist (any more)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kill_namespace_pids(namespaces: list[str], grace: float) -> None:
    """SIGTERM every process in the namespaces, SIGKILL whatever is still there after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        for pid in pids:
            _signal(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for ns in namespaces for p in _netns_pids(ns)]
            time.sleep(0.05)
        if not pids:
            return


@functools.cache
def namespaces_supported() -> tuple[bool, str]:
    """Whether this process can build a test bed; when not, the reason (for ``pytest.skip``)."""
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed (Debian package iproute2)"
    # named like a bed so sweep_stale() removes it if we die between add and del
    probe = f"ps{os.getpid()}x{next(_beds)}-probe"
    added = _run(["ip", "netns", "add", probe], check=False)
    if added.returncode != 0:
        hint = "" if os.geteuid() == 0 else " (not root)"
        return False, f"`ip netns add` failed{hint}: {added.stderr.strip()}"
    try:
        veth = _ip(probe, "link add probe0 type veth peer name probe1", check=False)
        if veth.returncode != 0:
            return False, f"cannot create a veth pair in a namespace: {veth.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def nat_supported() -> tuple[bool, str]:
    """Whether home hosts (NAT routers, made with nftables) can be built here; when not, the reason."""
    ok = shutil.which("nft") is not None
    return ok, "" if ok else "`nft` is not installed (Debian package nftables); home hosts need it"


def require_namespaces(nat: bool = True) -> None:
    """Skip the calling test where a test bed cannot be built here, or (with `nat`) its home hosts."""
    import pytest  # the benchmarks build test beds too, without pytest

    for supported, why in (namespaces_supported(), *([nat_supported()] if nat else [])):
        if not supported:
            pytest.skip(why)


def sweep_stale() -> list[str]:
    """Delete namespaces (and kill their processes) left by test beds whose creating process is dead."""
    stale = []
    for ns in _netns_list():
        m = _FAMILY.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _signal(int(m.group(1)), 0):
            stale.append(ns)
    if stale:
        _kill_namespace_pids(stale, grace=1.0)
        for ns in stale:
            _run(["ip", "netns", "del", ns], check=False)
    return stale


@dataclass
class _Node:
    name: str
    kind: str  # "public" | "lan" | "home"
    ns: str  # where its own address lives (a LAN's is its router)
    addr: str
    link: tuple[str, str, str, str]  # (inner ns, inner dev, outer ns, outer dev) of its own veth
    index: int = 0  # site index: 10.77.index.0/24 and, for a LAN, 10.78.index.0/24
    lan: _Node | None = None  # a home host's LAN
    members: list[str] = field(default_factory=list)  # a LAN's hosts
    rate_mbit: float | None = None
    impair: tuple[float, float, float, str] | None = None  # a site's delay_ms, jitter_ms, loss, jitter_dist
    delayed: bool = False  # its address is routed through the delay line


class TestBed:
    """A private internet of namespaces; see the module docstring. Use as a context manager."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self, *, netem: bool | None = None, grace: float = 3.0, seed: int | None = None, offload: bool = False
    ) -> None:
        """``netem``: None picks netem when the kernel has it; False forces the userspace delay line.
        ``grace``: seconds between SIGTERM and SIGKILL at close. ``seed``: loss/jitter draws of the delay line.
        ``offload``: the delay line takes TCP super-packets (delay_line.py, ``--offload``): far less of its
        CPU per byte, for benchmarks; loss is refused then."""
        sweep_stale()
        self.prefix = f"ps{os.getpid()}x{next(_beds)}-"
        self.core = self.prefix + "core"
        self._grace = grace
        self._seed = seed
        self._offload = offload
        self._netem = netem
        self._nodes: dict[str, _Node] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._rules: set[tuple[str, ...]] = set()
        self._cut_hosts: set[str] = set()
        self._line: DelayLineClient | None = None
        self._next_site = 1
        self._closed = False
        atexit.register(self.close)
        try:
            self._add_ns(self.core, router=True)
            # a packet back from the delay line with no real route must die here, not loop into it again
            _ip(self.core, f"route add unreachable default table {_REAL_TABLE}")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str, *, router: bool = False) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        values = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
        if router:
            # packets from the delay line arrive on the TUN with a source routed via a veth: strict
            # reverse-path filtering would drop them
            values |= {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0"}
            values |= {"net.ipv4.conf.default.rp_filter": "0"}
        # /proc/sys/net shows the reader's namespace, so a shell inside the namespace sets its own values
        script = "; ".join(f"echo {v} > /proc/sys/{k.replace('.', '/')}" for k, v in values.items())
        _run(["ip", "netns", "exec", ns, "sh", "-c", script])
        _ip(ns, "link set lo up")

    def _new_name(self, name: str) -> None:
        if not _NAME.match(name) or name == "core":
            raise ValueError(f"bad node name {name!r}: letters, digits, _ and -, at most 32, not 'core'")
        if name in self._nodes:
            raise ValueError(f"{name!r} already exists in this bed")

    def _add_site(self, name: str, ns: str, inner_dev: str, kind: str) -> _Node:
        """Cable ``ns`` to the core: a veth pair and a /24 of 10.77.0.0/16 of its own."""
        if self._next_site > 254:
            raise RuntimeError("a bed holds at most 254 sites (public hosts plus LANs)")
        i, self._next_site = self._next_site, self._next_site + 1
        outer, addr, gw = f"s{i}", f"10.77.{i}.2", f"10.77.{i}.1"
        _ip(
            self.core,
            f"link add {outer} type veth peer name {inner_dev} netns {ns}",
            f"addr add {gw}/24 dev {outer}",
            f"link set {outer} up",
            f"route add 10.77.{i}.0/24 dev {outer} table {_REAL_TABLE}",
        )
        _ip(ns, f"addr add {addr}/24 dev {inner_dev}", f"link set {inner_dev} up", f"route add default via {gw}")
        node = _Node(name, kind, ns, addr, (ns, inner_dev, self.core, outer), index=i)
        self._nodes[name] = node
        return node

    def add_public_host(self, name: str) -> str:
        """A host with a public address, directly on the core. Returns its address."""
        self._new_name(name)
        ns = self.prefix + "h-" + name
        self._add_ns(ns)
        return self._add_site(name, ns, "eth0", "public").addr

    def add_home_host(self, name: str, *, lan: str | None = None, symmetric: bool = False) -> str:
        """A host on a home LAN behind a NAT router (outbound only). Hosts given the same ``lan`` name share
        one router and one LAN; ``lan=None`` gives the host a router of its own (named ``<name>-lan``).
        The router keeps a connection's source port where it can (a plain masquerade, as most home
        routers: hole punching works through it), or, ``symmetric``, picks a random one for every
        connection (``masquerade random,fully-random``: it defeats hole punching). Returns the host's
        (private) address."""
        ok, why = nat_supported()
        if not ok:
            raise RuntimeError(why)
        self._new_name(name)
        lan = lan or f"{name}-lan"
        router = self._nodes.get(lan) or self._add_lan(lan, symmetric)
        if router.kind != "lan":
            raise ValueError(f"{lan!r} is a host, not a LAN")
        ns = self.prefix + "h-" + name
        self._add_ns(ns)
        k = len(router.members)
        if k > 250:
            raise RuntimeError(f"LAN {lan!r} is full")
        port, addr, gw = f"p{k}", f"10.78.{router.index}.{k + 2}", f"10.78.{router.index}.1"
        _ip(router.ns, f"link add {port} type veth peer name eth0 netns {ns}", f"link set {port} master lan up")
        _ip(ns, f"addr add {addr}/24 dev eth0", "link set eth0 up", f"route add default via {gw}")
        router.members.append(name)
        self._nodes[name] = _Node(name, "home", ns, addr, (ns, "eth0", router.ns, port), lan=router)
        return addr

    def _add_lan(self, name: str, symmetric: bool = False) -> _Node:
        self._new_name(name)
        ns = self.prefix + "r-" + name
        self._add_ns(ns, router=True)
        node = self._add_site(name, ns, "wan", "lan")
        _ip(ns, "link add lan type bridge", f"addr add 10.78.{node.index}.1/24 dev lan", "link set lan up")
        # a home router: masquerade out, nothing in unless it answers a connection made from inside. The
        # bridge table drops cut hosts' IPv4 frames but lets ARP pass, so LAN neighbours see a silent
        # partition too, not the "no route to host" of a failed neighbour lookup
        ruleset = """
        table ip home {
            chain postrouting { type nat hook postrouting priority srcnat; oifname "wan" masquerade MASQUERADE_FLAGS; }
            chain forward { type filter hook forward priority filter;
                iifname "wan" ct state established,related accept; iifname "wan" drop; }
            chain input { type filter hook input priority filter;
                iifname "wan" ct state established,related accept; iifname "wan" drop; }
        }
        table bridge home {
            set cut { type ifname; }
            chain forward { type filter hook forward priority filter;
                iifname @cut ether type ip drop; oifname @cut ether type ip drop; }
            chain input { type filter hook input priority filter; iifname @cut ether type ip drop; }
        }
        """
        ruleset = ruleset.replace("MASQUERADE_FLAGS", "random,fully-random" if symmetric else "")
        _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=ruleset)
        return node

    def flush_nat(self, lan: str) -> None:
        """Forget every connection a home router tracks, as a router's restart does: its NAT mappings
        are gone, and packets of connections made before are dropped as new ones coming in."""
        node = self._node(lan)
        if node.kind != "lan":
            raise ValueError(f"{lan!r} is not a home LAN's router")
        _run(["ip", "netns", "exec", node.ns, sys.executable, "-S", "-c", _FLUSH_CONNTRACK])

    def _node(self, name: str) -> _Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no host or LAN {name!r} in this bed") from None

    def address(self, host: str) -> str:
        """The IPv4 address of a host's own interface (private 10.78.x.y for a home host)."""
        return self._node(host).addr

    def public_address(self, name: str) -> str:
        """The address the internet sees for a host or LAN: a home host's is its router's WAN address."""
        node = self._node(name)
        return node.lan.addr if node.lan else node.addr

    def netns(self, name: str) -> str:
        """The namespace of a host, of a LAN's router, or (``"core"``) of the core router."""
        return self.core if name == "core" else self._node(name).ns

    def launcher(self, name: str) -> list[str]:
        """The command prefix that runs a program inside a host (for `Swarm.spawn(launcher=...)`)."""
        return ["ip", "netns", "exec", self.netns(name)]

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside a host's (or router's) namespace; close() kills it. Takes Popen's kwargs;
        each process gets its own session unless told otherwise, so close() can kill its whole group."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns(host), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a host to completion (text output captured); raises TimeoutExpired after killing it."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # a daemon it left may hold the pipes open
                proc.communicate(timeout=2)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    @staticmethod
    def _kill_group(proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                (os.killpg if os.getpgid(proc.pid) == proc.pid else os.kill)(proc.pid, sig)

    def shape(
        self,
        name: str,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        rate_mbit: float | None = None,
        jitter_dist: str = "uniform",
    ) -> None:
        """Set (replace) the shaping of a host's or LAN's link; ``shape(name)`` alone removes it. ``delay_ms``
        and ``jitter_ms`` are one-way, per direction; ``loss`` is a probability 0..1 per packet and direction;
        ``jitter_dist`` is "uniform" (delay ± jitter) or "normal" (sigma = jitter)."""
        node = self._node(name)
        if delay_ms < 0 or jitter_ms < 0 or not 0 <= loss <= 1 or (rate_mbit is not None and rate_mbit <= 0):
            raise ValueError("delay and jitter must be >= 0, loss in [0, 1], rate > 0")
        if jitter_dist not in ("uniform", "normal"):
            raise ValueError("jitter_dist is 'uniform' or 'normal'")
        if loss and self._offload:
            raise ValueError("a bed made with offload=True shapes no loss: it would drop whole TCP bursts")
        impair = (delay_ms, jitter_ms, loss, jitter_dist) if (delay_ms or jitter_ms or loss) else None
        site = node.lan or node
        if node.lan is not None and len(node.lan.members) > 1 and impair is not None:
            raise ValueError(f"{name!r} shares LAN {node.lan.name!r}: delay and loss are the LAN's, shape the LAN")
        node.rate_mbit = rate_mbit
        if node.lan is None or len(node.lan.members) == 1:
            site.impair = impair
        if self._netem is None:
            if not _NETEM:  # whether the kernel has netem, asked once on the core's unused loopback
                _NETEM.append(_tc(self.core, "qdisc add dev lo root netem delay 1ms", check=False).returncode == 0)
                _tc(self.core, "qdisc del dev lo root", check=False)
            self._netem = _NETEM[0]
        self._qdiscs(node)
        if self._netem and site is not node:
            self._qdiscs(site)
        elif not self._netem:
            self._delay_line_apply(site)

    def _qdiscs(self, node: _Node) -> None:
        """Rebuild the root qdisc at both ends of a node's veth: netem (sites, netem mode) above tbf."""
        inner_ns, inner_dev, outer_ns, outer_dev = node.link
        imp = node.impair if (node.kind != "home" and self._netem) else None
        for ns, dev in ((inner_ns, inner_dev), (outer_ns, outer_dev)):
            _tc(ns, f"qdisc del dev {dev} root", check=False)
            parent = "root"
            if imp is not None:
                delay, jitter, loss, dist = imp
                spread = (f"{jitter}ms" + (" distribution normal" if dist == "normal" else "")) if jitter else ""
                netem = f"netem delay {delay}ms {spread} loss {loss * 100}% limit 10000"
                _tc(ns, f"qdisc add dev {dev} root handle 1: {netem}")
                parent = "parent 1:1"
            if node.rate_mbit is not None:
                # a burst of ~10 ms of the rate (never under 16 KiB, so a full-size GSO segment always fits)
                # and 100 ms of queue, a modest home router buffer
                burst = max(16384, int(node.rate_mbit * 1e6 / 8 / 100))
                _tc(ns, f"qdisc add dev {dev} {parent} tbf rate {node.rate_mbit}mbit burst {burst} latency 100ms")

    def _delay_line_apply(self, site: _Node) -> None:
        imp = site.impair
        if imp is not None:
            if self._line is None:
                self._line = DelayLineClient(self.core, _DELAY_TUN, seed=self._seed, offload=self._offload)
                _ip(
                    self.core,
                    f"link set {_DELAY_TUN} up",
                    f"route add default dev {_DELAY_TUN} table {_DELAY_TABLE}",
                    f"rule add iif {_DELAY_TUN} lookup {_REAL_TABLE} prio {_PRIO_REAL}",
                )
            delay, jitter, loss, dist = imp
            # the parameters first, then the routes: no packet meets the line before it knows the address
            self._line.set(site.addr, delay / 1000, jitter / 1000, loss, dist)
        if (imp is not None) != site.delayed:
            verb, site.delayed = ("add" if imp else "del"), imp is not None
            _ip(
                self.core,
                *(f"rule {verb} {d} {site.addr} lookup {_DELAY_TABLE} prio {_PRIO_DELAY}" for d in ("from", "to")),
            )
        if imp is None and self._line is not None:
            self._line.clear(site.addr)

    def delay_line_stats(self) -> dict[str, int]:
        """Counters of the delay line (forwarded, lost, overflow, queued); empty when none runs."""
        return self._line.stats() if self._line else {}

    def delay_line_pid(self) -> int | None:
        """The delay line's process (``ip netns exec`` execs in place), for its CPU cost; None when none runs."""
        return self._line.proc.pid if self._line else None

    def _gateway(self, node: _Node) -> str:
        """The namespace that routes a node's traffic while it still carries the node's own address."""
        return node.lan.ns if node.lan else self.core

    def _rule(self, ns: str, add: bool, src: str | None, dst: str | None) -> None:
        key = (ns, src or "", dst or "")
        if add == (key in self._rules):
            return
        spec = (f"from {src} " if src else "") + (f"to {dst} " if dst else "")
        _ip(ns, f"rule {'add' if add else 'del'} {spec}blackhole prio {_PRIO_CUT}")
        (self._rules.add if add else self._rules.discard)(key)

    def cut(self, name: str) -> None:
        """Drop every packet to and from a host or LAN, silently (the LAN's hosts still reach each other)."""
        self._cut(self._node(name), True)

    def heal(self, name: str) -> None:
        """Undo ``cut(name)``."""
        self._cut(self._node(name), False)

    def _cut(self, node: _Node, add: bool) -> None:
        gw = self._gateway(node)
        self._rule(gw, add, node.addr, None)
        self._rule(gw, add, None, node.addr)
        if node.lan is not None and add != (node.name in self._cut_hosts):
            # its LAN neighbours reach it through the bridge, which routing rules never see
            verb, port = ("add" if add else "delete"), node.link[3]
            _run(["ip", "netns", "exec", node.lan.ns, "nft", verb, "element", "bridge", "home", "cut", f"{{ {port} }}"])
            (self._cut_hosts.add if add else self._cut_hosts.discard)(node.name)

    def cut_between(self, a: str, b: str) -> None:
        """Drop traffic between two nodes (either may be a host or a LAN) while both reach everyone else."""
        self._between(a, b, True)

    def heal_between(self, a: str, b: str) -> None:
        """Undo ``cut_between(a, b)``."""
        self._between(a, b, False)

    def _between(self, a: str, b: str, add: bool) -> None:
        na, nb = self._node(a), self._node(b)
        if (na.lan or na) is (nb.lan or nb):
            raise ValueError(f"{a!r} and {b!r} are on the same LAN: their traffic never leaves it")
        # at each end, where its own address is still on the packet; the far end as the internet sees it
        for near, far in ((na, nb), (nb, na)):
            if far.kind == "home" and near.lan is None:
                continue  # the far host hides behind its router's address, shared with its LAN: cut at its end
            gw, far_addr = self._gateway(near), self.public_address(far.name)
            self._rule(gw, add, near.addr, far_addr)
            self._rule(gw, add, far_addr, near.addr)

    def close(self) -> None:
        """Kill every process of the bed, stop the delay line, delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._line is not None:
            self._line.close()
        for sig, wait in ((signal.SIGTERM, self._grace), (signal.SIGKILL, 2.0)):
            for proc in self._procs:
                self._kill_group(proc, sig)
            deadline = time.monotonic() + wait
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # whatever escaped the tracked process groups (daemons, double forks) dies with its namespace
        _kill_namespace_pids(self._namespaces, self._grace)
        for ns in reversed(self._namespaces):
            _run(["ip", "netns", "del", ns], check=False)
        left = set(self._namespaces) & set(_netns_list())
        if left:
            warnings.warn(f"test bed could not delete namespaces {sorted(left)}", RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def bed_with_hosts(
    public: Iterable[str], homes: Iterable[str] = (), symmetric: Iterable[str] = ()
) -> Iterator[TestBed]:
    """A test bed with the public hosts `public`, then the home hosts `homes` (each behind a router
    of its own; a symmetric NAT for those in `symmetric`), closed after the block."""
    symmetric = set(symmetric)
    with TestBed() as bed:
        for host in public:
            bed.add_public_host(host)
        for host in homes:
            bed.add_home_host(host, symmetric=host in symmetric)
        yield bed
