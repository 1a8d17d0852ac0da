"""`node` / `pipeswarm` / `python -m node`: bootstrap, join, status, dashboard."""

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
from node.config import ConfigError
from node.model.presets import PresetName, load_config
from node.p2p.reachability import NatReachability
from node.simulate.names import ExperimentName, SimPreset

logger = logging.getLogger("node")


def add_network_flags(parser: argparse.ArgumentParser, listening: bool = True) -> None:
    if listening:
        parser.add_argument("--host", default="0.0.0.0", help="listen address (default: all interfaces)")
        parser.add_argument("--port", type=int, default=0, help="listen port (default: any free port)")
        parser.add_argument(
            "--identity", dest="identity_path", help="private key file: keeps the peer id across restarts"
        )
        parser.add_argument(
            "--swarm-key",
            dest="swarm_key_path",
            metavar="FILE",
            help="private swarm: the shared key file (`node keygen --swarm-key FILE`); "
            "default: $PIPESWARM_SWARM_KEY_FILE, else an open swarm",
        )
        parser.add_argument(
            "--announce",
            dest="announce_maddrs",
            nargs="*",
            default=[],
            help="multiaddrs to announce instead of the listen ones (a port forwarded on a home router)",
        )
        parser.add_argument(
            "--reachability",
            choices=[r.value for r in NatReachability],
            default=NatReachability.AUTO.value,
            help="auto: let AutoNAT tell whether others can dial us, and take relay reservations if "
            "not; private: behind a NAT for sure (reserve relay slots at once); public: never use relays",
        )


