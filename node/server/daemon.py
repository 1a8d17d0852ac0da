"""The life of a peer process: start networking, find the swarm, claim a stage, serve, leave.

`bootstrap` starts a swarm and stays up as its DHT anchor; its identity is the swarm's *founder*,
the one key whose signature makes a swarm config genuine. Both keep their key across restarts:
`--identity FILE`, else a key per swarm (founder) or per `--name` (peer) under the per-user state
directory (node/p2p/identity_store.py). `join` reads the config signed by the founder it was pointed at (the peer id in the
bootstrap multiaddr, or `--swarm-founder`), ignores any other config under that swarm id, refuses a
mismatching protocol or config, claims a stage and keeps its record alive. Every serving peer
re-publishes the founder's signed config verbatim, so the swarm outlives its bootstrapper. Both
leave cleanly on SIGINT/SIGTERM: the record is overwritten as `leaving`, then the DHT node and the
libp2p daemon are shut down (p2pd is this process's only child).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import base58

from dht.announcer import PeerAnnouncer
from dht.records import ConfigRecord, PeerRecord, PeerState
from dht.registry import SwarmRegistry, list_swarm_configs, swarm_key_of
from dht.signing import MAX_RECORD_TTL
from node import __version__
from node.config import ConfigError, SwarmConfig
from node.model.memory import format_bytes
from node.p2p.identity_store import ClaimedKey, IdentityError, IdentityRole, claim_identity
from node.p2p.network import Network, NetworkError, peer_id_of_maddr, start_network
from node.p2p.reachability import NatReachability
from node.p2p.relay import Relay, RelayBudget
from node.p2p.swarm_key import key_fingerprint
from node.server.data_service import DataStore, data_transport, serve_data
from node.server.stage_claim import StageOutOfRange, claim_stage
from node.server.stage_fit import DeviceUnusable, fitting_stages, measure_device, no_stage_fits, stage_fits
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

CONFIG_TTL = 120.0


class JoinRefused(RuntimeError):
    """This peer must not join the swarm it found (wrong protocol version or config)."""


@dataclass
class NodeOptions:
    host: str = "0.0.0.0"
    port: int = 0
    initial_peers: list[str] = field(default_factory=list)
    identity_path: str | None = None
    swarm_key: bytes | None = None  # a private swarm's key (node/p2p/swarm_key.py); None: open
    announce_maddrs: list[str] = field(default_factory=list)
    name: str = ""
    swarm_id: str | None = None
    swarm_founder: str | None = None  # peer id whose signed config to trust (default: the initial peer's)
    stage: str = "auto"
    throughput: float = 1.0
    join_jitter: float = 2.0
    find_timeout: float = 30.0
    reachability: str = "auto"  # NatReachability: may this peer need relays (node/p2p/reachability.py)
    direct_links: bool = True  # pipeline channels on direct TCP links where peers reach each other (node/p2p/direct.py)
    direct_port: int = 0
    # a relay for peers behind NATs (node/p2p/relay.py): the bytes it carries in all (0: not a relay), at what rate
    relay_budget_gb: float = 0.0
    relay_rate_mbit: float = 50.0
    on_network: Callable[[Network], None] | None = None  # told once networking runs (`--metrics-port`)
    # the device whose free memory decides which stages `--stage auto` may take (node/server/stage_fit.py);
    # None: any stage (no training here, or --skip-memory-check)
    memory_device: str | None = None


def install_stop_signals() -> asyncio.Event:
    """An event set on the first SIGINT/SIGTERM; a second signal exits at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second signal: exiting now")
            sys.exit(128 + signum)
        logger.info(f"received {signal.Signals(signum).name}, leaving the swarm")
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


async def keep_config_published(registry: SwarmRegistry, record: ConfigRecord) -> None:
    """Every serving peer re-publishes the config, so the swarm outlives its bootstrapper."""
    while True:
        try:
            await registry.publish_config(record, CONFIG_TTL)
        except Exception as e:
            logger.warning(f"could not re-publish the swarm config: {e!r}")
        await asyncio.sleep(CONFIG_TTL / 4)


async def keep_addresses_current(network: Network, me: PeerAnnouncer, period: float = 15.0) -> None:
    """Announce where this peer can be dialed; relay addresses appear once a reservation is made."""
    while True:
        try:
            me.set_addresses(await network.announced_addresses())
        except Exception as e:
            logger.warning(f"could not read this peer's addresses: {e!r}")
        await asyncio.sleep(period)


