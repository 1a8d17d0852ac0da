"""Two home peers behind two different NAT routers in one swarm (`make internet`).

Hosts (tests/helpers/netns.py): `boot` and `pub` are public; `home_a` and `home_b` each sit on
their own LAN behind a masquerading router that drops every connection coming in, so neither home
can dial the other. Peers: the bootstrapper (declared `--reachability public`, as a server operator
would: AutoNAT cannot confirm a private-range address) and a public stage-1 peer on `boot`, a
stage-0 peer on `pub`, a stage-0 peer on `home_a` and a stage-1 peer on `home_b`, both homes with
`--reachability private`.

A relayed circuit ends after 128 KiB (measured; docs/operations.md), too little for a hop, so two
relayed peers keep apart (node/p2p/reachability.py `carries_training`): the home stage-0 peer
routes to the public stage-1 peer, not to the other home, the home stage-1 peer serves the
public stage-0 peer. Asserted: both homes announce `relay` reachability, both make progress, over a
minute of training the home stage-0 peer never banned the other home (what a failed hop to it
would cause), and no process crashed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dht.records import short_peer_id
from node.local_swarm import NodeProcess, Swarm, wait_for
from tests.helpers.netns import TestBed
from tests.helpers.swarms import make_swarm, peer_id_of
from tests.netns.test_swarm_internet import peer, require_namespaces

COMMON = ("--threads", "1", "--quiet", "--join-jitter", "0")


def start_two_home_swarm(bed: TestBed, swarm: Swarm, workdir: Path) -> tuple[dict[str, NodeProcess], dict[str, str]]:
    """The five peers above; their processes and peer ids by name."""
    config = workdir / "swarm.toml"
    config.write_text("[gossip]\ninner_steps = 10\n[training]\nhop_timeout = 10.0\n")
    swarm.bootstrap(
        "--num-stages",
        "2",
        "--heartbeat-period",
        "2",
        "--heartbeat-ttl",
        "10",
        "--reachability",
        "public",
        "--config",
        str(config),
        host=bed.address("boot"),
        launcher=bed.launcher("boot"),
        timeout=90,
    )
    placement = {
        "public1": ("boot", "1", ()),
        "public0": ("pub", "0", ()),
        "home0": ("home_a", "0", ("--reachability", "private")),
        "home1": ("home_b", "1", ("--reachability", "private")),
    }
    nodes = {
        name: swarm.join(name, "--stage", stage, *extra, *COMMON, host=bed.address(host), launcher=bed.launcher(host))
        for name, (host, stage, extra) in placement.items()
    }
    ids = wait_for(
        lambda: all(map(peer_id_of, nodes.values())) and {name: peer_id_of(node) for name, node in nodes.items()},
        150,
        lambda: "peers never joined:\n" + "\n".join(f"--- {n}\n{node.log()[-2000:]}" for n, node in nodes.items()),
    )
    return nodes, ids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_home_peers_behind_different_nats_train_beside_each_other(tmp_path: Path):
    require_namespaces()
    with TestBed() as bed:
        bed.add_public_host("boot")
        bed.add_public_host("pub")
        bed.add_home_host("home_a")
        bed.add_home_host("home_b")
        swarm = make_swarm(tmp_path)
        try:
            nodes, ids = start_two_home_swarm(bed, swarm, tmp_path)

            def record(name: str) -> dict | None:
                return peer(swarm.status(launcher=bed.launcher("pub"), timeout=90), ids[name])

            for name in ("home0", "home1"):
                r = wait_for(
                    lambda name=name: (r := record(name)) and r["state"] == "online" and r["inner_step"] > 0 and r,
                    240,
                    lambda name=name: f"{name} never trained: {record(name)}\n{nodes[name].log()[-3000:]}",
                )
                assert r["reachability"] == "relay", r
            names = ("home0", "public0", "home1", "public1")
            first = {name: record(name)["inner_step"] for name in names}
            started, home0_log = time.monotonic(), len(nodes["home0"].log())
            time.sleep(60)
            last = {name: record(name)["inner_step"] for name in names}
            seconds = time.monotonic() - started
            made = {name: last[name] - first[name] for name in names}
            print(
                f"two homes, {seconds:.0f} s: inner steps made: stage 0: home0 (NAT A) {made['home0']}, "
                f"public0 {made['public0']}; stage 1: home1 (NAT B) {made['home1']}, public1 {made['public1']}; "
                f"homes' share: stage 0 {made['home0'] / max(1, made['home0'] + made['public0']):.0%}, "
                f"stage 1 {made['home1'] / max(1, made['home1'] + made['public1']):.0%}"
            )
            assert made["home0"] > 10 and made["home1"] > 10, made
            home1 = short_peer_id(ids["home1"])
            # while home1 was the only stage-1 peer online, home0 tried it (and banned it); not since
            assert f"banned {home1}" not in nodes["home0"].log()[home0_log:], nodes["home0"].log()[-3000:]
            for name, node in nodes.items():
                assert node.process.poll() is None, f"{name} died:\n{node.log()[-2000:]}"
                assert "Traceback" not in node.log(), f"{name}:\n{node.log()[-3000:]}"
        finally:
            swarm.close()
