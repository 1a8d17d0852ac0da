"""Prometheus metrics without a swarm: the Meter, the byte counting streams, the collector, the server."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dht.records import PeerState
from node.averaging.outer_replica import RoundStatus
from node.monitor.metrics import SERVICE_COUNTERS, MetricsError, NodeMetrics, NodeRole
from node.p2p.metered_stream import metered
from node.pipeline.hops import PipelineStats
from node.pipeline.routing import BanList
from node.pipeline.validation import ValidationResult
from node.runtime.device import DeviceTransfers
from node.runtime.meter import LATENCY_BUCKETS, ComputePass, Direction, Meter, Tally
from node.server.progress import ProgressDisplay, ServiceSummary
from node.server.stage_service import StageService


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition, through prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    meter = Meter()
    for seconds in (0.001, 0.004, 0.3, 99.0):
        meter.compute(ComputePass.FORWARD, seconds)
    histogram = meter.snapshot().compute[ComputePass.FORWARD]
    buckets = dict(histogram.cumulative())
    assert buckets["0.001"] == 1  # le: a value on the bound belongs to it
    assert buckets["0.005"] == 2 and buckets["0.5"] == 3 and buckets["30.0"] == 3 and buckets["+Inf"] == 4
    assert len(buckets) == len(LATENCY_BUCKETS) + 1
    assert histogram.total == pytest.approx(99.305)


def test_timed_records_only_a_microbatchs_passes():
    meter = Meter()

    def forward(x):
        return x + 1

    def backward(x):
        return 1 / x

    def fingerprint(x):
        return x

    assert meter.timed(forward)(1) == 2
    assert meter.timed(fingerprint) is fingerprint  # other compute-thread work is not a pass
    with pytest.raises(ZeroDivisionError):
        meter.timed(backward)(0)  # a failed pass still took its time
    snap = meter.snapshot()
    assert sum(snap.compute[ComputePass.FORWARD].counts) == 1
    assert sum(snap.compute[ComputePass.BACKWARD].counts) == 1
    assert ComputePass.HEAD not in snap.compute


def test_metered_streams_count_bytes_by_direction_and_service():
    meter = Meter()

    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"0123456789")
        reader.feed_eof()
        written: list[bytes] = []
        writer = SimpleNamespace(write=lambda data: written.append(bytes(data)), close=lambda: None)
        r, w = metered(reader, writer, meter, "forward")  # type: ignore[arg-type]
        assert await r.readexactly(4) == b"0123"
        assert await r.read(3) == b"456"
        with pytest.raises(asyncio.IncompleteReadError):
            await r.readexactly(10)  # 3 bytes left: they crossed the wire all the same
        w.write(b"abc")
        w.write(memoryview(b"defgh"))
        w.close()  # everything else passes through
        assert written == [b"abc", b"defgh"]

    asyncio.run(scenario())
    assert meter.snapshot().traffic == {(Direction.RECEIVED, "forward"): 10, (Direction.SENT, "forward"): 8}


def fake_service(
    stage: int = 1, completed: int = 0, processed: int = 0, banned: int = 0, validated: float | None = None
) -> SimpleNamespace:
    """Just what StageService.read reads, and `read` itself: the collector's one way in."""
    stats = PipelineStats(completed=completed, forwarded=completed, timeouts=1, rerouted=2)
    bans = BanList()
    for i in range(banned):
        bans.ban(f"peer{i}", 0.0, "test")
    training = SimpleNamespace(microbatch_size=2, sequence_length=8)
    service = SimpleNamespace(
        config=SimpleNamespace(swarm_id="s", training=training),
        me=SimpleNamespace(stage=stage, state=PeerState.ONLINE),
        pipeline=SimpleNamespace(stats=stats),
        router=SimpleNamespace(bans=bans),
        transport=SimpleNamespace(conduct=SimpleNamespace(refused=3)),
        gossip=SimpleNamespace(
            rounds=SimpleNamespace(outcomes=Counter({RoundStatus.APPLIED: 2, RoundStatus.REJECTED: 1})),
            outer_state=SimpleNamespace(round=4),
            divergence=0.25,
            last_partner=None,
            fingerprint=None,
        ),
        worker=SimpleNamespace(
            inner_step=7,
            last_grad_norm=None,
            throughput=3.5,
            num_stored=1,
            evicted=completed,
            microbatches_done=processed,
            transfers=DeviceTransfers("cpu"),
        ),
        view=SimpleNamespace(peers_by_stage={0: [1, 2], 1: [3]}),
        validator=None if validated is None else SimpleNamespace(latest=ValidationResult(validated, 40)),
    )
    service.read = lambda: StageService.read(service)  # type: ignore[arg-type]
    return service