async def keep_relay_announced(relay: Relay, me: PeerAnnouncer, period: float = 5.0) -> None:
    """Announce what this relay still carries: peers behind NATs register with relays that have some."""
    while True:
        me.set_relay_budget(relay.budget.left)
        await asyncio.sleep(period)


async def start_peer_network(options: NodeOptions, role: IdentityRole, label: str) -> tuple[Network, ClaimedKey | None]:
    """Networking under `--identity FILE`, else under this role's and label's key in the state
    directory, claimed for this process (the caller releases it; the kernel does at any exit)."""
    claimed, identity_path = None, options.identity_path
    if identity_path is None:
        claimed = claim_identity(role, label)
        identity_path = str(claimed.path)
    try:
        network = await start_network(
            host=options.host,
            port=options.port,
            initial_peers=options.initial_peers,
            identity_path=identity_path,
            announce_maddrs=options.announce_maddrs,
            swarm_key=options.swarm_key,
            reachability=NatReachability(options.reachability),
            direct_port=options.direct_port if options.direct_links else None,
        )
    except BaseException:
        if claimed is not None:
            claimed.release()
        raise
    logger.info(f"peer id {network.peer_id} (key {identity_path})")
    if options.on_network is not None:
        options.on_network(network)
    return network, claimed


def is_peer_id(text: str) -> bool:
    """Whether `text` reads as a libp2p peer id (base58 of a sha2-256 or identity multihash)."""
    if not 20 <= len(text) <= 128:
        return False
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    return (len(raw) == 34 and raw[:2] == b"\x12\x20") or (len(raw) >= 2 and raw[0] == 0 and raw[1] == len(raw) - 2)


def expected_founder(initial_peers: Sequence[str], swarm_founder: str | None = None) -> str:
    """The peer id whose signature a joiner accepts on the swarm config: `--swarm-founder` when
    given, else the one peer named by the initial multiaddrs (joining through the bootstrapper)."""
    if swarm_founder is not None:
        if not is_peer_id(swarm_founder):
            raise JoinRefused(f"--swarm-founder {swarm_founder[:80]!r} is not a peer id")
        return swarm_founder
    ids = {peer_id_of_maddr(maddr) for maddr in initial_peers}
    if None in ids:
        raise JoinRefused(
            "an initial peer's multiaddr has no /p2p/<peer id> part: cannot tell whose swarm "
            "config to trust (give the full address printed by `node bootstrap`, or --swarm-founder)"
        )
    if len(ids) != 1:
        raise JoinRefused(
            f"the initial peers are {len(ids)} different peers: name the swarm's founder with "
            "--swarm-founder PEER_ID (printed by `node bootstrap`)"
        )
    return ids.pop()  # type: ignore[return-value]


async def bootstrap(
    config: SwarmConfig, options: NodeOptions, announce: Callable[[list[str]], None], data: DataStore | None = None
) -> int:
    """Found the swarm and anchor it until stopped; with `data` (`--data DIR`), serve its shards."""
    stop = install_stop_signals()
    network, claimed = await start_peer_network(options, IdentityRole.FOUNDER, config.swarm_id)
    data_server = None
    try:
        if data is not None:  # the founder holds no stage: stage -1 ("none") on its messages
            data_server = data_transport(network, config.swarm_id, -1)
            await serve_data(data_server, data)
        network.validator.learn_swarm_ttl(config.swarm_id, config.heartbeat.ttl)
        registry = SwarmRegistry(network.dht, config.swarm_id)
        # sealed with this peer's identity: it is the swarm's founder
        record = ConfigRecord(PROTOCOL_VERSION, config.config_hash(), config.to_dict(), __version__)
        logger.info(f"swarm {config.swarm_id} founded by {network.peer_id}")
        publisher = asyncio.create_task(keep_config_published(registry, record))
        announce(await network.visible_maddrs())
        await stop.wait()
        publisher.cancel()
    finally:
        if data_server is not None:
            await data_server.close()
        await network.shutdown()
        if claimed is not None:
            claimed.release()
    return 0


