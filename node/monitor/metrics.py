"""`--metrics-port`: this peer's numbers in Prometheus' text format on http://HOST:PORT/metrics.

Placement (docs/architecture.md, "Metrics"): the layers below know nothing of Prometheus. The
stage service keeps its counters where they already are (PipelineStats, the ban list, gossip's
round outcomes, the stream conduct) and hands them out as one `ServiceReading` (node/server/
reading.py), the one the progress line and the DHT record are derived from too; a `Meter`
(node/runtime/meter.py) keeps what arrives as events (latencies, bytes per service, microbatches
and tokens, rebuilds, state downloads) for the whole process. The server layer hands out what it
runs through two plain callbacks (`NodeOptions.on_network`, `ServiceOptions.on_service`); the CLI,
which may import anything, connects them to a `NodeMetrics`, the one owner of this process's
`CollectorRegistry` (never the global one). A custom collector reads everything at scrape time
(the service: one reading per scrape), on the metrics server's thread: nothing is incremented
twice, and the event loop does no work for a scrape.

A peer that moves to another stage builds a new stage service with fresh counters; the totals of
the one it left are kept (`_retired`), so every counter here only grows for the process's life.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest, start_http_server
from prometheus_client.registry import Collector

from dht.records import PeerState
from node import __version__
from node.averaging.outer_replica import RoundStatus
from node.p2p.network import Network
from node.runtime.device import peak_rss
from node.runtime.meter import Direction, Meter, Tally

if TYPE_CHECKING:  # for types only: every `node` command imports this module, few need the stage service
    from node.server.reading import ServiceReading
    from node.server.stage_service import StageService

logger = logging.getLogger(__name__)

PREFIX = "pipeswarm"


class MetricsError(RuntimeError):
    """The metrics server could not start (the port is taken, the address is not ours)."""


class NodeRole(StrEnum):
    FOUNDER = "founder"  # `node bootstrap`: the swarm's DHT anchor, serves no stage
    PEER = "peer"  # `node join`


# counters a stage service keeps, read at scrape time: name -> meaning
SERVICE_COUNTERS: dict[str, str] = {
    "microbatches_processed": "microbatches whose backward this peer's stage computed",
    "tokens_processed": "tokens in the microbatches this peer's stage processed (batch x sequence length)",
    "microbatches_completed": "stage 0: microbatches whose round trip through every stage completed",
    "microbatches_retried": "stage 0: microbatch attempts lost (timeout, abort, no peer) and started again",
    "microbatches_dropped": "stage 0: microbatches given up after every retry",
    "hops_forwarded": "activations this peer computed and passed on to the next stage",
    "hops_backwarded": "gradients this peer computed and passed back to the previous hop",
    "routing_retries": "hops sent to another peer of the stage after a timeout, error or BUSY reply",
    "routing_timeouts": "routed hops that timed out (tried elsewhere, not banned)",
    "busy_replies": "BUSY replies given (queue full, unknown sender) or received",
    "bans": "peers banned (errors, invalid tensors or gossip; until their DHT record expires)",
    "refused_streams": "incoming streams refused at the door (limits or bans)",
    "activations_evicted": "stored activations dropped for room (the store was full): that microbatch's backward fails here",
}


def service_counters(reading: ServiceReading) -> Counter[str]:
    """The counters of one stage service, as they stand (they start at zero with the service)."""
    counts: Counter[str] = Counter(
        microbatches_processed=reading.microbatches_processed,
        tokens_processed=reading.tokens_processed,
        microbatches_completed=reading.completed,
        microbatches_retried=reading.retried,
        microbatches_dropped=reading.dropped,
        hops_forwarded=reading.forwarded,
        hops_backwarded=reading.backwarded,
        routing_retries=reading.rerouted,
        routing_timeouts=reading.timeouts,
        busy_replies=reading.busy_replies,
        bans=reading.bans,
        refused_streams=reading.refused_streams,
        activations_evicted=reading.activations_evicted,
    )
    for status in RoundStatus:
        counts[f"gossip_rounds:{status}"] = reading.gossip_rounds[status]
    return counts


class NodeMetrics(Collector):
    """The one owner of this process's registry; a collector reading the node at scrape time."""

    def __init__(self, role: NodeRole, meter: Meter | None = None, name: str = "", swarm_id: str = ""):
        self.role, self.name, self.swarm_id = role, name, swarm_id
        self.meter = meter or Meter()
        self.network: Network | None = None
        self.service: StageService | None = None
        self._retired: Counter[str] = Counter()  # totals of stage services that ended (a move)
        self._lock = threading.Lock()  # attach (event loop) vs collect (the server's thread)
        self._server = None
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        for standard in (ProcessCollector, PlatformCollector, GCCollector):
            standard(registry=self.registry)  # process_* and python_* series, in our registry only

    # ---- fed by the server layer (on the event loop) ----------------------------------------------

    def attach_network(self, network: Network) -> None:
        self.network = network

    def attach_service(self, service: StageService | None) -> None:
        """The stage service now running (None: it ended); the ended one's counters are kept."""
        with self._lock:
            if self.service is not None and self.service is not service:
                self._retired += service_counters(self.service.read())
            self.service = service
            if service is not None:
                self.swarm_id = service.config.swarm_id

    # ---- read on a scrape (the metrics server's thread) -------------------------------------------

    def collect(self) -> Iterator[Metric]:
        yield self._info()
        yield from self._meter_series()
        with self._lock:
            reading = self.service.read() if self.service is not None else None
            totals = Counter(self._retired)
        if reading is not None:
            totals.update(service_counters(reading))
        for name, meaning in SERVICE_COUNTERS.items():
            counter = CounterMetricFamily(f"{PREFIX}_{name}", meaning)
            counter.add_metric([], totals[name])
            yield counter
        rounds = CounterMetricFamily(
            f"{PREFIX}_gossip_rounds", "gossip (outer) rounds by how they ended", labels=["outcome"]
        )
        for status in RoundStatus:
            rounds.add_metric([status.value], totals[f"gossip_rounds:{status}"])
        yield rounds
        yield from self._network_series()
        if reading is not None:
            yield from self._service_gauges(reading)

    def _info(self) -> Metric:
        info = InfoMetricFamily(f"{PREFIX}_node", "who this process is (always 1)")
        peer_id = self.network.peer_id if self.network is not None else ""
        info.add_metric(
            [],
            {
                "peer_id": peer_id,
                "role": self.role.value,
                "swarm": self.swarm_id,
                "name": self.name,
                "version": __version__,
            },
        )
        return info

    def _meter_series(self) -> Iterator[Metric]:
        snap = self.meter.snapshot()
        processed = {
            Tally.REBUILDS: ("rebuilds", "lost stages this peer rebuilt (CheckFree, CheckFree+ or a baseline)"),
            Tally.STATE_DOWNLOADS: ("state_downloads", "stage states downloaded from a donor (joining a live stage)"),
            Tally.STATE_DOWNLOAD_FAILURES: ("state_download_failures", "state downloads that failed"),
        }
        for tally, (name, meaning) in processed.items():
            counter = CounterMetricFamily(f"{PREFIX}_{name}", meaning)
            counter.add_metric([], snap.tallies[tally])
            yield counter
        for direction in Direction:
            traffic = CounterMetricFamily(
                f"{PREFIX}_bytes_{direction.value}",
                f"bytes {direction.value} on streams, by service",
                labels=["service"],
            )
            for (seen, service), size in sorted(snap.traffic.items()):
                if seen == direction:
                    traffic.add_metric([service], size)
            yield traffic
        compute = HistogramMetricFamily(
            f"{PREFIX}_compute_seconds", "stage compute per microbatch, by pass", labels=["pass"]
        )
        for kind, histogram in sorted(snap.compute.items()):
            compute.add_metric([kind.value], histogram.cumulative(), histogram.total)
        yield compute
        hops = HistogramMetricFamily(
            f"{PREFIX}_hop_seconds",
            "requests to other peers until their reply (posted pipeline hops: until written), by service",
            labels=["service"],
        )
        for service, histogram in sorted(snap.hops.items()):
            hops.add_metric([service], histogram.cumulative(), histogram.total)
        yield hops

    def _network_series(self) -> Iterator[Metric]:
        if self.network is not None:
            lag = GaugeMetricFamily(f"{PREFIX}_event_loop_lag_seconds", "worst event-loop lateness of the last minute")
            lag.add_metric([], self.network.loop_watch.worst_lag)
            yield lag
            direct = self.network.direct
            if direct is not None:
                links = CounterMetricFamily(
                    f"{PREFIX}_direct_links",
                    "direct links set up (node/p2p/direct.py): opened to other peers, accepted from them",
                    labels=["side"],
                )
                links.add_metric(["opened"], direct.opened)
                links.add_metric(["accepted"], direct.accepted)
                yield links
            traversal = self.network.traversal
            if traversal is not None:
                paths = CounterMetricFamily(
                    f"{PREFIX}_nat_links",
                    "direct links with peers behind NATs (node/p2p/traversal.py), by how they went",
                    labels=["path"],
                )
                for path, count in sorted(traversal.paths.counts.items()):
                    paths.add_metric([path.value], count)
                yield paths

    def _service_gauges(self, reading: ServiceReading) -> Iterator[Metric]:
        states = GaugeMetricFamily(
            f"{PREFIX}_peer_state", "1 for the state this peer is in, 0 for the others", labels=["stage", "state"]
        )
        for candidate in PeerState:
            states.add_metric([str(reading.stage), candidate.value], 1.0 if candidate == reading.state else 0.0)
        yield states
        values: dict[str, tuple[str, float | None]] = {
            "stage": ("the stage this peer serves", reading.stage),
            "inner_step": ("inner optimizer steps of this peer's replica", reading.inner_step),
            "outer_round": ("outer (gossip) rounds this replica has taken", reading.outer_round),
            "replica_divergence": (
                "relative distance from the last gossip partner's weights, before averaging",
                reading.divergence,
            ),
            "loss": ("stage 0: mean training loss of the recent microbatches", reading.loss),
            "val_loss": ("stage 0: mean loss on the held-out microbatches at the last validation", reading.val_loss),
            "compute_throughput": ("measured compute speed, microbatches per second (EMA)", reading.throughput),
            "stored_activations": (
                "microbatches whose activations wait for their backward",
                reading.stored_activations,
            ),
            "peak_device_memory_bytes": (
                "the most this peer's stage has held on its GPU (torch's allocator); absent on a CPU",
                reading.peak_device_memory,
            ),
            "peak_rss_bytes": ("this process's peak resident memory", peak_rss()),
            "banned_peers": ("peers banned right now", reading.banned_now),
            "swarm_peers": ("peers this one sees in the swarm, all stages", reading.peers_seen),
        }
        for name, (meaning, value) in values.items():
            if value is not None:  # no divergence before the first round, no loss off stage 0
                gauge = GaugeMetricFamily(f"{PREFIX}_{name}", meaning)
                gauge.add_metric([], float(value))
                yield gauge

    # ---- the HTTP server ----------------------------------------------------------------------------

    def render(self) -> bytes:
        """What a scrape returns (tests, `--once` style use)."""
        return generate_latest(self.registry)

    def start(self, host: str, port: int) -> int:
        """Serve /metrics on its own thread (prometheus_client's); the bound port (port 0: any free one)."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        bound = self._server.server_port
        shown = f"[{host}]" if ":" in host else host
        logger.info(f"Prometheus metrics on http://{shown}:{bound}/metrics")
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


@contextlib.contextmanager
def serving_metrics(
    host: str, port: int | None, role: NodeRole, name: str = "", swarm_id: str = ""
) -> Iterator[NodeMetrics | None]:
    """A started NodeMetrics for the process's life (None when `port` is None: metrics are off)."""
    if port is None:
        yield None
        return
    metrics = NodeMetrics(role, name=name, swarm_id=swarm_id)
    metrics.start(host, port)
    try:
        yield metrics
    finally:
        metrics.stop()
