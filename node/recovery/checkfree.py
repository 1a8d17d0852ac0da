"""CheckFree / CheckFree+ recovery rules, as pure functions over state dicts.

Reads beside docs/algorithms.md ("CheckFree", "CheckFree+", "Rebuild plans"; the authors' facts
are at its end). No networking and no asyncio here: when every peer of a stage is gone,
node/recovery/rebuild.py calls `plan_rebuild`, fetches what the plan names from the neighbouring
stages' peers, and calls `execute_rebuild`; the new stage then trains with a fresh inner optimizer
and lr x `recovered_lr_scale(...)` from then on.

Stage numbering follows SwarmConfig: `num_stages` counts stage 0 (the edge stage: embedding, final
norm, LM head; it owns data and loss); block stages are 1..S with S = num_stages - 1, all with
identical parameter names and shapes. A "lost" stage is one with *no* surviving peer (a stage
that still has a peer is simply re-joined by downloading from that peer, no approximation needed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from node.config import RecoveryStrategy
from node.pipeline.order import pipeline_order
from node.runtime.finite import is_finite

__all__ = [
    "CHECKFREE_EPS",
    "UNKNOWN_GRAD_NORM",
    "RebuildAction",
    "RebuildPlan",
    "SourceFetch",
    "UnrecoverableError",
    "checkfree_average",
    "checkfree_weights",
    "execute_rebuild",
    "known_grad_norm",
    "pipeline_order",
    "plan_rebuild",
    "recovered_lr_scale",
    "unrecoverable",
    "zeroed_state",
]

CHECKFREE_EPS = 1e-4
# The authors start every stage's "last gradient norm" at 1.0 (docs/algorithms.md, "What the authors
# report"): a neighbour that has not stepped yet weighs as much as one at the clip limit, instead of
# 1e-4, which would turn the average into a silent copy of the other neighbour.
UNKNOWN_GRAD_NORM = 1.0

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


def known_grad_norm(grad_norm: float | None) -> float:
    """A neighbour's last gradient norm for `checkfree_weights`: UNKNOWN_GRAD_NORM when it has none
    (no optimizer step since it joined or was rebuilt), else the norm itself."""
    return UNKNOWN_GRAD_NORM if grad_norm is None else float(grad_norm)


def _check_compatible(
    reference: Mapping[str, Tensor], other: Mapping[str, Tensor], ref_name: str, other_name: str
) -> None:
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


# --------------------------------------------------------------------------------------------
# Planning and executing a rebuild


class RebuildAction(StrEnum):
    """How a lost stage gets its weights back (the value is what debug dumps and events carry)."""

    AVERAGE = "average"  # CheckFree: checkfree_average of sources = (i-1, i+1), with their grad norms
    COPY = "copy"  # copy the single source stage's current weights
    # stage 0 from the copies its neighbours keep: sources = (1, S) (just (1,) when S = 1); stage-1
    # peers keep embed_tokens, stage-S peers keep norm + lm_head; merged key by key, the first
    # source wins on overlap
    EDGE_COPIES = "edge_copies"
    FRESH = "fresh"  # a fresh initialisation from a new seed (strategy random)
    # every floating-point entry zero (strategy zero): a pre-norm residual block with zero weights
    # adds nothing to the residual stream and gets zero gradients, so it stays the identity
    ZERO = "zero"
    CHECKPOINT = "checkpoint"  # reload this stage's last local save
    UNRECOVERABLE = "unrecoverable"  # plan.reason says why; execute_rebuild raises


class SourceFetch(StrEnum):
    """What a plan asks the source stages' peers for."""

    WEIGHTS = "weights"  # their current module state dict and their last gradient norm
    EDGE_COPY = "edge_copy"  # the stage-0 entries they keep (CheckFree+)
    NONE = "none"  # nothing: fresh init or local checkpoint