async def find_swarm(
    network: Network, swarm_id: str | None, timeout: float, founder: str | None = None
) -> ConfigRecord:
    """The config of the swarm to join, signed by `founder` (default: the peer named by the initial
    peers this network joined through); waits for it to show up in the DHT for up to `timeout`.
    Configs under the same swarm id signed by anyone else are ignored, with a log line."""
    founder = founder or expected_founder(network.initial_peers)
    deadline = asyncio.get_running_loop().time() + timeout
    ignored: dict[tuple[str, str], ConfigRecord] = {}  # (swarm id, signer) -> a config not signed by the founder
    while True:
        by_swarm: dict[str, ConfigRecord] = {}
        for record in await list_swarm_configs(network.dht):
            record_swarm = record.config["swarm_id"]
            if swarm_id is not None and record_swarm != swarm_id:
                continue
            if record.founder == founder:
                by_swarm[record_swarm] = record
            elif (record_swarm, record.founder) not in ignored:
                ignored[(record_swarm, record.founder)] = record
                logger.warning(
                    f"ignoring a config for swarm {record_swarm} signed by {record.founder}: "
                    f"not the swarm's founder {founder}"
                )
        chosen: ConfigRecord | None = None
        if swarm_id is not None:
            chosen = by_swarm.get(swarm_id)
        elif len(by_swarm) == 1:
            chosen = next(iter(by_swarm.values()))
        elif len(by_swarm) > 1:
            raise JoinRefused(
                f"{founder} founded several swarms in this DHT ({', '.join(sorted(by_swarm))}): choose one with --swarm"
            )
        if chosen is not None:
            learn_swarm_ttl(network, chosen)
            return chosen
        if asyncio.get_running_loop().time() > deadline:
            seen_swarms = {seen_swarm for seen_swarm, _ in ignored}
            shown = swarm_id or (next(iter(seen_swarms)) if len(seen_swarms) == 1 else None)
            what = f"swarm {shown}" if shown else "any swarm"
            others = sorted({signer for _, signer in ignored})
            found = (
                f"; found {'one' if len(ignored) == 1 else len(ignored)} signed by {', '.join(others)} (ignored)"
                if others
                else ": is the bootstrap peer up?"
            )
            if swarm_key_of(network.dht) is not None:
                found += (
                    f" (this node uses swarm key {key_fingerprint(swarm_key_of(network.dht))}: a private "
                    "swarm's records verify only under its own key)"
                )
            raise JoinRefused(
                f"no config for {what} signed by founder {founder} in the DHT within {timeout:.0f} s{found}"
            )
        await asyncio.sleep(1.0)


def learn_swarm_ttl(network: Network, record: ConfigRecord) -> None:
    """Hold this swarm's peer records to its heartbeat TTL, in the DHT node and in readers."""
    try:
        ttl = SwarmConfig.from_dict(record.config).heartbeat.ttl
    except (ConfigError, TypeError, ValueError, AttributeError):
        return  # check_compatible refuses this config with a proper message
    network.validator.learn_swarm_ttl(record.config["swarm_id"], ttl)


def check_compatible(record: ConfigRecord) -> SwarmConfig:
    """The swarm's config, if this software may train in it; JoinRefused otherwise."""
    if record.protocol_version != PROTOCOL_VERSION:
        raise JoinRefused(
            f"the swarm speaks protocol version {record.protocol_version}, this node speaks {PROTOCOL_VERSION} "
            f"(swarm software {record.software_version or 'unknown'}, this node {__version__}): upgrade pipeswarm"
        )
    try:
        config = SwarmConfig.from_dict(record.config)
    except (ConfigError, TypeError) as e:
        raise JoinRefused(f"the swarm's config is not understood by this node ({__version__}): {e}") from e
    if config.config_hash() != record.config_hash:
        raise JoinRefused(
            f"config hash mismatch: the swarm announces {record.config_hash}, this node computes "
            f"{config.config_hash()} from the same config (different software version?)"
        )
    if config.heartbeat.ttl > MAX_RECORD_TTL:
        raise JoinRefused(
            f"the swarm's heartbeat TTL ({config.heartbeat.ttl:.0f} s) is longer than a signed "
            f"record may live ({MAX_RECORD_TTL:.0f} s): its peer records would be refused"
        )
    return config


# what `join` runs once the peer holds its place (node/server/stage_service.py: serve_stage)
ServeStage = Callable[[Network, SwarmConfig, PeerAnnouncer, asyncio.Event], Awaitable[None]]


