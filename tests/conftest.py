"""Shared fixtures: a multi-process swarm on loopback that always cleans up after itself."""

from __future__ import annotations

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
