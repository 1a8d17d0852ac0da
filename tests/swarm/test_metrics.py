"""`--metrics-port`: a training peer's /metrics, scraped twice, parses and its counters grow.

The smallest swarm that trains: a bootstrap, a stage-0 peer and a stage-1 peer, each its own
process on loopback. Every process serves metrics on a free port it picks itself (port 0) and logs.
"""

from __future__ import annotations

import re
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.local_swarm import NodeProcess, Swarm, wait_for
from tests.helpers.swarms import join_peer

METRICS_LINE = re.compile(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics")

# counters the done-when list names (and the peer's state as labels), present on every scrape
EXPECTED_FAMILIES = {
    "pipeswarm_microbatches_processed",
    "pipeswarm_tokens_processed",
    "pipeswarm_microbatches_completed",
    "pipeswarm_microbatches_retried",
    "pipeswarm_microbatches_dropped",
    "pipeswarm_compute_seconds",
    "pipeswarm_hop_seconds",
    "pipeswarm_bytes_sent",
    "pipeswarm_bytes_received",
    "pipeswarm_routing_retries",
    "pipeswarm_routing_timeouts",
    "pipeswarm_bans",
    "pipeswarm_gossip_rounds",
    "pipeswarm_rebuilds",
    "pipeswarm_state_downloads",
    "pipeswarm_peer_state",
    "pipeswarm_node_info",
}


def metrics_port(node: NodeProcess) -> int | None:
    found = METRICS_LINE.search(node.log())
    if found is None and node.process.poll() is not None:
        raise AssertionError(f"{node.name} exited with {node.process.returncode}:\n{node.log()[-3000:]}")
    return int(found.group(1)) if found else None


def scrape(port: int) -> tuple[set[str], dict[tuple[str, tuple], float]]:
    """(metric family names, {(sample name, sorted labels): value}), through prometheus_client's parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    families = list(text_string_to_metric_families(text))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return {f.name for f in families}, values


def value(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.timeout(150)
def test_a_training_peer_serves_growing_prometheus_metrics(swarm: Swarm):
    founder = swarm.bootstrap(
        "--num-stages", "2", "--heartbeat-period", "1", "--heartbeat-ttl", "5", "--metrics-port", "0"
    )
    edge = join_peer(swarm, "edge", 0, "--metrics-port", "0")
    block = join_peer(swarm, "block", 1, "--metrics-port", "0")
    ports = {
        node.name: wait_for(lambda n=node: metrics_port(n), 60, f"{node.name}: no metrics line")
        for node in (founder, edge, block)
    }

    families, founder_values = scrape(ports["bootstrap"])
    assert "pipeswarm_node_info" in families
    assert any(k[0] == "pipeswarm_node_info" and ("role", "founder") in k[1] for k in founder_values)

    def trained() -> dict | None:
        _, values = scrape(ports["edge"])
        return values if value(values, "pipeswarm_microbatches_completed_total") >= 2 else None

    first = wait_for(
        trained, 90, lambda: "stage 0 completed no microbatch:\n" + edge.log()[-3000:] + block.log()[-2000:]
    )
    first_families, _ = scrape(ports["edge"])
    missing = EXPECTED_FAMILIES - first_families
    assert not missing, f"missing metric families: {sorted(missing)}"

    growing = [
        ("pipeswarm_microbatches_processed_total", {}),
        ("pipeswarm_tokens_processed_total", {}),
        ("pipeswarm_microbatches_completed_total", {}),
        ("pipeswarm_bytes_sent_total", {"service": "forward"}),
        ("pipeswarm_bytes_received_total", {"service": "backward"}),
        ("pipeswarm_compute_seconds_count", {"pass": "forward"}),
        ("pipeswarm_compute_seconds_count", {"pass": "head"}),
        ("pipeswarm_compute_seconds_count", {"pass": "backward"}),
        ("pipeswarm_hop_seconds_count", {"service": "forward"}),
    ]

    def grown() -> dict | None:
        _, values = scrape(ports["edge"])
        return values if all(value(values, n, **labels) > value(first, n, **labels) for n, labels in growing) else None

    second = wait_for(grown, 30, lambda: f"counters did not all grow between scrapes: {first}")
    for name, labels in growing:
        print(f"{name}{labels}: {value(first, name, **labels):g} -> {value(second, name, **labels):g}")
    assert value(second, "pipeswarm_peer_state", stage="0", state="online") == 1
    assert value(second, "pipeswarm_stage") == 0

    _, block_values = scrape(ports["block"])  # the block stage computes and forwards
    assert value(block_values, "pipeswarm_hops_forwarded_total") > 0
    assert value(block_values, "pipeswarm_compute_seconds_count", **{"pass": "backward"}) > 0
    assert value(block_values, "pipeswarm_peer_state", stage="1", state="online") == 1
    # `node join` carries pipeline channels on direct links (node/p2p/direct.py), not through p2pd
    assert value(second, "pipeswarm_direct_links_total", side="opened") >= 1
    assert value(block_values, "pipeswarm_direct_links_total", side="accepted") >= 1

    # the metrics server stops with the node: a clean exit, and the port is closed
    edge.process.send_signal(signal.SIGTERM)
    assert edge.process.wait(timeout=30) == 0
    time.sleep(0.2)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", ports["edge"]), timeout=2):
        pass