def stages_this_device_holds(config: SwarmConfig, device: str | None) -> frozenset[int] | None:
    """The stages `--stage auto` may choose among: those whose memory estimate fits `device`'s free
    memory (None: any, no device to check). JoinRefused, with the numbers, when none does."""
    if device is None:
        return None
    try:
        memory = measure_device(device)
    except DeviceUnusable as e:
        raise JoinRefused(str(e)) from None
    fits = stage_fits(config, range(config.num_stages), memory)
    allowed = fitting_stages(fits)
    if not allowed:
        raise JoinRefused(no_stage_fits(config.swarm_id, config.training, fits, memory))
    for fit in fits:
        if not fit.fits:
            logger.info(
                f"--stage auto skips stage {fit.stage}: it needs about {format_bytes(fit.estimate.total)}, "
                f"{memory.device} has {format_bytes(memory.free)} free"
            )
    return allowed


async def join(options: NodeOptions, serve: ServeStage | None = None) -> int:
    """Join a swarm and serve a stage until stopped. `serve` runs the stage's work (the training
    runtime); without it the peer only holds its place in the registry."""
    stop = install_stop_signals()
    founder = expected_founder(options.initial_peers, options.swarm_founder)  # before starting anything
    network, claimed = await start_peer_network(options, IdentityRole.PEER, options.name)
    tasks: list[asyncio.Task] = []
    me: PeerAnnouncer | None = None
    try:
        config_record = await find_swarm(network, options.swarm_id, options.find_timeout, founder)
        config = check_compatible(config_record)
        if config_record.envelope is not None and "mac" in config_record.envelope and options.swarm_key is None:
            # observers may read a private swarm; members must hold its key
            raise JoinRefused(
                f"swarm {config.swarm_id} is private: its records carry a MAC; "
                "pass --swarm-key FILE (or set PIPESWARM_SWARM_KEY_FILE) with the swarm's key"
            )
        registry = SwarmRegistry(network.dht, config.swarm_id)
        record = PeerRecord(
            peer_id=network.peer_id,
            stage=0,
            state=PeerState.JOINING,
            throughput=options.throughput,
            version=__version__,
            name=options.name,
            direct_port=network.direct_port,
        )
        me = PeerAnnouncer(registry, record, config.heartbeat.period, config.heartbeat.ttl)
        me.set_addresses(await network.announced_addresses())
        allowed = stages_this_device_holds(config, options.memory_device) if options.stage == "auto" else None
        try:
            await claim_stage(
                me,
                registry,
                config.num_stages,
                options.stage,
                jitter=options.join_jitter,
                settle=max(1.0, config.heartbeat.period / 4),
                allowed=allowed,
            )
        except StageOutOfRange as e:
            raise JoinRefused(str(e)) from None
        logger.info(f"peer {me.peer_id} serves stage {me.stage} of swarm {config.swarm_id}")
        tasks.append(asyncio.create_task(me.run(), name="heartbeat"))
        tasks.append(asyncio.create_task(keep_config_published(registry, config_record), name="config"))
        tasks.append(asyncio.create_task(keep_addresses_current(network, me), name="addresses"))
        network.enable_traversal(config.swarm_id)
        if options.relay_budget_gb > 0 and network.direct is not None:
            budget = RelayBudget(int(options.relay_budget_gb * 1e9), options.relay_rate_mbit * 1e6 / 8)
            relay = Relay(network.identity, config.swarm_id, budget)
            relay.attach(network.direct)
            tasks.append(asyncio.create_task(keep_relay_announced(relay, me), name="relay"))
        tasks.append(asyncio.create_task(network.keep_joined(), name="dht-rejoin"))
        if serve is not None:
            tasks.append(asyncio.create_task(serve(network, config, me, stop), name="stage"))
        else:
            me.set_state(PeerState.ONLINE)
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not waiter and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return 0
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if me is not None:
            await me.farewell()
        await network.shutdown()
        if claimed is not None:
            claimed.release()


def run(coroutine: Awaitable[int]) -> int:
    """Run a node coroutine on uvloop (hivemind's loop of choice), mapping known failures to exit codes."""
    import uvloop

    try:
        return uvloop.run(coroutine)  # type: ignore[arg-type]
    except JoinRefused as e:
        logger.error(f"refusing to join: {e}")
        return 3
    except IdentityError as e:
        logger.error(f"refusing to start: {e}")
        return 2
    except NetworkError as e:
        logger.error(str(e))
        return 4
    except KeyboardInterrupt:
        return 130
