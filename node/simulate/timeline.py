"""When one iteration's microbatches finish: single-server stages, transfers on the link model.

Every (stage, replica) is one peer that computes one task at a time, first come first served
(the project's StageWorker runs its stage's compute on one thread). A microbatch of stage-0 peer r
goes 0 -> the block stages of its path -> back to the same stage-0 peer, then backward the same
way reversed; every hop between peers costs `link.transfer_seconds(activation bytes)`. A
microbatch's block-stage forward costs `forward_share` of its compute, backward the rest; stage 0
pays its embedding forward and, at the end, the head + loss + backward.

The next peer of every forward hop is chosen when the hop leaves, at that simulated time, by
`choose(stage, now, source)`: the project's router driven by the simulated clock, or the source
replica's own pipeline (swarm.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node.simulate.links import LinkModel

FORWARD_SHARE = 1.0 / 3.0  # a backward pass costs about twice the forward (2 matmuls per forward one)


@dataclass
class Microbatch:
    source: int  # the stage-0 replica that owns it
    order: list[int]  # block stages in forward order (node/pipeline/order.py pipeline_order)
    replicas: list[int] = field(default_factory=list)  # the chosen replica of each stage in `order`
    finished: float = 0.0


@dataclass(frozen=True)
class StageCosts:
    compute_seconds: float  # forward + backward of one microbatch on one block stage
    edge_seconds: float  # stage 0: embedding + head + loss, forward and backward
    activation_bytes: float  # one hop's payload (activations forward, gradients backward)
    extra_forward: float = 0.0  # Bamboo-style redundancy: extra forward compute per block task, as a share


def run_iteration(
    microbatches: Sequence[Microbatch],
    start: float,
    costs: StageCosts,
    link: LinkModel,
    choose: Callable[[int, float, int], int],
) -> float:
    """Schedule every microbatch (fills `replicas` and `finished`); returns when the last one is done.

    Tasks are served in order of the time they become ready (ties: issue order), each on its peer
    as soon as the peer is free. Bounded: every microbatch has 2 (len(order) + 1) tasks.
    """
    free: dict[tuple[int, int], float] = {}
    ready: list[tuple[float, int, int, int]] = []  # (ready time, tie, microbatch index, task index)
    tie = itertools.count()
    fwd = costs.compute_seconds * (FORWARD_SHARE + costs.extra_forward)
    bwd = costs.compute_seconds * (1.0 - FORWARD_SHARE)
    for index, mb in enumerate(microbatches):
        mb.replicas = []
        heapq.heappush(ready, (start, next(tie), index, 0))
    end = start
    while ready:
        when, _, index, task = heapq.heappop(ready)
        mb = microbatches[index]
        hops = len(mb.order)
        # task 0: stage-0 embed; 1..hops: forward; hops+1: stage-0 head/loss/backward;
        # hops+2..2 hops+1: backward in reverse; 2 hops+2: stage-0 embedding backward (the end)
        if task == 0:
            peer, seconds = (0, mb.source), costs.edge_seconds * FORWARD_SHARE / 2
        elif task <= hops:
            stage = mb.order[task - 1]
            mb.replicas.append(choose(stage, when, mb.source))
            peer, seconds = (stage, mb.replicas[-1]), fwd
        elif task == hops + 1:
            peer, seconds = (0, mb.source), costs.edge_seconds * (1.0 - FORWARD_SHARE)
        elif task <= 2 * hops + 1:
            k = 2 * hops + 1 - task  # index into order, walking back
            peer, seconds = (mb.order[k], mb.replicas[k]), bwd
        else:
            peer, seconds = (0, mb.source), costs.edge_seconds * FORWARD_SHARE / 2
        begin = max(when, free.get(peer, start))
        done = begin + seconds
        free[peer] = done
        if task == 2 * hops + 2:
            mb.finished = done
            end = max(end, done)
            continue
        heapq.heappush(ready, (done + link.transfer_seconds(costs.activation_bytes), next(tie), index, task + 1))
    return end
