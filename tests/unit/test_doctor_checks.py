"""node/server/doctor.py's checks that need no network: port, clock offset, versions, reachability,
memory, and the stage a join would take."""

from __future__ import annotations

import socket

from dht.records import PeerRecord, PeerState
from node import __version__
from node.config import SwarmConfig
from node.model.memory import DeviceMemory, estimate_stage_memory
from node.p2p.reachability import NatReachability
from node.server.doctor import (
    CLOCK_FAIL_SECONDS,
    Outcome,
    check_clock,
    check_memory,
    check_port,
    check_reachability,
    check_versions,
    clock_offset,
    stage_for,
)
from protocol.version import PROTOCOL_VERSION

PERIOD = 2.0


def record(peer: str, stage: int, updated: float, throughput: float = 1.0, state=PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=peer, stage=stage, state=state, throughput=throughput, updated=updated)


def test_a_port_in_use_fails_and_a_free_one_passes():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        busy = check_port("127.0.0.1", port)
        assert busy.outcome == Outcome.FAIL and "in use" in busy.found and busy.fix
    assert check_port("127.0.0.1", port).outcome == Outcome.OK
    assert check_port("127.0.0.1", 0).outcome == Outcome.OK


def test_clock_offset_is_the_median_of_the_records_corrected_by_half_a_period():
    now = 1_000_000.0
    # three peers whose clocks agree with ours, records 0.2, 1.0 and 1.9 s old
    agreeing = [record(f"p{i}", 1, now - age) for i, age in enumerate((0.2, 1.0, 1.9))]
    offset, uncertainty = clock_offset(agreeing, now, PERIOD)
    assert abs(offset) <= uncertainty and uncertainty == PERIOD / 2
    assert check_clock(agreeing, now, PERIOD).outcome == Outcome.OK
    # the same swarm 30 s ahead of us: caught, and one liar cannot move the median far
    ahead = [record(r.peer_id, 1, r.updated + 30.0) for r in agreeing]
    assert check_clock(ahead, now, PERIOD).outcome == Outcome.FAIL
    liar = [*agreeing, record("liar", 1, now + 3600.0)]
    assert abs(clock_offset(liar, now, PERIOD)[0]) < 2.0
    # a few seconds off is a warning, leaving peers and unstamped records do not count
    slightly = [record(r.peer_id, 1, r.updated + 3.0) for r in agreeing]
    assert check_clock(slightly, now, PERIOD).outcome == Outcome.WARN
    assert clock_offset([record("x", 1, 0.0), record("y", 1, now + 99, state=PeerState.LEAVING)], now, PERIOD) is None
    assert check_clock([], now, PERIOD).outcome == Outcome.WARN
    assert CLOCK_FAIL_SECONDS < 30.0


def test_versions_fail_on_another_protocol_and_warn_on_another_release():
    assert check_versions(PROTOCOL_VERSION, __version__).outcome == Outcome.OK
    assert check_versions(PROTOCOL_VERSION + 1, __version__).outcome == Outcome.FAIL
    assert check_versions(PROTOCOL_VERSION, __version__ + ".post1").outcome == Outcome.WARN


def test_reachability_reads_the_announced_addresses():
    public = check_reachability(["/ip4/127.0.0.1/tcp/4000/p2p/QmX"], NatReachability.AUTO)
    assert public.outcome == Outcome.OK and public.found.startswith("public")
    relayed = check_reachability(
        ["/ip4/10.78.1.2/tcp/4000", "/ip4/10.77.0.1/tcp/5000/p2p/QmRelay/p2p-circuit"], NatReachability.PRIVATE
    )
    assert relayed.outcome == Outcome.OK and relayed.found.startswith("via relay") and "--announce" in relayed.fix
    assert check_reachability([], NatReachability.AUTO).outcome == Outcome.FAIL


def test_memory_fails_when_the_device_cannot_hold_the_stage():
    config = SwarmConfig()
    need = estimate_stage_memory(config, 1).total  # at max_in_flight
    least = estimate_stage_memory(config, 1, config.training.min_in_flight).total
    wide = check_memory(1, config, "cpu", lambda device: DeviceMemory(device, need * 2))
    assert wide.outcome == Outcome.OK and f"with {config.training.max_in_flight} microbatches in flight" in wide.found
    # less than the widest window needs, more than the narrowest: OK, with a narrower window
    narrow = check_memory(1, config, "cpu", lambda device: DeviceMemory(device, (need + least) // 2))
    assert narrow.outcome == Outcome.OK and "microbatches in flight" in narrow.found
    assert f"with {config.training.max_in_flight} " not in narrow.found
    small = check_memory(1, config, "cpu", lambda device: DeviceMemory(device, least // 2))
    assert small.outcome == Outcome.FAIL and "stage 1" in small.found

    def no_device(device: str) -> DeviceMemory:
        raise RuntimeError("no CUDA GPUs are available")

    assert check_memory(1, config, "cuda", no_device).outcome == Outcome.FAIL


def test_the_stage_checked_is_the_one_a_join_would_take():
    peers = {0: [record("a", 0, 1.0)], 1: [record("b", 1, 1.0, throughput=5.0)], 2: []}
    assert stage_for("auto", peers, 3) == 2
    assert stage_for("1", peers, 3) == 1
    assert stage_for("7", peers, 3) is None
