"""What one synchronisation of a stage's replicas costs under the link model.

Reads beside the NoLoCo paper's argument (docs/algorithms.md, "What the authors report": about 10x
faster than a tree all-reduce at ~1000 replicas): a NoLoCo round is ONE pairwise exchange with a
random partner, whatever N is, while an all-reduce needs either log2(N) latency-bound hops up and
down a tree or 2(N-1) latency-bound steps around a ring.

`nbytes` is the payload one replica contributes (its stage's Delta, fp32). Links are full duplex
and every peer has its own, so transfers of disjoint pairs run at the same time.

- NoLoCo round: both partners send phi and Delta to each other at once (the project's
  round_protocol.py, gossip_wire.py: fp32, uncompressed): latency + 2 nbytes / bandwidth.
- Tree all-reduce (binary tree; reduce to the root, then broadcast): 2 ceil(log2 N) hops, each a
  whole payload: 2 ceil(log2 N) (latency + nbytes / bandwidth).
- Ring all-reduce (reduce-scatter + all-gather): 2 (N - 1) steps of nbytes / N each:
  2 (N - 1) latency + 2 (N - 1) / N x nbytes / bandwidth.
With N = 1 nothing is sent.
"""

from __future__ import annotations

import math
from enum import StrEnum

from node.simulate.links import LinkModel


class SyncMethod(StrEnum):
    NOLOCO = "noloco"  # one pairwise exchange with a random partner
    TREE = "tree"  # binary-tree reduce + broadcast
    RING = "ring"  # ring reduce-scatter + all-gather


def noloco_round_seconds(num_replicas: int, nbytes: float, link: LinkModel) -> float:
    _check(num_replicas)
    return 0.0 if num_replicas == 1 else link.transfer_seconds(2 * nbytes)


def tree_allreduce_seconds(num_replicas: int, nbytes: float, link: LinkModel) -> float:
    _check(num_replicas)
    return 2 * math.ceil(math.log2(num_replicas)) * link.transfer_seconds(nbytes)


def ring_allreduce_seconds(num_replicas: int, nbytes: float, link: LinkModel) -> float:
    _check(num_replicas)
    steps = 2 * (num_replicas - 1)
    return steps * link.latency_s + steps * link.bulk_seconds(nbytes / num_replicas)


def sync_seconds(method: SyncMethod, num_replicas: int, nbytes: float, link: LinkModel) -> float:
    return SYNC_COST[SyncMethod(method)](num_replicas, nbytes, link)


SYNC_COST = {
    SyncMethod.NOLOCO: noloco_round_seconds,
    SyncMethod.TREE: tree_allreduce_seconds,
    SyncMethod.RING: ring_allreduce_seconds,
}


def _check(num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"need at least one replica, got {num_replicas}")
