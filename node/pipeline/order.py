"""The order in which a microbatch visits the block stages: CheckFree+'s out-of-order execution.

Pure: no networking. CheckFree+ (docs/algorithms.md, "CheckFree+") swaps the first two and the last
two block stages on odd training microbatches, so that stage 2 also learns stage 1's role and
stage S-1 stage S's: a lost edge block stage can then be rebuilt by copying its neighbour
(node/recovery/checkfree.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_order(num_stages: int, microbatch_index: int, checkfree_plus: bool, training: bool = True) -> list[int]:
    """The block stages a microbatch visits, in forward order (stage 0 is implicit at both ends:
    every path is 0 -> order[0] -> ... -> order[-1] -> the same stage-0 peer; backward reverses it).

    num_stages counts stage 0 (SwarmConfig.num_stages), so S = num_stages - 1 block stages.
    Normal order: [1, 2, ..., S]. With CheckFree+, in training, on odd microbatch indices:
      S >= 4: swap the first two and the last two: [2, 1, 3, ..., S-2, S, S-1] (S = 4: [2, 1, 4, 3]);
      S == 3: the two swaps overlap on stage 2, so odd microbatches alternate between them:
              index % 4 == 1 -> [2, 1, 3] (front swap), index % 4 == 3 -> [1, 3, 2] (back swap);
              stage 2 thus plays stage 1's role and stage 3's role, each on 1/4 of microbatches;
      S == 2: the two swaps are the same pair, applied once: [2, 1];
      S == 1: nothing to swap: [1].
    Even microbatches and evaluation (training=False) always use the normal order.
    """
    if num_stages < 2:
        raise ValueError(f"num_stages counts stage 0 and must be >= 2, got {num_stages}")
    if microbatch_index < 0:
        raise ValueError(f"microbatch_index must be >= 0, got {microbatch_index}")
    S = num_stages - 1
    order = list(range(1, S + 1))
    if not (checkfree_plus and training and microbatch_index % 2 == 1) or S == 1:
        return order
    if S == 2:
        return [2, 1]
    if S == 3:
        return [2, 1, 3] if microbatch_index % 4 == 1 else [1, 3, 2]
    order[0], order[1] = order[1], order[0]
    order[-2], order[-1] = order[-1], order[-2]
    return order


def visits_every_block_stage(order: Sequence[int], num_block_stages: int) -> bool:
    """Whether `order` (from another peer's message) visits each of the block stages 1..num_block_stages once."""
    return sorted(order) == list(range(1, num_block_stages + 1))