def add_initial_peers(parser: argparse.ArgumentParser, required: bool = True, founder: bool = True) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        required=required,
        default=[],
        metavar="MADDR",
        help="multiaddr(s) of peers already in the swarm, as printed by `node bootstrap`",
    )
    parser.add_argument("--swarm", dest="swarm_id", help="swarm id, when several swarms share one DHT")
    if founder:
        parser.add_argument(
            "--swarm-founder",
            metavar="PEER_ID",
            help="peer id of the swarm's founder (its bootstrapper), whose signed config is the "
            "only one trusted; default: the peer id in --initial-peers (needed when those name "
            "another peer, or several)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="node", description="pipeswarm: peer-to-peer pipeline training")
    parser.add_argument("--version", action="version", version=f"pipeswarm {__version__}")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    boot = commands.add_parser("bootstrap", help="start a new swarm and stay up as its DHT anchor")
    add_network_flags(boot)
    boot.add_argument("--config", help="TOML file with the swarm config (sections model, training, gossip, ...)")
    boot.add_argument("--swarm-id", help="name of the new swarm")
    boot.add_argument("--num-stages", type=int, help="pipeline stages, counting stage 0 (embedding + head)")
    boot.add_argument("--seed", type=int, help="swarm seed: initial weights and synthetic data derive from it")
    boot.add_argument(
        "--preset",
        metavar="NAME",
        help=f"model shape ({', '.join(p.value for p in PresetName)}; docs/model.md): fills the [model] "
        "section, keys written there win",
    )
    boot.add_argument("--heartbeat-period", type=float, help="seconds between peer record announcements")
    boot.add_argument("--heartbeat-ttl", type=float, help="seconds a peer record lives without a heartbeat")
    add_initial_peers(boot, required=False, founder=False)

    join = commands.add_parser("join", help="join a swarm and serve a stage")
    add_network_flags(join)
    add_initial_peers(join)
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
        help="stage 0 data: UTF-8 text file or uint16 token .bin file (default: the swarm's synthetic source)",
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

    keygen = commands.add_parser("keygen", help="write a new random key for a private swarm")
    keygen.add_argument("--swarm-key", dest="swarm_key_path", required=True, metavar="FILE", help="where to write it")

    status = commands.add_parser("status", help="print a snapshot of the swarm")
    add_initial_peers(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    dashboard = commands.add_parser("dashboard", help="live terminal view of the swarm (an observer: serves nothing)")
    add_initial_peers(dashboard)
    dashboard.add_argument("--once", action="store_true", help="print one frame and exit")
    dashboard.add_argument("--width", type=int, help="frame width for --once (default: the terminal's)")
    dashboard.add_argument("--refresh", type=float, default=1.5, help="seconds between refreshes")
    add_simulate_parser(commands)
    return parser


def add_simulate_parser(commands: Any) -> None:
    """`node simulate EXPERIMENT`: flags left unset keep the preset's value (node/simulate/experiments.py)."""
    sim = commands.add_parser("simulate", help="S stages x R replicas in one process on a simulated clock")
    sim.add_argument("experiment", choices=[e.value for e in ExperimentName])
    sim.add_argument("--preset", choices=[p.value for p in SimPreset], default=SimPreset.DEFAULT.value)
    sim.add_argument("--out", default="simulate-out", help="directory for CSV, JSON and PNG files")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    numbers = {
        "--steps": (int, "iterations per run"),
        "--stages": (int, "pipeline stages counting stage 0"),
        "--replicas": (int, "replicas per stage"),
        "--seed": (int, "seed of the model, data and failure schedule"),
        "--latency-ms": (float, "one-way link latency (default 50)"),
        "--bandwidth-mbit": (float, "link bandwidth (default 100)"),
        "--compute-ms": (float, "clock charge of one microbatch-stage (default: measured)"),
        "--inner-steps": (int, "H: inner steps between outer rounds"),
        "--failures-from": (int, "recovery: first iteration that may fail"),
        "--checkpoint-every": (int, "recovery: K iterations between saves"),
        "--checkpoint-save-s": (float, "recovery: fixed cost of a save"),
        "--restart-s": (float, "recovery: restart cost after a rollback"),
        "--target-loss": (float, "recovery: loss whose wall-clock is reported"),
        "--max-replicas": (int, "sync-scaling: largest N"),
    }
    for flag, (kind, text) in numbers.items():
        sim.add_argument(flag, type=kind, help=text)
    sim.add_argument(
        "--failure-rate-per-hour", dest="failure_percent_per_hour", type=float, help="recovery: per stage, in %%/h"
    )
    sim.add_argument("--model-preset", choices=[p.value for p in PresetName], help="sync-scaling: the payload model")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def print_bootstrap_addresses(maddrs: list[str]) -> None:
    print("swarm is up; other peers join with:", flush=True)
    for maddr in maddrs:
        print(f"  node join --initial-peers {maddr}", flush=True)
    founder = maddrs[0].rsplit("/p2p/", 1)[-1] if maddrs else "?"
    print(
        f"(joining through any other peer: add --swarm-founder {founder}; keep this founder's key with "
        "--identity FILE to restart it)",
        flush=True,
    )
    print(f"INITIAL_PEERS {' '.join(maddrs)}", flush=True)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from node.server import daemon

    try:
        config = load_config(
            args.config,
            swarm_id=args.swarm_id,
            num_stages=args.num_stages,
            seed=args.seed,
            **{
                "heartbeat.period": args.heartbeat_period,
                "heartbeat.ttl": args.heartbeat_ttl,
                "model.preset": args.preset,
            },
        )
    except ConfigError as e:
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
    return daemon.run(daemon.bootstrap(config, node_options(args), print_bootstrap_addresses))


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
    serve = None
    if args.train:
        from functools import partial

        from node.server.stage_service import ServiceOptions, serve_stage

        options = ServiceOptions(
            device=args.device,
            data_path=args.data_path,
            threads=args.threads,
            quiet=args.quiet,
            check_memory=args.check_memory,
        )
        serve = partial(serve_stage, options=options)
    return daemon.run(daemon.join(node_options(args), serve))


def cmd_status(args: argparse.Namespace) -> int:
    from node.monitor.observer import observe_once
    from node.monitor.status import format_table
    from node.server import daemon

    result: dict[str, Any] = {}

    async def collect() -> int:
        result.update(await observe_once(args.initial_peers, args.swarm_id, founder=args.swarm_founder))
        return 0

    code = daemon.run(collect())
    if code == 0:
        print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return code


def cmd_dashboard(args: argparse.Namespace) -> int:
    import shutil

    from node.monitor.dashboard import render_once, run_live
    from node.monitor.observer import ReconnectingObserver
    from node.server import daemon

    observer = ReconnectingObserver(args.initial_peers, args.swarm_id, founder=args.swarm_founder)

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


def cmd_simulate(args: argparse.Namespace) -> int:
    from node.simulate.experiments import run_experiment

    skip = {"command", "log_level", "experiment", "preset", "out", "no_progress"}
    overrides = {key: value for key, value in vars(args).items() if key not in skip and value is not None}
    if "model_preset" in overrides:
        overrides["model_preset"] = PresetName(overrides["model_preset"])
    summary = run_experiment(args.experiment, args.out, args.preset, overrides, progress=not args.no_progress)
    print(json.dumps(summary.get("variants") or summary.get("largest"), indent=1, default=str))
    print(f"results in {args.out}", flush=True)
    return 0


COMMANDS = {
    "bootstrap": cmd_bootstrap,
    "join": cmd_join,
    "status": cmd_status,
    "dashboard": cmd_dashboard,
    "keygen": cmd_keygen,
    "simulate": cmd_simulate,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    from node.p2p.peer_conduct import raise_fd_soft_limit
    from node.p2p.swarm_key import SwarmKeyError

    if args.command in ("bootstrap", "join"):
        # before p2pd starts, so that it inherits the limit: many peers and streams need many descriptors
        logger.info(f"open-file limit: {raise_fd_soft_limit()}")

    try:
        return COMMANDS[args.command](args)
    except SwarmKeyError as e:
        logger.error(f"refusing to start: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
