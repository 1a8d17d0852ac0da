"""Shared fixtures: a multi-process swarm on loopback that always cleans up after itself, and torch
on one thread for the tests of tiny models."""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture
def one_thread():
    """Tiny matrices: intra-op threads only contend on the shared cores (10x slower with 2); the
    thread count is put back after the test. A test module takes it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
