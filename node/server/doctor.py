"""`node doctor`: the pre-flight a volunteer runs before `node join`, one line per check.

Each check says what it found and, when it is not fine, what to do about it. The checks run in
the order a join would meet them: the listen port, the libp2p daemon, the initial peers, the swarm's
config and versions, this machine's clock against the swarm's, how others can reach this peer, and
whether the device holds the stage this peer would get. A failed check stops the ones that depend
on it (no swarm config: no version, clock or memory check). Exit 0 when joining would work.

Clock offset (`clock_offset`): hivemind's DHT stamps values with expirations in wall-clock time, and
our records carry `updated`, the announcing peer's wall clock when it last re-announced (every
heartbeat period p). A record read at our time `now` was written between `now - p - delay` and `now`
if both clocks agree, so `updated - now` lies in [-(p + delay), 0] plus the peer's offset. The
estimate per peer is therefore `updated - now + p/2`, with an uncertainty of p/2 (+ delay); the
swarm's offset is their median, which no single peer with a wrong clock can move far.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from hivemind.p2p import PeerID

from dht.records import PeerRecord, PeerState, Reachability, reachability_of
from dht.registry import SwarmRegistry
from node import __version__
from node.config import SwarmConfig
from node.model.memory import DeviceMemory, available_memory, format_bytes
from node.p2p.network import Network, NetworkError, peer_id_of_maddr, start_network
from node.p2p.reachability import NatReachability
from node.server.daemon import JoinRefused, check_compatible, expected_founder, find_swarm
from node.server.stage_choice import choose_stage, stage_loads
from node.server.stage_fit import DeviceUnusable, StageFit, fitting_stages, measure_device, no_stage_fits, stage_fits
from protocol.version import PROTOCOL_VERSION

CLOCK_WARN_SECONDS = 1.0  # DHT expirations and record TTLs start to drift visibly
CLOCK_FAIL_SECONDS = 5.0  # records of a few seconds' TTL would look expired or too far ahead


class Outcome(StrEnum):
    OK = "ok"
    WARN = "warn"  # joining works, but something will hurt
    FAIL = "fail"  # joining would not work


@dataclass(frozen=True)
class Check:
    name: str
    outcome: Outcome
    found: str
    fix: str = ""

    def line(self) -> str:
        text = f"[{self.outcome.value:>4}] {self.name:<12} {self.found}"
        return f"{text} -> {self.fix}" if self.fix else text


@dataclass
class DoctorOptions:
    initial_peers: list[str]
    swarm_id: str | None = None
    swarm_founder: str | None = None
    host: str = "0.0.0.0"
    port: int = 0
    identity_path: str | None = None
    swarm_key: bytes | None = None
    announce_maddrs: list[str] = field(default_factory=list)
    reachability: str = NatReachability.AUTO.value
    stage: str = "auto"
    device: str = "auto"
    find_timeout: float = 20.0


def check_port(host: str, port: int) -> Check:
    """Whether `node join --port PORT` could listen (port 0: the OS picks a free one)."""
    if port == 0:
        return Check(
            "port",
            Outcome.OK,
            "any free port (no --port given)",
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            reason = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            return Check(
                "port",
                Outcome.FAIL,
                f"cannot listen on {host}:{port}: {reason}",
                "choose another --port, or stop what holds it",
            )
    return Check("port", Outcome.OK, f"{host}:{port} is free")


def clock_offset(records: Sequence[PeerRecord], now: float, heartbeat_period: float) -> tuple[float, float] | None:
    """(median offset of the swarm's clocks from ours in seconds, its uncertainty), from the
    `updated` stamps of live records (module docstring); None without any."""
    stamps = [record.updated for record in records if record.updated > 0 and record.state != PeerState.LEAVING]
    if not stamps:
        return None
    return statistics.median(stamp - now + heartbeat_period / 2 for stamp in stamps), heartbeat_period / 2


def check_clock(records: Sequence[PeerRecord], now: float, heartbeat_period: float) -> Check:
    estimate = clock_offset(records, now, heartbeat_period)
    if estimate is None:
        return Check("clock", Outcome.WARN, "no peer record to compare with", "run doctor again once peers serve")
    offset, uncertainty = estimate
    found = f"offset {offset:+.1f} s +- {uncertainty:.1f} s from {len(records)} peer record(s)"
    fix = "sync this machine's clock (enable NTP: `timedatectl set-ntp true`)"
    beyond = abs(offset) - uncertainty  # the part of the offset the estimate is sure of
    if beyond > CLOCK_FAIL_SECONDS:
        return Check("clock", Outcome.FAIL, found, fix)
    if beyond > CLOCK_WARN_SECONDS:
        return Check("clock", Outcome.WARN, found, fix)
    return Check("clock", Outcome.OK, found)


def check_versions(swarm_protocol: int, swarm_software: str) -> Check:
    found = (
        f"protocol {PROTOCOL_VERSION} (swarm {swarm_protocol}), software {__version__} (swarm {swarm_software or '?'})"
    )
    if swarm_protocol != PROTOCOL_VERSION:
        return Check("versions", Outcome.FAIL, found, "install the pipeswarm version the swarm runs")
    if swarm_software and swarm_software != __version__:
        return Check("versions", Outcome.WARN, found, "same protocol, other release: upgrade when convenient")
    return Check("versions", Outcome.OK, found)


def check_reachability(addresses: Sequence[str], requested: NatReachability) -> Check:
    """How others could reach this peer, from the addresses a join would announce."""
    kind = reachability_of(list(addresses))
    shown = ", ".join(addresses[:3]) + (" ..." if len(addresses) > 3 else "")
    if kind == Reachability.RELAYED:
        return Check(
            "reachability",
            Outcome.OK,
            f"via relay ({shown}): others reach this peer through relays; it trains with directly dialable peers",
            "to be dialed directly, forward a TCP port on your router and use --port P --announce /ip4/PUBLIC_IP/tcp/P",
        )
    if kind == Reachability.PUBLIC:
        note = " (declared --reachability public)" if requested == NatReachability.PUBLIC else ""
        return Check("reachability", Outcome.OK, f"public{note}: announces {shown}")
    return Check(
        "reachability",
        Outcome.FAIL,
        "no address to announce",
        "listen on an interface others can reach (--host), or --announce the forwarded address",
    )


def check_memory(
    stage: int, config: SwarmConfig, device: str, available: Callable[[str], DeviceMemory] = available_memory
) -> Check:
    """Whether `device` can hold a peer of `stage` with at least training.min_in_flight microbatches
    in flight (node/model/memory.py's estimate; a join narrows its window to what fits)."""
    try:
        memory = measure_device(device, available)
    except DeviceUnusable as e:
        return Check("memory", Outcome.FAIL, str(e), "pick another --device")
    (fit,) = stage_fits(config, [stage], memory)
    return _memory_check(fit, memory)


def _memory_check(fit: StageFit, memory: DeviceMemory) -> Check:
    needs = f"stage {fit.stage} needs about {format_bytes(fit.estimate.total)}"
    if fit.in_flight is None:  # not even min_in_flight fits
        found = f"{needs}; {memory.device} has {format_bytes(memory.free)} free"
        return Check("memory", Outcome.FAIL, found, "use a larger device, or a swarm with more stages")
    found = f"{needs} with {fit.in_flight} microbatches in flight; {memory.device} has {format_bytes(memory.free)} free"
    return Check("memory", Outcome.OK, found)


def check_auto_memory(
    peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    config: SwarmConfig,
    device: str,
    available: Callable[[str], DeviceMemory] = available_memory,
) -> Check:
    """The memory check of the stage `node join --stage auto` would take: the neediest stage this
    device holds (node/server/stage_fit.py), or a failure with the numbers when it holds none."""
    try:
        memory = measure_device(device, available)
    except DeviceUnusable as e:
        return Check("memory", Outcome.FAIL, str(e), "pick another --device")
    fits = stage_fits(config, range(config.num_stages), memory)
    allowed = fitting_stages(fits)
    if not allowed:
        return Check("memory", Outcome.FAIL, no_stage_fits(config.swarm_id, config.training, fits, memory))
    stage = choose_stage(stage_loads(peers_by_stage, config.num_stages), random.Random(), allowed)
    return _memory_check(fits[stage], memory)


def stage_for(requested: str, peers_by_stage: Mapping[int, Sequence[PeerRecord]], num_stages: int) -> int | None:
    """The stage `node join --stage REQUESTED` would take first on a device that holds any (None: out of range)."""
    if requested != "auto":
        stage = int(requested)
        return stage if 0 <= stage < num_stages else None
    return choose_stage(stage_loads(peers_by_stage, num_stages), random.Random())


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


async def check_daemon(host: str) -> Check:
    """Whether p2pd and a DHT node start here at all, alone (no initial peers), and how long it takes:
    with initial peers p2pd quits when none answers, which would hide which of the two is wrong."""
    started = time.monotonic()
    try:
        network = await start_network(host=host, port=0)
    except NetworkError as e:
        return Check("daemon", Outcome.FAIL, str(e), "reinstall pipeswarm (hivemind ships p2pd); check the message")
    elapsed = time.monotonic() - started
    await network.shutdown()
    return Check("daemon", Outcome.OK, f"p2pd and a DHT node start in {elapsed:.1f} s")


async def join_dht(options: DoctorOptions) -> Network | Check:
    """The network a join would start (through the initial peers), or the failed check."""
    try:
        return await start_network(
            host=options.host,
            port=options.port,
            initial_peers=options.initial_peers,
            identity_path=options.identity_path,
            announce_maddrs=options.announce_maddrs,
            swarm_key=options.swarm_key,
            reachability=NatReachability(options.reachability),
        )
    except NetworkError as e:
        return Check(
            "peers",
            Outcome.FAIL,
            f"no initial peer let this node in: {e}",
            "check the multiaddrs printed by `node bootstrap`, that those peers run, and that this machine "
            "may connect out to their ports",
        )


async def answering_peers(network: Network, initial_peers: Sequence[str], timeout: float = 5.0) -> list[str]:
    """The initial peers that answer a DHT ping now."""
    answered = []
    for maddr in initial_peers:
        peer_id = peer_id_of_maddr(maddr)
        if peer_id is None:
            continue
        try:
            reply = await asyncio.wait_for(network.dht.protocol.call_ping(PeerID.from_base58(peer_id)), timeout)
        except Exception:  # a timeout or a refused stream: this peer does not answer
            reply = None
        if reply is not None:
            answered.append(maddr)
    return answered


async def run_doctor(options: DoctorOptions, report: Callable[[Check], None]) -> bool:
    """Run every check, reporting each as it finishes; True when joining would work."""
    results: list[Check] = []

    def note(check: Check) -> None:
        results.append(check)
        report(check)

    def failed() -> bool:
        return any(check.outcome == Outcome.FAIL for check in results)

    port_check = check_port(options.host, options.port)
    note(port_check)
    if port_check.outcome == Outcome.FAIL:
        return False
    try:
        founder = expected_founder(options.initial_peers, options.swarm_founder)
    except JoinRefused as e:
        note(Check("peers", Outcome.FAIL, str(e), "give the full multiaddr printed by `node bootstrap`"))
        return False
    note(await check_daemon(options.host))
    if failed():
        return False
    network = await join_dht(options)
    if isinstance(network, Check):
        note(network)
        return False
    try:
        answered = await answering_peers(network, options.initial_peers)
        note(
            Check(
                "peers",
                Outcome.OK if answered else Outcome.WARN,
                f"{len(answered)} of {len(options.initial_peers)} initial peer(s) answer a ping",
                "" if answered else "the DHT was joined through another node; check the initial peers",
            )
        )
        try:
            record = await find_swarm(network, options.swarm_id, options.find_timeout, founder)
        except JoinRefused as e:
            note(Check("swarm", Outcome.FAIL, str(e), "check --swarm / --swarm-founder / --swarm-key"))
            return False
        note(check_versions(record.protocol_version, record.software_version))
        try:
            config = check_compatible(record)
        except JoinRefused as e:
            note(Check("swarm", Outcome.FAIL, str(e), "install the pipeswarm version the swarm runs"))
            return False
        private = record.envelope is not None and "mac" in record.envelope
        if private and options.swarm_key is None:
            note(
                Check(
                    "swarm",
                    Outcome.FAIL,
                    f"swarm {config.swarm_id} is private",
                    "pass --swarm-key FILE with the swarm's key",
                )
            )
            return False
        peers_by_stage = await SwarmRegistry(network.dht, config.swarm_id).all_peers(config.num_stages)
        live = [peer for peers in peers_by_stage.values() for peer in peers]
        note(
            Check(
                "swarm",
                Outcome.OK,
                f"{config.swarm_id}: {config.num_stages} stages, {len(live)} peer record(s), config {record.config_hash}",
            )
        )
        note(check_clock(live, time.time(), config.heartbeat.period))
        note(check_reachability(await network.announced_addresses(), NatReachability(options.reachability)))
        device = resolve_device(options.device)
        stage = None if options.stage == "auto" else stage_for(options.stage, peers_by_stage, config.num_stages)
        if options.stage == "auto":
            note(check_auto_memory(peers_by_stage, config, device))
        elif stage is None:
            note(
                Check(
                    "memory",
                    Outcome.FAIL,
                    f"--stage {options.stage} is not a stage of this swarm (0..{config.num_stages - 1})",
                    "use --stage auto",
                )
            )
        else:
            note(check_memory(stage, config, device))
    finally:
        await network.shutdown()
    return not failed()
