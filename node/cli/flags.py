"""Flags several `node` commands share: one helper per concept, so that a flag means the same (dest,
metavar, help, default) in every command that takes it (tests/unit/test_cli_vocabulary.py)."""

from __future__ import annotations

import argparse

from node.p2p.reachability import NatReachability


def add_initial_peers(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        required=required,
        default=[],
        metavar="MADDR",
        help="multiaddr(s) of peers already in the swarm, as printed by `node bootstrap`",
    )


def add_swarm_id(parser: argparse.ArgumentParser) -> None:
    # bootstrap took --swarm-id and the other commands --swarm: both spellings work everywhere
    parser.add_argument(
        "--swarm",
        "--swarm-id",
        dest="swarm_id",
        metavar="ID",
        help="swarm id, when several swarms share one DHT (bootstrap: the new swarm's name)",
    )


def add_swarm_founder(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--swarm-founder",
        metavar="PEER_ID",
        help="peer id of the swarm's founder (its bootstrapper), whose signed config is the "
        "only one trusted; default: the peer id in --initial-peers (needed when those name "
        "another peer, or several)",
    )


def add_swarm_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--swarm-key",
        dest="swarm_key_path",
        metavar="FILE",
        help="private swarm: the shared key file (`node keygen --swarm-key FILE`); "
        "default: $PIPESWARM_SWARM_KEY_FILE, else an open swarm",
    )


def add_swarm_access(parser: argparse.ArgumentParser, peers_required: bool = True, founder: bool = True) -> None:
    """What every command that talks to a swarm takes: where to find it, which one, whom to trust for
    its config (not bootstrap: it is the founder), and a private swarm's key."""
    add_initial_peers(parser, required=peers_required)
    add_swarm_id(parser)
    if founder:
        add_swarm_founder(parser)
    add_swarm_key(parser)


def add_identity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--identity",
        dest="identity_path",
        metavar="FILE",
        help="private key file, the peer id (created if missing); default: bootstrap keeps one per swarm "
        "and join one per --name in $XDG_STATE_HOME/pipeswarm, so a restart keeps the peer id; "
        "doctor uses a throwaway key",
    )


def add_json_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (JSON) instead of a table")


def add_network_flags(parser: argparse.ArgumentParser) -> None:
    """How a listening peer (bootstrap, join, doctor) is reached: address, port, metrics, links."""
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: all interfaces)")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: any free port)")
    add_identity(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port; default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server listens on (default: 127.0.0.1, this machine only)",
    )
    parser.add_argument(
        "--announce",
        dest="announce_maddrs",
        nargs="*",
        default=[],
        help="multiaddrs to announce instead of the listen ones (a port forwarded on a home router)",
    )
    parser.add_argument(
        "--direct-port",
        type=int,
        default=0,
        metavar="PORT",
        help="TCP port for direct links, which carry pipeline traffic to peers that can reach it "
        "without going through p2pd (default: any free port; open it beside --port on a firewall)",
    )
    parser.add_argument(
        "--no-direct-links",
        dest="direct_links",
        action="store_false",
        help="carry all traffic through libp2p (p2pd): no direct-link port is opened or dialed",
    )
    parser.add_argument(
        "--reachability",
        choices=[r.value for r in NatReachability],
        default=NatReachability.AUTO.value,
        help="auto: let AutoNAT tell whether others can dial us, and take relay reservations if "
        "not; private: behind a NAT for sure (reserve relay slots at once); public: never use relays",
    )


def add_relay_flags(parser: argparse.ArgumentParser) -> None:
    """A joining peer's offer to relay for peers behind NATs (node/p2p/relay.py)."""
    parser.add_argument(
        "--relay-budget",
        dest="relay_budget_gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="volunteer as a relay for peers behind NATs (a publicly reachable peer): introduce them "
        "to each other for hole punching, and carry up to GB gigabytes between those that cannot "
        "punch (default 0: no relay)",
    )
    parser.add_argument(
        "--relay-rate",
        dest="relay_rate_mbit",
        type=float,
        default=50.0,
        metavar="MBIT",
        help="the most a relay carries, in Mbit/s, all links together (default 50)",
    )
