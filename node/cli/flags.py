"""Flags several `node` commands share."""

from __future__ import annotations

import argparse

from node.p2p.reachability import NatReachability


def add_network_flags(parser: argparse.ArgumentParser, listening: bool = True) -> None:
    if listening:
        parser.add_argument("--host", default="0.0.0.0", help="listen address (default: all interfaces)")
        parser.add_argument("--port", type=int, default=0, help="listen port (default: any free port)")
        parser.add_argument(
            "--identity",
            dest="identity_path",
            metavar="FILE",
            help="private key file (created if missing); default: a key kept per swarm (bootstrap) or per "
            "--name (join) in $XDG_STATE_HOME/pipeswarm, so a restart keeps the peer id",
        )
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
