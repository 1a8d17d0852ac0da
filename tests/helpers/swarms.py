"""How the tests make a multi-process swarm: open by default, private when asked.

`PIPESWARM_TEST_PRIVATE=1` (`make test-private`) gives every test swarm a fresh key made like
`node keygen` does, in `PIPESWARM_SWARM_KEY_FILE` of the children's environment: every peer,
`node status` included, then runs the private swarm's MACs on every record and stream message, so
the whole small-swarm suite shows a private swarm behaves as an open one.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from node.local_swarm import NodeProcess, Swarm, peers_by_stage, wait_for
from node.p2p.swarm_key import ENV_VAR, generate_swarm_key
from tests.helpers.netns import TestBed, bed_with_hosts

PRIVATE_MODE_VAR = "PIPESWARM_TEST_PRIVATE"


def private_mode() -> bool:
    return os.environ.get(PRIVATE_MODE_VAR, "") not in ("", "0")


# how a test peer joins: one compute thread (the suite shares two cores), nothing on the console
PEER_FLAGS = ("--threads", "1", "--quiet")

# a joiner's random wait before it takes its stage, short: the peers of a recovery or chaos swarm,
# started at once, still reach the DHT one after another
SHORT_JOIN_JITTER = ("--join-jitter", "0.5")

# the small test swarms' heartbeat: a record every second, living 5 s, so that a peer that died
# leaves every view within seconds and a test need not wait out the default 30 s TTL
FAST_HEARTBEAT = ("--heartbeat-period", "1", "--heartbeat-ttl", "5")


def bootstrap_fast(
    swarm: Swarm, num_stages: int, config: Path | None = None, timeout: float = 60.0, extra: tuple[str, ...] = ()
) -> NodeProcess:
    """Start `swarm`'s founder for a small test swarm: `num_stages` stages, FAST_HEARTBEAT, the
    swarm config file `config` when given, then the `extra` flags."""
    with_config = ("--config", str(config)) if config is not None else ()
    return swarm.bootstrap("--num-stages", str(num_stages), *FAST_HEARTBEAT, *with_config, *extra, timeout=timeout)


# the namespace test bed's swarms: a record every 2 s living 10 s (their links may be slow and lossy)
TESTBED_HEARTBEAT = ("--heartbeat-period", "2", "--heartbeat-ttl", "10")


def bootstrap_on(bed: TestBed, host: str, swarm: Swarm, num_stages: int, config: Path, *extra: str) -> NodeProcess:
    """`swarm`'s founder on the test bed's `host`: `num_stages` stages, TESTBED_HEARTBEAT, the swarm
    config file `config`, then the `extra` flags."""
    return swarm.bootstrap(
        *("--num-stages", str(num_stages), *TESTBED_HEARTBEAT, "--config", str(config), *extra),
        host=bed.address(host),
        launcher=bed.launcher(host),
        timeout=90,
    )


def join_placed(
    bed: TestBed, swarm: Swarm, placement: dict[str, tuple[str, int | str, tuple[str, ...]]]
) -> dict[str, NodeProcess]:
    """A test peer for each name of `placement`, (host, stage, extra flags): joined from its host
    of the test bed, without the join jitter; by name, in the placement's order."""
    return {
        name: join_peer(
            swarm, name, stage, "--join-jitter", "0", *extra, host=bed.address(host), launcher=bed.launcher(host)
        )
        for name, (host, stage, extra) in placement.items()
    }


def join_peer(swarm: Swarm, name: str, stage: int | str, *extra: str, **options) -> NodeProcess:
    """A test peer `name` joining `swarm` at `stage` with PEER_FLAGS, then `extra` flags;
    `options` go to Swarm.join (host, launcher, python_prefix)."""
    return swarm.join(name, "--stage", str(stage), *PEER_FLAGS, *extra, **options)


def start_small_swarm(
    swarm: Swarm, num_stages: int, stages: Iterable[int], config: Path | None = None, timeout: float = 60.0
) -> list[NodeProcess]:
    """A small test swarm: its founder (`bootstrap_fast`), then a peer `peer{i}` at each entry of
    `stages`; the joiners' processes (not yet online: see `wait_online`)."""
    bootstrap_fast(swarm, num_stages, config, timeout=timeout)
    return [join_peer(swarm, f"peer{i}", stage) for i, stage in enumerate(stages)]


def wait_online(swarm: Swarm, count: int, timeout: float, nodes: Iterable[NodeProcess] | None = None) -> None:
    """Until `count` peers of `swarm` are online in its observer's view; on a timeout, the tails of
    the logs of `nodes` (every process of the swarm unless named)."""
    watched = list(swarm.nodes if nodes is None else nodes)
    wait_for(
        lambda: sum(map(len, peers_by_stage(swarm.observe()).values())) == count,
        timeout,
        lambda: "peers never came online:\n" + "\n".join(n.log()[-1500:] for n in watched),
    )


def wait_for_peer_ids(nodes: dict[str, NodeProcess], timeout: float = 150.0) -> dict[str, str]:
    """The peer id each of `nodes` logs once it took its stage, by name; on a timeout, their logs' tails."""
    return wait_for(
        lambda: all(map(peer_id_of, nodes.values())) and {name: peer_id_of(node) for name, node in nodes.items()},
        timeout,
        lambda: "peers never joined:\n" + "\n".join(f"--- {n}\n{node.log()[-2000:]}" for n, node in nodes.items()),
    )


@contextlib.contextmanager
def swarm_on_bed(
    workdir: Path, public: Iterable[str], homes: Iterable[str] = (), symmetric: Iterable[str] = ()
) -> Iterator[tuple[TestBed, Swarm]]:
    """A namespace test bed of `bed_with_hosts(public, homes, symmetric)` and a swarm to start in it from
    `workdir`: the swarm's processes are ended before the bed is taken down."""
    with bed_with_hosts(public, homes, symmetric) as bed:
        swarm = make_swarm(workdir)
        try:
            yield bed, swarm
        finally:
            swarm.close()


def make_swarm(workdir: Path) -> Swarm:
    env: dict[str, str] = {}
    if private_mode():
        key_path = workdir / "test-swarm.key"
        if not key_path.exists():
            generate_swarm_key(key_path)
        env[ENV_VAR] = str(key_path)
    return Swarm(workdir, env=env)


def peer_id_of(node: NodeProcess) -> str | None:
    """The peer id a joiner logged once it took its stage (None before that)."""
    found = re.search(r"peer (\S+) serves stage", node.log())
    return found.group(1) if found else None
