"""Shared fixtures: a multi-process swarm on loopback that always cleans up after itself.

`make test` runs two pytest-xdist workers with `--dist loadgroup`: every test under tests/swarm and
tests/netns is in one group, so swarms (their processes, namespaces and timing) never overlap one
another, while the unit tests run on the other worker beside them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.swarms import make_swarm


@pytest.fixture
def swarm(tmp_path):
    swarm = make_swarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close()
        leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
        assert not leftovers, f"processes left behind: {leftovers}"


SWARM_DIRS = ("swarm", "netns")  # tests that start daemons, processes or namespaces


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        relative = Path(str(item.path)).resolve().relative_to(tests_dir)
        if relative.parts[0] in SWARM_DIRS:
            item.add_marker(pytest.mark.xdist_group("swarms"))
