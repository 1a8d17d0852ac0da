"""How the tests make a multi-process swarm: open by default, private when asked.

`PIPESWARM_TEST_PRIVATE=1` (`make test-private`) gives every test swarm a fresh key made like
`node keygen` does, in `PIPESWARM_SWARM_KEY_FILE` of the children's environment: every peer,
`node status` included, then runs the private swarm's MACs on every record and stream message, so
the whole small-swarm suite shows a private swarm behaves as an open one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from node.local_swarm import NodeProcess, Swarm
from node.p2p.swarm_key import ENV_VAR, generate_swarm_key

PRIVATE_MODE_VAR = "PIPESWARM_TEST_PRIVATE"


def private_mode() -> bool:
    return os.environ.get(PRIVATE_MODE_VAR, "") not in ("", "0")


# the small test swarms' heartbeat: a record every second, living 5 s, so that a peer that died
# leaves every view within seconds and a test need not wait out the default 30 s TTL
FAST_HEARTBEAT = ("--heartbeat-period", "1", "--heartbeat-ttl", "5")


def bootstrap_fast(swarm: Swarm, num_stages: int, config: Path | None = None, timeout: float = 60.0) -> NodeProcess:
    """Start `swarm`'s founder for a small test swarm: `num_stages` stages, FAST_HEARTBEAT, and the
    swarm config file `config` when given."""
    extra = ("--config", str(config)) if config is not None else ()
    return swarm.bootstrap("--num-stages", str(num_stages), *FAST_HEARTBEAT, *extra, timeout=timeout)


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
