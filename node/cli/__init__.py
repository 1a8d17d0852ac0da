"""`node` / `pipeswarm` / `python -m node`: bootstrap, join, doctor, status, dashboard, keygen, prepare-data,
export, generate, simulate."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported: its logs are noisy

from node import __version__
from node.cli.data_commands import add_data_commands, cmd_export, cmd_generate, cmd_prepare_data
from node.cli.flags import add_json_output, add_network_flags, add_relay_flags, add_swarm_access
from node.cli.simulate_command import add_simulate_parser, cmd_simulate
from node.config import ConfigError
from node.model.presets import PresetName, load_config

logger = logging.getLogger("node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="node", description="pipeswarm: peer-to-peer pipeline training")
    parser.add_argument("--version", action="version", version=f"pipeswarm {__version__}")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    boot = commands.add_parser("bootstrap", help="start a new swarm and stay up as its DHT anchor")
    add_network_flags(boot)
    add_swarm_access(boot, peers_required=False, founder=False)
    boot.add_argument("--config", help="TOML file with the swarm config (sections model, training, gossip, ...)")
    boot.add_argument("--num-stages", type=int, help="pipeline stages, counting stage 0 (embedding + head)")
    boot.add_argument("--seed", type=int, help="swarm seed: initial weights and synthetic data derive from it")
    boot.add_argument(
        "--preset",
        metavar="NAME",
        help=f"model shape ({', '.join(p.value for p in PresetName)}; docs/model.md): fills the [model] "
        "section, the training shape and num_stages; keys written explicitly win",
    )
    boot.add_argument(
        "--data",
        dest="data_path",
        metavar="DIR",
        help="a directory of `node prepare-data`: the swarm records its tokenizer's hash and the hash of its "
        "shard manifest, takes its vocabulary size, and this peer serves the shards to stage-0 peers without --data",
    )
    boot.add_argument(
        "--shard-size",
        dest="shard_bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes per data shard (default 4 MiB; a multiple of 4): stage-0 peers with their own --data "
        "serve it to others only at the default",
    )
    boot.add_argument("--heartbeat-period", type=float, help="seconds between peer record announcements")
    boot.add_argument("--heartbeat-ttl", type=float, help="seconds a peer record lives without a heartbeat")

    join = commands.add_parser("join", help="join a swarm and serve a stage")
    add_network_flags(join)
    add_relay_flags(join)
    add_swarm_access(join)
    join.add_argument("--stage", default="auto", help="'auto' (the stage that needs help most) or a stage number")
    join.add_argument("--name", default="", help="public name shown to other peers")
    join.add_argument("--throughput", type=float, default=1.0, help="initial throughput estimate before measuring")
    join.add_argument("--join-jitter", type=float, default=2.0, help="max random delay before choosing a stage (s)")
    join.add_argument(
        "--find-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the founder's swarm config to show up in the DHT",
    )
    join.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    join.add_argument(
        "--data",
        dest="data_path",
        help="stage 0 data: a directory of `node prepare-data`, a UTF-8 text file or a uint16 token .bin "
        "file (default: the swarm's prepared data, fetched from its peers, when its founder gave --data; "
        "else its synthetic source)",
    )
    join.add_argument("--threads", type=int, help="torch CPU threads for this peer")
    join.add_argument(
        "--skip-memory-check",
        dest="check_memory",
        action="store_false",
        help="serve the stage even when its estimated memory exceeds what the device has free",
    )
    join.add_argument("--quiet", action="store_true", help="logs only, no live status panel")
    join.add_argument(
        "--no-train",
        dest="train",
        action="store_false",
        help="hold a place in the registry without serving a stage (for DHT tests)",
    )

    doctor = commands.add_parser(
        "doctor", help="pre-flight before joining: one line per check, exit 0 when a join would work"
    )
    add_network_flags(doctor)
    add_swarm_access(doctor)
    doctor.add_argument("--stage", default="auto", help="the stage to check the device for (as for join)")
    doctor.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    doctor.add_argument("--find-timeout", type=float, default=20.0, help="seconds to wait for the swarm config")

    keygen = commands.add_parser("keygen", help="write a new random key for a private swarm")
    keygen.add_argument("--swarm-key", dest="swarm_key_path", required=True, metavar="FILE", help="where to write it")

    status = commands.add_parser("status", help="print a snapshot of the swarm")
    add_swarm_access(status)
    add_json_output(status)

    dashboard = commands.add_parser("dashboard", help="live terminal view of the swarm (an observer: serves nothing)")
    add_swarm_access(dashboard)
    dashboard.add_argument("--once", action="store_true", help="print one frame and exit")
    dashboard.add_argument("--width", type=int, help="frame width for --once (default: the terminal's)")
    dashboard.add_argument("--refresh", type=float, default=1.5, help="seconds between refreshes")
    add_data_commands(commands)
    add_simulate_parser(commands)
    return parser


# a node's log lines, which tools read back (tests/benchmarks/bench_wire.py's round lines)
LOG_FORMAT, LOG_DATE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=LOG_FORMAT,
        datefmt=LOG_DATE_FORMAT,
        stream=sys.stderr,
    )


def print_bootstrap_addresses(maddrs: list[str]) -> None:
    print("swarm is up; other peers join with:", flush=True)
    for maddr in maddrs:
        print(f"  node join --initial-peers {maddr}", flush=True)
    founder = maddrs[0].rsplit("/p2p/", 1)[-1] if maddrs else "?"
    print(
        f"(joining through any other peer: add --swarm-founder {founder}; restarting this bootstrap on this "
        "machine keeps the founder's key, or choose its file with --identity FILE)",
        flush=True,
    )
    print(f"INITIAL_PEERS {' '.join(maddrs)}", flush=True)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from node.model.corpus import PreparedDataError, load_prepared
    from node.model.shards import DEFAULT_SHARD_BYTES, build_manifest
    from node.server import daemon
    from node.server.data_service import DataStore

    try:
        prepared = load_prepared(args.data_path) if args.data_path is not None else None
        store = None
        if prepared is not None:  # before the loop starts: hashing the data may take a while
            logger.info(f"hashing {prepared.directory} into its shard manifest")
            manifest = build_manifest(prepared.directory, args.shard_bytes or DEFAULT_SHARD_BYTES)
            store = DataStore(prepared.directory, manifest)
            logger.info(
                f"data: {len(manifest.shards)} shards, {manifest.total_bytes:,} bytes, manifest {manifest.hash}"
            )
        config = load_config(
            args.config,
            swarm_id=args.swarm_id,
            num_stages=args.num_stages,
            seed=args.seed,
            **{
                "heartbeat.period": args.heartbeat_period,
                "heartbeat.ttl": args.heartbeat_ttl,
                "model.preset": args.preset,
                # prepared data: the model's vocabulary is the tokenizer's, and the swarm remembers which one
                **(
                    {
                        "model.vocab_size": prepared.vocab_size,
                        "data.tokenizer_hash": prepared.tokenizer_hash,
                        "data.manifest_hash": store.hash,
                    }
                    if prepared and store
                    else {}
                ),
            },
        )
    except (ConfigError, PreparedDataError, ValueError, OSError) as e:  # ManifestError is a ValueError
        logger.error(f"bad config: {e}")
        return 2
    from dht.signing import MAX_RECORD_TTL

    if config.heartbeat.ttl > MAX_RECORD_TTL:
        logger.error(
            f"bad config: heartbeat ttl {config.heartbeat.ttl:g} s is longer than a signed record may live "
            f"({MAX_RECORD_TTL:g} s)"
        )
        return 2
    logger.info(f"starting swarm {config.swarm_id}: {config.num_stages} stages, config {config.config_hash()}")
    from node.monitor.metrics import NodeRole, serving_metrics

    options = node_options(args)
    with serving_metrics(args.metrics_host, args.metrics_port, NodeRole.FOUNDER, swarm_id=config.swarm_id) as metrics:
        if metrics is not None:
            options.on_network = metrics.attach_network
        return daemon.run(daemon.bootstrap(config, options, print_bootstrap_addresses, data=store))


def node_options(args: argparse.Namespace) -> Any:
    from node.server.daemon import NodeOptions

    options = NodeOptions(initial_peers=list(args.initial_peers), swarm_id=args.swarm_id)
    for name in (
        "host",
        "port",
        "identity_path",
        "announce_maddrs",
        "name",
        "stage",
        "throughput",
        "join_jitter",
        "swarm_founder",
        "find_timeout",
        "reachability",
        "direct_port",
        "direct_links",
        "relay_budget_gb",
        "relay_rate_mbit",
    ):
        if hasattr(args, name):
            setattr(options, name, getattr(args, name))
    if hasattr(args, "swarm_key_path"):
        from node.p2p.swarm_key import load_swarm_key

        options.swarm_key = load_swarm_key(args.swarm_key_path)  # SwarmKeyError: one line in main()
    return options


def cmd_keygen(args: argparse.Namespace) -> int:
    from node.p2p.swarm_key import generate_swarm_key, key_fingerprint

    key = generate_swarm_key(args.swarm_key_path)
    print(
        f"wrote a new swarm key to {args.swarm_key_path} (fingerprint {key_fingerprint(key)}); "
        "give it to every member over a private channel",
        flush=True,
    )
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from node.server import daemon

    if args.stage != "auto" and not args.stage.isdigit():
        logger.error(f"--stage must be 'auto' or a stage number, not {args.stage!r}")
        return 2
    from node.monitor.metrics import NodeRole, serving_metrics

    options = node_options(args)
    with serving_metrics(args.metrics_host, args.metrics_port, NodeRole.PEER, name=args.name) as metrics:
        if metrics is not None:
            options.on_network = metrics.attach_network
        serve = None
        if args.train:  # `--no-train`: a place in the registry, no stage service
            from functools import partial

            from node.server.stage_service import ServiceOptions, pick_device, serve_stage

            service_options = ServiceOptions(
                device=args.device,
                data_path=args.data_path,
                data_peers=data_peers(options),
                threads=args.threads,
                quiet=args.quiet,
                check_memory=args.check_memory,
            )
            if metrics is not None:
                service_options.meter, service_options.on_service = metrics.meter, metrics.attach_service
            serve = partial(serve_stage, options=service_options)
            if args.check_memory:  # --stage auto takes a stage this device holds
                options.memory_device = pick_device(args.device)
        return daemon.run(daemon.join(options, serve))


def data_peers(options: Any) -> tuple[str, ...]:
    """The founder, whom a stage-0 peer without --data asks for the swarm's data first (the join
    itself refuses an unclear founder, in one line)."""
    from node.server.daemon import JoinRefused, expected_founder

    try:
        return (expected_founder(options.initial_peers, options.swarm_founder),)
    except JoinRefused:
        return ()


def cmd_doctor(args: argparse.Namespace) -> int:
    from node.server import daemon
    from node.server.doctor import DoctorOptions, run_doctor

    if args.stage != "auto" and not args.stage.isdigit():
        logger.error(f"--stage must be 'auto' or a stage number, not {args.stage!r}")
        return 2
    options = DoctorOptions(initial_peers=list(args.initial_peers))
    for name in vars(options):
        if name != "initial_peers" and hasattr(args, name):
            setattr(options, name, getattr(args, name))
    from node.p2p.swarm_key import load_swarm_key

    options.swarm_key = load_swarm_key(args.swarm_key_path)  # SwarmKeyError: one line in main()

    async def check() -> int:
        ready = await run_doctor(options, lambda result: print(result.line(), flush=True))
        print("ready to join" if ready else "not ready to join: fix the failed checks above", flush=True)
        return 0 if ready else 1

    return daemon.run(check())


def cmd_status(args: argparse.Namespace) -> int:
    from node.monitor.observer import observe_once
    from node.monitor.status import format_table
    from node.p2p.swarm_key import load_swarm_key
    from node.server import daemon

    swarm_key = load_swarm_key(args.swarm_key_path)  # SwarmKeyError: one line in main()
    result: dict[str, Any] = {}

    async def collect() -> int:
        result.update(
            await observe_once(args.initial_peers, args.swarm_id, founder=args.swarm_founder, swarm_key=swarm_key)
        )
        return 0

    code = daemon.run(collect())
    if code == 0:
        print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return code


def cmd_dashboard(args: argparse.Namespace) -> int:
    import shutil

    from node.monitor.dashboard import render_once, run_live
    from node.monitor.observer import ReconnectingObserver
    from node.p2p.swarm_key import load_swarm_key
    from node.server import daemon

    swarm_key = load_swarm_key(args.swarm_key_path)  # SwarmKeyError: one line in main()
    observer = ReconnectingObserver(args.initial_peers, args.swarm_id, founder=args.swarm_founder, swarm_key=swarm_key)

    async def once() -> int:
        for attempt in range(3):
            try:
                frame = render_once(await observer.snapshot(), args.width or shutil.get_terminal_size().columns)
                print(frame, end="", flush=True)
                return 0
            except daemon.JoinRefused:
                raise
            except Exception as e:
                logger.warning(f"swarm not reachable yet ({e}); retrying ({attempt + 1}/3)")
                await asyncio.sleep(2.0)
            finally:
                await observer.close()
        logger.error("could not reach the swarm through " + " ".join(args.initial_peers))
        return 4

    async def live() -> int:
        # log lines written to the terminal would draw over the full-screen view
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
        try:
            return await run_live(observer.snapshot, refresh=args.refresh)
        finally:
            await observer.close()

    return daemon.run(once() if args.once else live())


COMMANDS = {
    "prepare-data": cmd_prepare_data,
    "export": cmd_export,
    "generate": cmd_generate,
    "bootstrap": cmd_bootstrap,
    "join": cmd_join,
    "status": cmd_status,
    "dashboard": cmd_dashboard,
    "keygen": cmd_keygen,
    "doctor": cmd_doctor,
    "simulate": cmd_simulate,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    from node.p2p.peer_conduct import raise_fd_soft_limit
    from node.p2p.swarm_key import SwarmKeyError

    if args.command in ("bootstrap", "join", "doctor"):
        # before p2pd starts, so that it inherits the limit: many peers and streams need many descriptors
        logger.info(f"open-file limit: {raise_fd_soft_limit()}")
    from node.monitor.metrics import MetricsError  # after the first log line: it imports hivemind and torch

    try:
        return COMMANDS[args.command](args)
    except (SwarmKeyError, MetricsError) as e:
        logger.error(f"refusing to start: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