def test_counters_keep_growing_when_the_peer_moves_to_another_stage():
    metrics = NodeMetrics(NodeRole.PEER, name="n")
    metrics.attach_service(fake_service(stage=1, completed=5, processed=10, banned=1))  # type: ignore[arg-type]
    before = samples(metrics.render().decode())
    assert before[("pipeswarm_microbatches_processed_total", ())] == 10
    assert before[("pipeswarm_tokens_processed_total", ())] == 10 * 2 * 8
    assert before[("pipeswarm_gossip_rounds_total", (("outcome", "applied"),))] == 2
    assert before[("pipeswarm_peer_state", (("stage", "1"), ("state", "online")))] == 1
    assert before[("pipeswarm_peer_state", (("stage", "1"), ("state", "joining")))] == 0
    assert before[("pipeswarm_replica_divergence", ())] == 0.25
    assert before[("pipeswarm_swarm_peers", ())] == 3
    assert ("pipeswarm_val_loss", ()) not in before  # not validating (a block stage)
    # peak memory: the process's resident set on a CPU, and no GPU figure there
    assert before[("pipeswarm_peak_rss_bytes", ())] > 50 << 20
    assert ("pipeswarm_peak_device_memory_bytes", ()) not in before
    metrics.attach_service(None)  # the stage service ends; a new one starts for the new stage
    metrics.attach_service(fake_service(stage=0, completed=1, processed=1, validated=2.5))  # type: ignore[arg-type]
    after = samples(metrics.render().decode())
    assert after[("pipeswarm_val_loss", ())] == 2.5
    assert after[("pipeswarm_microbatches_processed_total", ())] == 11
    assert after[("pipeswarm_microbatches_completed_total", ())] == 6
    assert after[("pipeswarm_bans_total", ())] == 1
    assert after[("pipeswarm_routing_retries_total", ())] == 4
    assert after[("pipeswarm_activations_evicted_total", ())] == 6
    assert after[("pipeswarm_gossip_rounds_total", (("outcome", "rejected"),))] == 2
    assert after[("pipeswarm_stage", ())] == 0
    for name in SERVICE_COUNTERS:
        assert after[(f"pipeswarm_{name}_total", ())] >= before[(f"pipeswarm_{name}_total", ())]


def test_the_server_serves_its_own_registry_and_stops():
    metrics = NodeMetrics(NodeRole.FOUNDER, swarm_id="demo")
    metrics.meter.count(Tally.REBUILDS)
    metrics.meter.hop("forward", 0.02)
    port = metrics.start("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found = samples(text)
        assert found[("pipeswarm_rebuilds_total", ())] == 1
        assert found[("pipeswarm_hop_seconds_count", (("service", "forward"),))] == 1
        info = [k for k in found if k[0] == "pipeswarm_node_info"]
        assert info and ("role", "founder") in info[0][1] and ("swarm", "demo") in info[0][1]
        assert any(name.startswith("process_") for name, _ in found)  # the standard collectors, in our registry
        with pytest.raises(MetricsError, match="cannot serve metrics"):  # the port is taken
            NodeMetrics(NodeRole.PEER).start("127.0.0.1", port)
    finally:
        metrics.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("pipeswarm_rebuilds_total") is None  # never the global registry


def test_one_reading_gives_the_progress_line_the_summary_and_the_record():
    service = fake_service(stage=1, completed=5, processed=10)
    reading = service.read()
    assert ServiceSummary.of(reading) == ServiceSummary(
        stage=1, state=PeerState.ONLINE, step=7, rate=3.5, loss=None, peers=3, done=5, retried=0, dropped=0
    )
    line = ProgressDisplay(service.read, quiet=True).line()
    assert line == (
        "stage 1 online | step 7 | 3.50 microbatches/s (compute) | loss - | peers seen 3 | done 5 retried 0 dropped 0"
    )
    record = reading.announced(verification=None)  # type: ignore[arg-type]
    assert (record.inner_step, record.microbatches, record.throughput, record.outer_round) == (7, 10, 3.5, 4)
    assert (record.divergence, record.loss, record.val_loss) == (0.25, None, None)
    validating = fake_service(stage=0, validated=2.5).read()
    assert (validating.announced(None).val_loss, validating.announced(None).val_step) == (2.5, 40)  # type: ignore[arg-type]