@dataclass(frozen=True)
class RebuildPlan:
    """How to rebuild one lost stage.

    action:  a RebuildAction (see there).
    fetch:   a SourceFetch: what to ask the `sources` stages' peers for.
    scale_lr: whether the rebuilt stage trains with lr x RecoveryConfig.lr_scale from then on (true
             for neighbour-derived weights, the authors' catch-up rule; false for fresh/zero/checkpoint).
    The rebuilt stage always starts a fresh inner optimizer (moments are never averaged or copied).
    """

    lost_stage: int
    num_stages: int
    strategy: RecoveryStrategy
    action: RebuildAction
    sources: tuple[int, ...] = ()
    fetch: SourceFetch = SourceFetch.NONE
    scale_lr: bool = False
    reason: str | None = None
    fresh_optimizer: bool = True

    @property
    def recoverable(self) -> bool:
        return self.action != RebuildAction.UNRECOVERABLE


def _check_stage_args(num_stages: int, strategy: str) -> RecoveryStrategy:
    """The strategy as the enum (callers may pass its plain string); ValueError on bad arguments."""
    if num_stages < 2:
        raise ValueError(f"num_stages counts stage 0 and must be >= 2, got {num_stages}")
    try:
        return RecoveryStrategy(strategy)
    except ValueError:
        choices = ", ".join(member.value for member in RecoveryStrategy)
        raise ValueError(f"unknown recovery strategy {strategy!r}; expected one of {choices}") from None


def plan_rebuild(
    lost_stage: int, num_stages: int, strategy: RecoveryStrategy | str, checkfree_plus: bool
) -> RebuildPlan:
    """The plan for rebuilding `lost_stage` (no surviving peer) under `strategy`.

    checkfree:  middle stage 1 < i < S: average of i-1 and i+1.
                stage 1 / stage S: with CheckFree+ copy stage 2 / stage S-1 (which learned to play
                that role on odd microbatches); without it: unrecoverable. S = 1: unrecoverable.
    copy:       block stage i < S copies the next stage i+1; stage S copies S-1 (the only block
                neighbour); S = 1: unrecoverable.
    random:     any stage: fresh init from a new seed.
    zero:       block stage: every parameter zero (the CheckFree authors' "random" baseline: the
                stage is removed for good); stage 0, which the authors never fail and which zeroed
                would stop all learning (zero logits, zero gradients everywhere): fresh init.
    checkpoint: any stage: reload its last local save.
    Stage 0 under checkfree and copy: with CheckFree+ rebuilt from the edge copies kept by the
    stage-1 and stage-S peers; without CheckFree+ no copies exist: unrecoverable.
    """
    strategy = _check_stage_args(num_stages, strategy)
    if not 0 <= lost_stage < num_stages:
        raise ValueError(f"lost_stage {lost_stage} out of range 0..{num_stages - 1}")
    S = num_stages - 1
    plan = dict(lost_stage=lost_stage, num_stages=num_stages, strategy=strategy)

    def nope(reason: str) -> RebuildPlan:
        return RebuildPlan(**plan, action=RebuildAction.UNRECOVERABLE, reason=reason)

    if strategy == RecoveryStrategy.RANDOM or (strategy == RecoveryStrategy.ZERO and lost_stage == 0):
        return RebuildPlan(**plan, action=RebuildAction.FRESH)
    if strategy == RecoveryStrategy.ZERO:
        return RebuildPlan(**plan, action=RebuildAction.ZERO)
    if strategy == RecoveryStrategy.CHECKPOINT:
        return RebuildPlan(**plan, action=RebuildAction.CHECKPOINT)
    if lost_stage == 0:
        if not checkfree_plus:
            return nope("stage 0 (embedding, norm, head) has no neighbour copies without CheckFree+")
        sources = (1,) if S == 1 else (1, S)
        return RebuildPlan(
            **plan, action=RebuildAction.EDGE_COPIES, sources=sources, fetch=SourceFetch.EDGE_COPY, scale_lr=True
        )
    if S == 1:
        return nope("stage 1 is the only block stage: there is no neighbouring block stage to rebuild it from")
    i = lost_stage
    if strategy == RecoveryStrategy.COPY:
        source = i + 1 if i < S else S - 1
        return RebuildPlan(
            **plan, action=RebuildAction.COPY, sources=(source,), fetch=SourceFetch.WEIGHTS, scale_lr=True
        )
    # checkfree
    if 1 < i < S:
        return RebuildPlan(
            **plan, action=RebuildAction.AVERAGE, sources=(i - 1, i + 1), fetch=SourceFetch.WEIGHTS, scale_lr=True
        )
    if not checkfree_plus:
        return nope(f"stage {i} is an edge block stage (one block neighbour): CheckFree needs CheckFree+ for it")
    source = 2 if i == 1 else S - 1
    return RebuildPlan(**plan, action=RebuildAction.COPY, sources=(source,), fetch=SourceFetch.WEIGHTS, scale_lr=True)


