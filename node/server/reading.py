"""What a stage service measured, read at one moment: the one source of its figures.

`StageService.read()` takes a `ServiceReading` from the worker, the pipeline, gossip, the swarm
view, the ban list and the stream conduct, once per tick of whoever shows them; the rest is derived
from it: the terminal's progress line and panel (`ServiceSummary.of`, node/server/progress.py), the
Prometheus counters and gauges (node/monitor/metrics.py) and the progress fields of this peer's DHT
record (`announced`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dht.announcer import PeerProgress
from dht.records import PeerState, VerificationReport
from node.averaging.outer_replica import RoundStatus


@dataclass(frozen=True)
class ServiceReading:
    """One stage service's figures at one moment (counters start at zero with the service)."""

    stage: int
    state: PeerState
    # the worker
    inner_step: int
    microbatches_processed: int  # microbatches whose backward this stage computed
    tokens_processed: int  # microbatch_size x sequence_length tokens each (stage 0's source makes them so)
    throughput: float  # measured compute speed, microbatches per second (EMA)
    grad_norm: float | None
    stored_activations: int  # microbatches whose activations wait for their backward
    activations_evicted: int
    peak_device_memory: int | None  # bytes torch's allocator has held on the GPU; None on a CPU
    # the pipeline
    loss: float | None  # mean training loss of the recent microbatches (stage 0 only has some)
    completion_rate: float  # microbatches completed per second, recently (stage 0)
    completed: int
    retried: int
    dropped: int
    forwarded: int
    backwarded: int
    rerouted: int
    timeouts: int
    busy_replies: int
    # the held-out validation (stage 0 with validation on): its latest result
    val_loss: float | None
    val_step: int | None
    # gossip
    outer_round: int
    last_partner: str | None
    divergence: float | None  # from the last partner's weights, before averaging
    fingerprint: list[float] | None
    gossip_rounds: Mapping[RoundStatus, int]  # rounds by how they ended, every status present
    # the swarm around it
    peers_seen: int  # peers in this one's swarm view, all stages
    bans: int  # peers banned since the service started
    banned_now: int
    refused_streams: int

    def announced(self, verification: VerificationReport) -> PeerProgress:
        """The progress fields of this peer's record, with the verifier's report of its checks."""
        return PeerProgress(
            inner_step=self.inner_step,
            microbatches=self.microbatches_processed,
            throughput=max(self.throughput, 1e-3),
            grad_norm=self.grad_norm,
            loss=self.loss if self.stage == 0 else None,
            val_loss=self.val_loss,
            val_step=self.val_step,
            outer_round=self.outer_round,
            last_partner=self.last_partner,
            divergence=self.divergence,
            fingerprint=self.fingerprint,
            verification=verification,
        )
