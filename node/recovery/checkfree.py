"""CheckFree / CheckFree+ recovery rules, as pure functions over state dicts.

Reads beside Blagoev et al., "All is Not Lost: LLM Recovery without Checkpoints" (2025,
github.com/gensyn-ai/CheckFree) and docs/algorithms.md. No networking here: when every
peer of a stage is gone, the recovery code calls `plan_rebuild`, fetches what the plan names from
the neighbouring stages' peers, and calls `execute_rebuild`; the new stage then trains with a fresh
inner optimizer and lr x `recovered_lr_scale(...)` from then on.

Stage numbering follows SwarmConfig: `num_stages` counts stage 0 (the edge stage: embedding, final
norm, LM head; it owns data and loss); block stages are 1..S with S = num_stages - 1, all with
identical parameter names and shapes. A "lost" stage is one with *no* surviving peer (a stage
that still has a peer is simply re-joined by downloading from that peer, no approximation needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

__all__ = [
    "STRATEGIES",
    "CHECKFREE_EPS",
    "UnrecoverableError",
    "checkfree_weights",
    "checkfree_average",
    "pipeline_order",
    "RebuildPlan",
    "plan_rebuild",
    "unrecoverable",
    "execute_rebuild",
    "recovered_lr_scale",
]

STRATEGIES = ("checkfree", "copy", "random", "checkpoint")
CHECKFREE_EPS = 1e-4

StateDict = dict[str, Tensor]


class UnrecoverableError(ValueError):
    """execute_rebuild was handed a plan that cannot be carried out (plan.reason says why)."""


# --------------------------------------------------------------------------------------------
# CheckFree: gradient-norm weighted average of the two neighbours


def checkfree_weights(grad_norm_prev: float, grad_norm_next: float) -> tuple[float, float]:
    """(a, b) = (|g[i+1]| + 1e-4, |g[i-1]| + 1e-4): a weighs the next neighbour, b the previous.

    g[k] is the L2 norm of stage k's whole gradient at its last optimizer step (the authors take
    it after per-stage clipping to 1.0). The neighbour with the larger norm, still learning faster,
    gets more weight. Non-finite norms raise ValueError (a NaN would poison every weight).
    """
    for name, value in (("grad_norm_prev", grad_norm_prev), ("grad_norm_next", grad_norm_next)):
        if not math.isfinite(float(value)):
            raise ValueError(f"{name} must be finite, got {value!r}")
    return abs(float(grad_norm_next)) + CHECKFREE_EPS, abs(float(grad_norm_prev)) + CHECKFREE_EPS


def _check_compatible(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], ref_name: str, other_name: str) -> None:
    missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
    if missing or extra:
        raise ValueError(
            f"state dicts differ: keys only in {ref_name}: {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"keys only in {other_name}: {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    for key, r in reference.items():
        o = other[key]
        if not isinstance(r, Tensor) or not isinstance(o, Tensor):
            raise ValueError(f"state dict entry {key!r} is not a tensor")
        if r.shape != o.shape:
            raise ValueError(f"{key!r}: shape {tuple(r.shape)} in {ref_name} but {tuple(o.shape)} in {other_name}")
        if r.dtype != o.dtype:
            raise ValueError(f"{key!r}: dtype {r.dtype} in {ref_name} but {o.dtype} in {other_name}")


def checkfree_average(
    prev_state: Mapping[str, Tensor], next_state: Mapping[str, Tensor], grad_norm_prev: float, grad_norm_next: float
) -> StateDict:
    """New weights of lost stage i = (a * W[i+1] + b * W[i-1]) / (a + b), entry by entry.

    Every floating-point parameter and buffer is averaged (computed in at least fp32, returned in
    the entry's dtype); integer/bool buffers (e.g. counters) are copied from the next neighbour.
    Inputs are not modified; mismatched keys, shapes or dtypes raise ValueError.
    """
    _check_compatible(next_state, prev_state, "next_state", "prev_state")
    a, b = checkfree_weights(grad_norm_prev, grad_norm_next)
    out: StateDict = {}
    with torch.no_grad():
        for key, w_next in next_state.items():
            w_prev = prev_state[key]
            if w_next.is_floating_point() or w_next.is_complex():
                work = torch.promote_types(w_next.dtype, torch.float32)
                avg = w_next.detach().to(work).mul(a / (a + b)).add_(w_prev.detach().to(work), alpha=b / (a + b))
                out[key] = avg.to(w_next.dtype)
            else:
                out[key] = w_next.detach().clone()
    return out


# --------------------------------------------------------------------------------------------
# CheckFree+: out-of-order pipeline


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


# --------------------------------------------------------------------------------------------
# Planning and executing a rebuild

ACTIONS = ("average", "copy", "edge_copies", "fresh", "checkpoint", "unrecoverable")


@dataclass(frozen=True)
class RebuildPlan:
    """How to rebuild one lost stage.

    action:  "average"      CheckFree: checkfree_average of sources = (i-1, i+1), with their grad norms
             "copy"         copy the single source stage's current weights
             "edge_copies"  stage 0 from the copies its neighbours keep: sources = (1, S) (just (1,)
                            when S = 1); stage-1 peers keep embed_tokens, stage-S peers keep
                            norm + lm_head; merged key by key, the first source wins on overlap
             "fresh"        a fresh initialisation from a new seed (strategy random)
             "checkpoint"   reload this stage's last local save
             "unrecoverable" reason says why; execute_rebuild raises
    fetch:   what to ask the source stages' peers for: "weights" (their current module state dict
             and their last gradient norm), "edge_copy" (their stage-0 copy), or "none".
    scale_lr: whether the rebuilt stage trains with lr x RecoveryConfig.lr_scale from then on (true
             for neighbour-derived weights, the authors' catch-up rule; false for fresh/checkpoint).
    The rebuilt stage always starts a fresh inner optimizer (moments are never averaged or copied).
    """

    lost_stage: int
    num_stages: int
    strategy: str
    action: str
    sources: tuple[int, ...] = ()
    fetch: str = "none"
    scale_lr: bool = False
    reason: str | None = None
    fresh_optimizer: bool = True

    @property
    def recoverable(self) -> bool:
        return self.action != "unrecoverable"


def _check_stage_args(num_stages: int, strategy: str) -> None:
    if num_stages < 2:
        raise ValueError(f"num_stages counts stage 0 and must be >= 2, got {num_stages}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown recovery strategy {strategy!r}; expected one of {STRATEGIES}")


def plan_rebuild(lost_stage: int, num_stages: int, strategy: str, checkfree_plus: bool) -> RebuildPlan:
    """The plan for rebuilding `lost_stage` (no surviving peer) under `strategy`.

    checkfree:  middle stage 1 < i < S: average of i-1 and i+1.
                stage 1 / stage S: with CheckFree+ copy stage 2 / stage S-1 (which learned to play
                that role on odd microbatches); without it: unrecoverable. S = 1: unrecoverable.
    copy:       block stage i < S copies the next stage i+1; stage S copies S-1 (the only block
                neighbour); S = 1: unrecoverable.
    random:     any stage: fresh init from a new seed.
    checkpoint: any stage: reload its last local save.
    Stage 0 under checkfree and copy: with CheckFree+ rebuilt from the edge copies kept by the
    stage-1 and stage-S peers; without CheckFree+ no copies exist: unrecoverable.
    """
    _check_stage_args(num_stages, strategy)
    if not 0 <= lost_stage < num_stages:
        raise ValueError(f"lost_stage {lost_stage} out of range 0..{num_stages - 1}")
    S = num_stages - 1
    plan = dict(lost_stage=lost_stage, num_stages=num_stages, strategy=strategy)

    def nope(reason: str) -> RebuildPlan:
        return RebuildPlan(**plan, action="unrecoverable", reason=reason)

    if strategy == "random":
        return RebuildPlan(**plan, action="fresh")
    if strategy == "checkpoint":
        return RebuildPlan(**plan, action="checkpoint")
    if lost_stage == 0:
        if not checkfree_plus:
            return nope("stage 0 (embedding, norm, head) has no neighbour copies without CheckFree+")
        sources = (1,) if S == 1 else (1, S)
        return RebuildPlan(**plan, action="edge_copies", sources=sources, fetch="edge_copy", scale_lr=True)
    if S == 1:
        return nope("stage 1 is the only block stage: there is no neighbouring block stage to rebuild it from")
    i = lost_stage
    if strategy == "copy":
        source = i + 1 if i < S else S - 1
        return RebuildPlan(**plan, action="copy", sources=(source,), fetch="weights", scale_lr=True)
    # checkfree
    if 1 < i < S:
        return RebuildPlan(**plan, action="average", sources=(i - 1, i + 1), fetch="weights", scale_lr=True)
    if not checkfree_plus:
        return nope(f"stage {i} is an edge block stage (one block neighbour): CheckFree needs CheckFree+ for it")
    source = 2 if i == 1 else S - 1
    return RebuildPlan(**plan, action="copy", sources=(source,), fetch="weights", scale_lr=True)


def unrecoverable(lost_stages: set[int], num_stages: int, strategy: str, checkfree_plus: bool) -> str | None:
    """None if every stage in `lost_stages` (lost at the same time) can be rebuilt, else a reason.

    Sources must be survivors: a stage rebuilt in the same event is never used to rebuild another
    (that would compound approximations, and a rebuilt stage holds no edge copy). Cases:
      - random: only when every stage is lost (nothing left; a fresh init would restart training);
      - checkpoint: never (the last local saves are reloaded);
      - checkfree / copy:
        * two adjacent block stages lost together (each is the other's source: i needs i+1 or i-1);
        * stage 0 without CheckFree+ (no copies of the embedding/head exist);
        * stage 0 together with stage 1 or stage S (the copies die with the peers holding them);
        * checkfree without CheckFree+: stage 1 or stage S (one block neighbour only);
        * S = 1: stage 1 (no other block stage).
    """
    _check_stage_args(num_stages, strategy)
    lost = set(lost_stages)
    bad = sorted(s for s in lost if not 0 <= s < num_stages)
    if bad:
        raise ValueError(f"lost stages {bad} out of range 0..{num_stages - 1}")
    if not lost or strategy == "checkpoint":
        return None
    if strategy == "random":
        if len(lost) == num_stages:
            return "every stage was lost: no weights survive (a random re-init would restart training)"
        return None
    for stage in sorted(lost):
        plan = plan_rebuild(stage, num_stages, strategy, checkfree_plus)
        if not plan.recoverable:
            return f"stage {stage}: {plan.reason}"
        gone = sorted(set(plan.sources) & lost)
        if gone:
            what = "its stage-0 copies are held by" if plan.action == "edge_copies" else "it is rebuilt from"
            return f"stage {stage}: {what} stage(s) {gone}, lost at the same time"
    return None


def _clone_state(state: Mapping[str, Tensor], what: str) -> StateDict:
    out: StateDict = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"{what}: entry {key!r} is a {type(value).__name__}, not a tensor")
        out[key] = value.detach().clone()
    return out


def _source(fetched: Mapping[int, tuple[Mapping[str, Tensor], float]], stage: int, plan: RebuildPlan):
    if stage not in fetched:
        raise ValueError(f"rebuilding stage {plan.lost_stage} ({plan.action}) needs stage {stage}'s {plan.fetch}, not fetched")
    state, grad_norm = fetched[stage]
    return state, grad_norm


def execute_rebuild(
    plan: RebuildPlan,
    fetched: Mapping[int, tuple[Mapping[str, Tensor], float]],
    fresh_state: Callable[[], Mapping[str, Tensor]] | None,
    checkpoint_state: Mapping[str, Tensor] | None,
) -> StateDict:
    """Carry out `plan`: the new state dict of the lost stage (new tensors, inputs untouched).

    fetched maps a source stage to (state dict, last gradient norm) as asked by plan.fetch (for
    "edge_copy" the state dict is that stage's copy of stage-0 entries; its norm is ignored).
    fresh_state builds the stage's state dict from a new seed: required for action "fresh", and
    when given for neighbour-derived actions it also serves as the template the result must match
    (keys and shapes), which catches a neighbour serving the wrong thing. checkpoint_state is the
    stage's last local save (required for action "checkpoint"). Neighbour-derived results must be
    finite. Raises UnrecoverableError for an unrecoverable plan, ValueError for missing inputs.
    """
    if not plan.recoverable:
        raise UnrecoverableError(f"stage {plan.lost_stage} cannot be rebuilt: {plan.reason}")
    if plan.action == "fresh":
        if fresh_state is None:
            raise ValueError("strategy random needs fresh_state")
        return _clone_state(fresh_state(), "fresh_state")
    if plan.action == "checkpoint":
        if checkpoint_state is None:
            raise ValueError(f"no local checkpoint of stage {plan.lost_stage} to reload")
        return _clone_state(checkpoint_state, "checkpoint_state")

    with torch.no_grad():
        if plan.action == "average":
            (prev_state, prev_norm), (next_state, next_norm) = (_source(fetched, s, plan) for s in plan.sources)
            result = checkfree_average(prev_state, next_state, prev_norm, next_norm)
        elif plan.action == "copy":
            state, _ = _source(fetched, plan.sources[0], plan)
            result = _clone_state(state, f"stage {plan.sources[0]}")
        elif plan.action == "edge_copies":
            result = {}
            for stage in plan.sources:
                state, _ = _source(fetched, stage, plan)
                for key, value in _clone_state(state, f"stage {stage}'s edge copy").items():
                    result.setdefault(key, value)
            if not result:
                raise ValueError("the fetched edge copies are empty")
        else:  # pragma: no cover - RebuildPlan.action is one of ACTIONS
            raise ValueError(f"unknown plan action {plan.action!r}")

        if fresh_state is not None:
            template = fresh_state()
            missing, extra = sorted(set(template) - set(result)), sorted(set(result) - set(template))
            if missing or extra:
                raise ValueError(f"rebuilt stage {plan.lost_stage}: missing entries {missing}, unexpected entries {extra}")
            for key, t in template.items():
                if result[key].shape != t.shape:
                    raise ValueError(f"rebuilt stage {plan.lost_stage}: {key!r} has shape {tuple(result[key].shape)}, expected {tuple(t.shape)}")
        for key, value in result.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"rebuilt stage {plan.lost_stage}: {key!r} holds NaN or Inf (bad neighbour weights)")
    return result


def recovered_lr_scale(lr_scale: float, plan: RebuildPlan | None = None) -> float:
    """The factor on the rebuilt stage's learning rate from now on (RecoveryConfig.lr_scale,
    1.1 small models to 1.2 at 500M): lr_scale, or 1.0 when `plan` says no scaling
    (fresh init, checkpoint reload)."""
    if not lr_scale > 0:
        raise ValueError(f"lr_scale must be > 0, got {lr_scale}")
    if plan is not None and not plan.scale_lr:
        return 1.0
    return float(lr_scale)
