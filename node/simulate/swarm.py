"""S stages x R replicas of the project's own StageWorkers in one process, on a simulated clock.

What is real: every forward, backward and optimizer step (node/stage/stage_worker.py on the
node/model/llama.py stages), every choice of the next-stage replica (node/pipeline/routing.py's
Router, in load_aware or random mode, reading the simulated clock), the microbatch paths
(node/pipeline/order.py, CheckFree+ swaps included) and every outer step (node/averaging/
outer_replica.py: NoLoCo's pairwise step, DiLoCo's group step). What is simulated: time. An
iteration = every stage-0 replica sends microbatches_per_step microbatches; timeline.py says when
they finish given per-task compute and the link model, and the clock jumps there. An outer round
is charged as collectives.py prices it (a NoLoCo round: what its codec sends, one direction, both
going at once), and blocks training while it runs (the real gossip overlaps with training,
docs/gossip.md: the charge is an upper bound). NoLoCo and DiLoCo rounds exchange what the swarm's
rounds exchange: the encoded phi sample and 4-bit Delta with error feedback (node/averaging/
gossip_codec.py), decoded as a partner decodes them; averaging every step stays exact.

Devices: every worker computes on `device` (SimSettings.device). What passes between workers takes
the real peers' path: a worker returns its hop on the host (the wire's side) and the next worker
copies it onto its device (StageWorker's DeviceTransfers); training batches enter stage 0 on the
host as a stage-0 peer's data does; outer rounds send host copies and step on the device
(OuterReplica), and a rebuild's weights come and go as host state dicts. Only what the simulator
computes itself, the held-out chain loss, reads the modules directly: its batches are put on the
device once, when they are drawn.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from dht.records import PeerRecord, PeerState
from node.averaging.gossip_codec import MAX_PHI_SEED, PhiDither
from node.averaging.noloco import relative_distance
from node.averaging.outer_replica import OuterReplica, RoundStart
from node.config import SwarmConfig
from node.pipeline.order import pipeline_order
from node.pipeline.routing import Router
from node.pipeline.token_anchors import forward_hop_nbytes
from node.runtime.device import DeviceTransfers
from node.simulate.clock import SimClock
from node.simulate.collectives import ring_allreduce_seconds
from node.simulate.links import LinkModel
from node.simulate.sources import held_out_source, training_source
from node.simulate.timeline import Microbatch, StageCosts, run_iteration
from node.stage.access import live_parameters
from node.stage.forward_only import chain_loss
from node.stage.stage_worker import StageWorker


class SyncMode(StrEnum):
    """How the replicas of a stage are kept together in a simulated run."""

    NOLOCO = "noloco"  # every H inner steps, NoLoCo's outer step with one random partner
    DILOCO = "diloco"  # every H inner steps, DiLoCo's outer step over every replica
    ALLREDUCE = "allreduce"  # after every inner step, the replicas' weights averaged (ring all-reduce)
    NONE = "none"  # replicas never meet


# data-parallel every step as an outer step: DiLoCo with H = 1, no momentum, lr 1, i.e.
# phi <- phi - mean(Delta) = mean(theta): the replicas' weights averaged after every inner step
ALLREDUCE_OUTER = {"inner_steps": 1, "outer_momentum": 0.0, "outer_lr": 1.0}


def peer_id(stage: int, replica: int) -> str:
    return f"stage{stage}-replica{replica}"


@dataclass
class IterationResult:
    loss: float  # mean training loss of the iteration's microbatches
    seconds: float  # simulated time the iteration took


class SimulatedSwarm:
    """The workers of every (stage, replica), their routers, data, outer states and the clock."""

    def __init__(
        self,
        config: SwarmConfig,
        replicas: int,
        link: LinkModel,
        compute_seconds: float | None,
        sync: SyncMode,
        seed: int,
        extra_forward: float = 0.0,
        exact_gossip: bool = False,
        fixed_pipelines: bool = False,
        device: str = "cpu",
    ) -> None:
        """`exact_gossip`: NoLoCo and DiLoCo rounds exchange every phi coordinate and Delta in fp32
        (what a round moved before its codec), the baseline the codec's loss cost is measured against.
        `fixed_pipelines`: every microbatch of stage-0 replica r goes through replica r of each stage.
        `device`: where every worker computes (cpu, cuda, cuda:N)."""
        if replicas < 1:
            raise ValueError(f"need at least one replica per stage, got {replicas}")
        self.config, self.replicas, self.link, self.sync = config, replicas, link, SyncMode(sync)
        self.exact_gossip = exact_gossip
        self.fixed_pipelines = fixed_pipelines  # no routing: the data-parallel pipelines DiLoCo assumes
        self.phi_edge_shares: list[
            float
        ] = []  # per NoLoCo round and side: phi's values at the edge of the codec's reach
        self.num_stages = config.num_stages
        self.clock = SimClock()
        self.rng = random.Random(seed)
        # replicas of a stage start identical (build_stage is a function of the config's seed)
        self.workers = [[StageWorker(config, s, device) for _ in range(replicas)] for s in range(self.num_stages)]
        self.transfers = DeviceTransfers(device)  # the held-out batches onto the workers' device
        gossip = config.gossip
        if self.sync == SyncMode.ALLREDUCE:
            gossip = dataclasses.replace(gossip, **ALLREDUCE_OUTER)
        self.inner_steps = gossip.inner_steps
        self.outer = [[OuterReplica(live_parameters(w), gossip) for w in row] for row in self.workers]
        self.last_round_step = [[0] * replicas for _ in range(self.num_stages)]
        self.router = Router(
            random.Random(seed + 1), self.num_stages, clock=self.clock.now, mode=config.training.routing
        )
        self.stage_bytes = [4 * replicas[0].total_numel for replicas in self.outer]
        self.activation_bytes = forward_hop_nbytes(config.training, config.model)
        if compute_seconds is None:  # measured once, on this host, for a block stage and for stage 0
            block = 1.0 / self.workers[1][0].measure_throughput()
            edge = 1.0 / self.workers[0][0].measure_throughput()
        else:
            block = edge = compute_seconds
        self.costs = StageCosts(block, edge, self.activation_bytes, extra_forward)
        throughput = 1.0 / max(block, 1e-9)
        self.router.refresh(
            {
                s: [PeerRecord(peer_id(s, r), s, PeerState.ONLINE, throughput=throughput) for r in range(replicas)]
                for s in range(self.num_stages)
            }
        )
        self.replica_of = {peer_id(s, r): r for s in range(self.num_stages) for r in range(replicas)}
        self.sources = [training_source(config, r) for r in range(replicas)]
        self.sent = [0] * replicas  # microbatches issued per stage-0 replica (CheckFree+ swaps odd ones)
        self.iteration = 0

    # ---- training ------------------------------------------------------------------------------

    def _choose(self, stage: int, now: float, source: int) -> int:
        if self.fixed_pipelines:  # replica r of stage 0 always through replica r of every stage
            return source
        self.clock.advance_to(now)
        chosen = self.router.choose(stage)
        if chosen is None:  # every replica is always online here; a None would be a routing bug
            raise RuntimeError(f"the router found no replica of stage {stage}")
        return self.replica_of[chosen]

    def train_iteration(self) -> IterationResult:
        """Every stage-0 replica sends microbatches_per_step microbatches through the real workers."""
        t = self.config.training
        batches = []
        for source in range(self.replicas):
            for _ in range(t.microbatches_per_step):
                order = pipeline_order(self.num_stages, self.sent[source], self.config.recovery.checkfree_plus)
                batches.append(Microbatch(source, order))
                self.sent[source] += 1
        start = self.clock.now()
        end = run_iteration(batches, start, self.costs, self.link, self._choose)
        losses = [self._run_microbatch(index, mb) for index, mb in enumerate(batches)]
        self.clock.advance_to(end)
        self.iteration += 1
        return IterationResult(sum(losses) / len(losses), end - start)

    def _run_microbatch(self, index: int, mb: Microbatch) -> float:
        t = self.config.training
        tokens, targets = self.sources[mb.source].next_batch(t.microbatch_size, t.sequence_length)
        key = (self.iteration, index)
        edge = self.workers[0][mb.source]
        hidden = edge.embed(key, tokens)
        path = [self.workers[stage][replica] for stage, replica in zip(mb.order, mb.replicas)]
        for worker in path:
            hidden = worker.forward(key, hidden)
        loss, grad = edge.head_loss_backward(key, hidden, targets)
        for worker in reversed(path):
            grad = worker.backward(key, grad)
        edge.embed_backward(key, grad)
        return loss

    # ---- keeping replicas together --------------------------------------------------------------

    def synchronise(self) -> float:
        """Run the outer rounds that are due (each stage in parallel); returns the seconds charged."""
        if self.sync == SyncMode.NONE or self.replicas == 1:
            return 0.0
        charged = 0.0
        for stage in range(self.num_stages):
            due = [
                r
                for r in range(self.replicas)
                if self.workers[stage][r].inner_step - self.last_round_step[stage][r] >= self.inner_steps
            ]
            if not due:
                continue
            key = None
            if self.sync == SyncMode.NOLOCO and not self.exact_gossip:  # the dither pairs code phi with
                key = PhiDither(self.rng.randrange(MAX_PHI_SEED + 1))
            starts = {r: self.outer[stage][r].capture_start(self.workers[stage][r].inner_step, key) for r in due}
            if self.sync == SyncMode.NOLOCO:
                self.rng.shuffle(due)  # a fresh random matching among the due replicas; an odd one steps alone
                for first in range(0, len(due), 2):
                    self._pairwise(stage, due[first : first + 2], starts)
                payload = self.outer[stage][0].wire_layout(True).nbytes
                seconds = self.link.transfer_seconds(2 * self.stage_bytes[stage] if self.exact_gossip else payload)
            else:  # DiLoCo and every-step averaging: once one replica is due, every replica takes part
                due = list(range(self.replicas))  # (one that took no step brings a zero Delta), so all share phi
                starts.update(
                    {
                        r: self.outer[stage][r].capture_start(self.workers[stage][r].inner_step)
                        for r in due
                        if r not in starts
                    }
                )
                for r in due:
                    outer = self.outer[stage][r]
                    if self.sync == SyncMode.DILOCO and not self.exact_gossip:  # as decoded, mine as sent
                        deltas = [
                            starts[r].sent_delta,
                            *(outer.receive(starts[o].wire, starts[r])[1] for o in due if o != r),
                        ]
                    else:  # every-step averaging is the exact baseline
                        deltas = [starts[r].delta, *(starts[o].delta for o in due if o != r)]
                    outer.apply(starts[r], outer.group_step(starts[r], deltas))
                seconds = ring_allreduce_seconds(len(due), self.stage_bytes[stage], self.link)
            for r in due:
                self.last_round_step[stage][r] = self.workers[stage][r].inner_step
            charged = max(charged, seconds)
        self.clock.advance(charged)
        return charged

    def _pairwise(self, stage: int, pair: Sequence[int], starts: dict[int, RoundStart]) -> None:
        outer = self.outer[stage]
        new_states = {}
        for r in pair:  # both outer steps from the states captured at the round's start
            if self.exact_gossip:
                received = [(starts[o].state.phi, starts[o].delta) for o in pair if o != r]
            else:
                received = []
                for o in (o for o in pair if o != r):
                    phi, delta, edge_share = outer[r].receive(starts[o].wire, starts[r])
                    self.phi_edge_shares.append(edge_share)
                    received.append((phi, delta))
            new_states[r] = outer[r].pairwise_step(
                starts[r], [phi for phi, _ in received], [delta for _, delta in received]
            )
        for r in pair:
            outer[r].apply(starts[r], new_states[r])

    # ---- measuring ------------------------------------------------------------------------------

    def held_out(self, batches: int, batch_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`batches` held-out (tokens, targets) on the workers' device, where eval_loss reads them."""
        source = held_out_source(self.config)
        drawn = [source.next_batch(batch_size, self.config.training.sequence_length) for _ in range(batches)]
        return [(self.transfers.to_device(tokens), self.transfers.to_device(targets)) for tokens, targets in drawn]

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of each replica's own chain (replica r of every stage), in normal order."""
        losses = []
        for r in range(self.replicas):
            chain = [row[r] for row in self.workers]
            losses += [chain_loss(chain, tokens, targets) for tokens, targets in batches]
        return sum(losses) / len(losses)

    @torch.no_grad()
    def divergence(self) -> float:
        """Mean relative distance of replicas 1..R-1 from replica 0 (noloco.relative_distance), over stages."""
        if self.replicas == 1:
            return 0.0
        values = []
        for replicas in self.outer:  # an outer replica's parameters are its worker's live ones
            values += [relative_distance(replicas[0].params, replica.params) for replica in replicas[1:]]
        return sum(values) / len(values)

    def close(self) -> None:
        for row in self.workers:
            for worker in row:
                worker.close()


def estimate_iteration_seconds(
    num_stages: int, replicas: int, microbatches: int, costs: StageCosts, link: LinkModel
) -> float:
    """A failure-free iteration's simulated time with replicas taken in turn (what load-aware routing
    does over equally fast peers), without running any model: the base of the failure rate."""
    turns = [itertools.cycle(range(replicas)) for _ in range(num_stages)]
    batches = [Microbatch(r, list(range(1, num_stages))) for r in range(replicas) for _ in range(microbatches)]
    return run_iteration(batches, 0.0, costs, link, lambda stage, now, source: next(turns[stage]))