def unrecoverable(
    lost_stages: set[int], num_stages: int, strategy: RecoveryStrategy | str, checkfree_plus: bool
) -> str | None:
    """None if every stage in `lost_stages` (lost at the same time) can be rebuilt, else a reason.

    Sources must be survivors: a stage rebuilt in the same event is never used to rebuild another
    (that would compound approximations, and a rebuilt stage holds no edge copy). Cases:
      - random, zero: only when every stage is lost (nothing left; a fresh init would restart training);
      - checkpoint: never (the last local saves are reloaded);
      - checkfree / copy:
        * two adjacent block stages lost together (each is the other's source: i needs i+1 or i-1);
        * stage 0 without CheckFree+ (no copies of the embedding/head exist);
        * stage 0 together with stage 1 or stage S (the copies die with the peers holding them);
        * checkfree without CheckFree+: stage 1 or stage S (one block neighbour only);
        * S = 1: stage 1 (no other block stage).
    """
    strategy = _check_stage_args(num_stages, strategy)
    lost = set(lost_stages)
    bad = sorted(s for s in lost if not 0 <= s < num_stages)
    if bad:
        raise ValueError(f"lost stages {bad} out of range 0..{num_stages - 1}")
    if not lost or strategy == RecoveryStrategy.CHECKPOINT:
        return None
    if strategy in (RecoveryStrategy.RANDOM, RecoveryStrategy.ZERO):
        if len(lost) == num_stages:
            return "every stage was lost: no weights survive (a random re-init would restart training)"
        return None
    for stage in sorted(lost):
        plan = plan_rebuild(stage, num_stages, strategy, checkfree_plus)
        if not plan.recoverable:
            return plan.reason  # every plan's reason names its stage already
        gone = sorted(set(plan.sources) & lost)
        if gone:
            what = (
                "its stage-0 copies are held by" if plan.action == RebuildAction.EDGE_COPIES else "it is rebuilt from"
            )
            return f"stage {stage}: {what} stage(s) {gone}, lost at the same time"
    return None


def _clone_state(state: Mapping[str, Tensor], what: str) -> StateDict:
    out: StateDict = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"{what}: entry {key!r} is a {type(value).__name__}, not a tensor")
        out[key] = value.detach().clone()
    return out


def zeroed_state(template: Mapping[str, Tensor]) -> StateDict:
    """Every floating-point entry of `template` replaced by zeros (integer/bool buffers kept): the
    CheckFree authors' "random" baseline, which zeroes every parameter of the new stage."""
    out = _clone_state(template, "fresh_state")
    for value in out.values():
        if value.is_floating_point() or value.is_complex():
            value.zero_()
    return out


