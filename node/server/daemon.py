"""The life of a peer process: start networking, find the swarm, claim a stage, serve, leave.

`bootstrap` starts a swarm and stays up as its DHT anchor; `join` reads the swarm config from the
DHT, refuses a mismatching protocol or config, claims a stage and keeps its record alive. Both
leave cleanly on SIGINT/SIGTERM: the record is overwritten as `leaving`, then the DHT node and the
libp2p daemon are shut down (p2pd is this process's only child).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Awaitable, Callable


from dht.announcer import PeerAnnouncer
from dht.records import ConfigRecord, PeerRecord, PeerState
from dht.registry import SwarmRegistry, list_swarms
from node import __version__
from node.config import ConfigError, SwarmConfig
from node.p2p.network import Network, NetworkError, start_network
from node.server.stage_claim import StageOutOfRange, claim_stage
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
    announce_maddrs: list[str] = field(default_factory=list)
    name: str = ""
    swarm_id: str | None = None
    stage: str = "auto"
    throughput: float = 1.0
    join_jitter: float = 2.0
    find_timeout: float = 30.0


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


async def start_peer_network(options: NodeOptions) -> Network:
    return await start_network(
        host=options.host,
        port=options.port,
        initial_peers=options.initial_peers,
        identity_path=options.identity_path,
        announce_maddrs=options.announce_maddrs,
    )


async def bootstrap(config: SwarmConfig, options: NodeOptions, announce: Callable[[list[str]], None]) -> int:
    stop = install_stop_signals()
    network = await start_peer_network(options)
    try:
        registry = SwarmRegistry(network.dht, config.swarm_id)
        record = ConfigRecord(PROTOCOL_VERSION, config.config_hash(), config.to_dict(), __version__)
        publisher = asyncio.create_task(keep_config_published(registry, record))
        announce(await network.visible_maddrs())
        await stop.wait()
        publisher.cancel()
    finally:
        await network.shutdown()
    return 0


async def find_swarm(network: Network, swarm_id: str | None, timeout: float) -> ConfigRecord:
    """The config of the swarm to join; waits for it to show up in the DHT for up to `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        swarms = await list_swarms(network.dht)
        if swarm_id is not None and swarm_id in swarms:
            return swarms[swarm_id]
        if swarm_id is None and len(swarms) == 1:
            return next(iter(swarms.values()))
        if swarm_id is None and len(swarms) > 1:
            raise JoinRefused(f"several swarms share this DHT ({', '.join(sorted(swarms))}): choose one with --swarm")
        if asyncio.get_running_loop().time() > deadline:
            what = f"the config of swarm {swarm_id!r}" if swarm_id else "a swarm config"
            raise JoinRefused(f"found {what} nowhere in the DHT within {timeout:.0f} s: is the bootstrap peer up?")
        await asyncio.sleep(1.0)


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
    return config


StageService = Callable[[Network, SwarmConfig, PeerAnnouncer, asyncio.Event], Awaitable[None]]


async def join(options: NodeOptions, serve: StageService | None = None) -> int:
    """Join a swarm and serve a stage until stopped. `serve` runs the stage's work (the training
    runtime); without it the peer only holds its place in the registry."""
    stop = install_stop_signals()
    network = await start_peer_network(options)
    tasks: list[asyncio.Task] = []
    me: PeerAnnouncer | None = None
    try:
        config_record = await find_swarm(network, options.swarm_id, options.find_timeout)
        config = check_compatible(config_record)
        registry = SwarmRegistry(network.dht, config.swarm_id)
        record = PeerRecord(
            peer_id=network.peer_id, stage=0, state=PeerState.JOINING, throughput=options.throughput,
            version=__version__, name=options.name,
        )
        me = PeerAnnouncer(registry, record, config.heartbeat.period, config.heartbeat.ttl)
        try:
            await claim_stage(me, registry, config.num_stages, options.stage, jitter=options.join_jitter,
                              settle=max(1.0, config.heartbeat.period / 4))
        except StageOutOfRange as e:
            raise JoinRefused(str(e)) from None
        logger.info(f"peer {me.peer_id} serves stage {me.stage} of swarm {config.swarm_id}")
        tasks.append(asyncio.create_task(me.run(), name="heartbeat"))
        tasks.append(asyncio.create_task(keep_config_published(registry, config_record), name="config"))
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


def run(coroutine: Awaitable[int]) -> int:
    """Run a node coroutine on uvloop (hivemind's loop of choice), mapping known failures to exit codes."""
    import uvloop

    try:
        return uvloop.run(coroutine)  # type: ignore[arg-type]
    except JoinRefused as e:
        logger.error(f"refusing to join: {e}")
        return 3
    except NetworkError as e:
        logger.error(str(e))
        return 4
    except KeyboardInterrupt:
        return 130