def _source(
    fetched: Mapping[int, tuple[Mapping[str, Tensor], float]], stage: int, plan: RebuildPlan
) -> tuple[Mapping[str, Tensor], float]:
    if stage not in fetched:
        raise ValueError(
            f"rebuilding stage {plan.lost_stage} ({plan.action}) needs stage {stage}'s {plan.fetch}, not fetched"
        )
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
    SourceFetch.EDGE_COPY the state dict is that stage's copy of stage-0 entries; its norm is ignored).
    fresh_state builds the stage's state dict from a new seed: required for action "fresh", and
    when given for neighbour-derived actions it also serves as the template the result must match
    (keys and shapes), which catches a neighbour serving the wrong thing; action "zero" requires it
    too (the entries to zero: floating-point ones become zeros, others are kept). checkpoint_state is the
    stage's last local save (required for action "checkpoint"). Neighbour-derived results must be
    finite. Raises UnrecoverableError for an unrecoverable plan, ValueError for missing inputs.
    """
    if not plan.recoverable:
        raise UnrecoverableError(f"stage {plan.lost_stage} cannot be rebuilt: {plan.reason}")
    if plan.action == RebuildAction.FRESH:
        if fresh_state is None:
            raise ValueError("strategy random needs fresh_state")
        return _clone_state(fresh_state(), "fresh_state")
    if plan.action == RebuildAction.ZERO:
        if fresh_state is None:
            raise ValueError("strategy zero needs fresh_state (the stage's entries)")
        return zeroed_state(fresh_state())
    if plan.action == RebuildAction.CHECKPOINT:
        if checkpoint_state is None:
            raise ValueError(f"no local checkpoint of stage {plan.lost_stage} to reload")
        return _clone_state(checkpoint_state, "checkpoint_state")

    with torch.no_grad():
        if plan.action == RebuildAction.AVERAGE:
            (prev_state, prev_norm), (next_state, next_norm) = (_source(fetched, s, plan) for s in plan.sources)
            result = checkfree_average(prev_state, next_state, prev_norm, next_norm)
        elif plan.action == RebuildAction.COPY:
            state, _ = _source(fetched, plan.sources[0], plan)
            result = _clone_state(state, f"stage {plan.sources[0]}")
        elif plan.action == RebuildAction.EDGE_COPIES:
            result = {}
            for stage in plan.sources:
                state, _ = _source(fetched, stage, plan)
                for key, value in _clone_state(state, f"stage {stage}'s edge copy").items():
                    # copies are kept in bfloat16 (protocol/stage_state.py EDGE_COPY_DTYPE); weights train in fp32
                    result.setdefault(key, value.float() if value.is_floating_point() else value)
            if not result:
                raise ValueError("the fetched edge copies are empty")
        else:  # pragma: no cover - every other RebuildAction returned or raised above
            raise ValueError(f"unknown plan action {plan.action!r}")

        if fresh_state is not None:
            template = fresh_state()
            missing, extra = sorted(set(template) - set(result)), sorted(set(result) - set(template))
            if missing or extra:
                raise ValueError(
                    f"rebuilt stage {plan.lost_stage}: missing entries {missing}, unexpected entries {extra}"
                )
            for key, t in template.items():
                if result[key].shape != t.shape:
                    raise ValueError(
                        f"rebuilt stage {plan.lost_stage}: {key!r} has shape {tuple(result[key].shape)}, expected {tuple(t.shape)}"
                    )
        for key, value in result.items():
            if value.is_floating_point() and not is_finite(value):
                raise ValueError(f"rebuilt stage {plan.lost_stage}: {key!r} holds NaN or Inf (bad neighbour weights)")
    return result


def recovered_lr_scale(lr_scale: float, plan: RebuildPlan | None = None) -> float:
    """The factor on the rebuilt stage's learning rate from now on (RecoveryConfig.lr_scale,
    1.1 small models to 1.2 at 500M): lr_scale, or 1.0 when `plan` says no scaling
    (fresh init, zeroed stage, checkpoint reload)."""
    if not lr_scale > 0:
        raise ValueError(f"lr_scale must be > 0, got {lr_scale}")
    if plan is not None and not plan.scale_lr:
        return 1.0
    return float(lr_scale)
