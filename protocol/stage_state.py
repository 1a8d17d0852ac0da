"""A stage's state on the wire: the STATE_HEADER that describes it and the byte payload it becomes.

Pure codec, no networking: node/recovery/state_transfer.py moves the header, the STATE_CHUNKs and
the STATE_END over a "state" session; this module builds and checks what they carry.

The payload is the raw bytes of every tensor (C order, native little-endian) concatenated in the
header's `names` order; the first `num_weights` names are module weights, then the NoLoCo outer
state (prefixed "outer."), then the inner AdamW's moments (prefixed "moments.": "exp_avg.<weight>"
and "exp_avg_sq.<weight>", shaped like their weight; `optimizer_steps` is AdamW's step count for
its bias correction). checksum = sha256 hex of the payload. `check_header` validates a
header before the receiver allocates anything (docs/recovery.md, "State transfer").
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor

from protocol.errors import ProtocolError

__all__ = [
    "CHUNK_BYTES",
    "MAX_STATE_BYTES",
    "MOMENTS_DTYPE",
    "MOMENTS_PREFIX",
    "MOMENT_KINDS",
    "OUTER_PREFIX",
    "PARTS",
    "PART_KEYS",
    "STATE_DTYPES",
    "StageState",
    "StateLayout",
    "StatePart",
    "StateUnavailable",
    "check_checksum",
    "check_header",
    "decode_payload",
    "encode_state",
    "payload_hasher",
]

CHUNK_BYTES = 4 << 20  # well under the 256 MiB frame limit; a few ms of hashing per chunk
MAX_STATE_BYTES = 8 << 30  # refuse to allocate more than this for one download, whatever the header says
OUTER_PREFIX = "outer."
MOMENTS_PREFIX = "moments."
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")  # AdamW's first and second moment, per weight
# weights and outer state are floats; the payload is raw bytes, so each dtype only needs a name
STATE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in STATE_DTYPES.items()}


class StatePart(StrEnum):
    """What of the donor's stage a STATE_REQUEST asks for (sent as its plain string value)."""

    STAGE = "stage"  # the whole stage: module weights, outer state, optimizer moments, counters (joining it)
    WEIGHTS = "weights"  # the same without the optimizer moments (CheckFree sources, node export)
    EMBED = "embed"  # stage 0 only: embed_tokens.weight (a CheckFree+ edge copy, kept by stage 1)
    HEAD = "head"  # stage 0 only: norm.weight and lm_head.weight (edge copy kept by stage S)
    EDGE_COPY = "edge_copy"  # stage 1 / stage S only: the stage-0 entries this peer keeps


PARTS = tuple(StatePart)
# the stage-0 state-dict entries that make up each edge part
PART_KEYS: dict[StatePart, tuple[str, ...]] = {
    StatePart.EMBED: ("embed_tokens.weight",),
    StatePart.HEAD: ("norm.weight", "lm_head.weight"),
}
# edge parts travel and are kept in bfloat16: half of fp32's bytes on stage 0's uplink every refresh
# (37 MB -> 18 MB per part at 15m), and a copy is an emergency start for a rebuilt stage 0, already
# up to edge_copy_interval steps stale; bfloat16 keeps fp32's range, so no weight becomes inf
EDGE_COPY_DTYPE = torch.bfloat16
# AdamW's moments travel in bfloat16 too: 4 bytes a weight instead of 8, and fp16 would flush second
# moments to zero (a 15m block stage's are ~1e-11); moments only need a few significant bits
MOMENTS_DTYPE = torch.bfloat16


class StateUnavailable(ValueError):
    """This peer cannot serve the requested part right now (wrong stage, no edge copy yet, not online)."""


@dataclass
class StageState:
    """What a peer of a stage hands a joiner: its weights, outer state, inner optimizer and counters."""

    stage: int
    weights: dict[str, Tensor]
    outer: dict[str, Tensor] = field(default_factory=dict)  # NoLoCo phi (and momentum), may be empty
    # AdamW's moments, "exp_avg.<weight>" / "exp_avg_sq.<weight>"; empty before the donor's first step
    moments: dict[str, Tensor] = field(default_factory=dict)
    optimizer_steps: int = 0  # AdamW's own step count (its bias correction), with the moments
    inner_step: int = 0
    outer_round: int = 0
    grad_norm: float | None = None
    lr_scale: float = 1.0  # a rebuilt stage keeps lr x 1.1; its later replicas must train alike
    donor: str | None = None  # the peer it was downloaded from (None: taken locally)


# ------------------------------------------------------------------------------------------------
# Encoding (the donor)


def payload_hasher() -> Any:
    """A fresh hash object of the kind `checksum` names (update it chunk by chunk)."""
    return hashlib.sha256()


def encode_state(state: StageState, part: StatePart | str, chunk_bytes: int = CHUNK_BYTES) -> tuple[dict, Tensor]:
    """The STATE_HEADER meta and the payload (one uint8 tensor) for `state`. CPU work (copies and
    hashes the whole stage): call it off the event loop."""
    names = [*state.weights, *(OUTER_PREFIX + n for n in state.outer), *(MOMENTS_PREFIX + n for n in state.moments)]
    tensors = [*state.weights.values(), *state.outer.values(), *state.moments.values()]
    flat = []
    for name, t in zip(names, tensors):
        if t.dtype not in _DTYPE_NAMES:
            raise StateUnavailable(f"{name}: dtype {t.dtype} cannot be transferred")
        flat.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    payload = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    hasher = payload_hasher()
    hasher.update(payload.numpy().data)
    meta = {
        "stage": state.stage,
        "part": str(part),  # a plain string on the wire
        "names": names,
        "shapes": [list(t.shape) for t in tensors],
        "dtypes": [_DTYPE_NAMES[t.dtype] for t in tensors],
        "total_bytes": payload.numel(),
        "checksum": hasher.hexdigest(),
        "chunk_bytes": chunk_bytes,
        "num_weights": len(state.weights),
        "inner_step": state.inner_step,
        "outer_round": state.outer_round,
        "grad_norm": state.grad_norm,
        "lr_scale": state.lr_scale,
        "optimizer_steps": state.optimizer_steps,
    }
    return meta, payload


# ------------------------------------------------------------------------------------------------
# Decoding (the joiner)


@dataclass(frozen=True)
class StateLayout:
    """A checked STATE_HEADER: what the payload holds, where, and how it is chunked."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    num_weights: int
    total_bytes: int
    chunk_bytes: int
    checksum: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_header(
    meta: Mapping, stage: int, part: StatePart | str, max_bytes: int, expect: Mapping[str, Sequence[int]] | None
) -> StateLayout:
    """Validate a STATE_HEADER against the request and our limits; nothing is allocated yet.
    `expect` (name -> shape of our own weights) rejects a donor serving another architecture.
    The message schema (protocol/messages.py) already checked the required keys' types."""
    if meta.get("stage") != stage or meta.get("part") != part:
        raise ProtocolError(
            f"asked for stage {stage} part {str(part)!r}, got stage {meta.get('stage')!r} part {meta.get('part')!r}"
        )
    names, shapes, dtypes = meta["names"], meta["shapes"], meta.get("dtypes")
    if not isinstance(dtypes, list) or not len(names) == len(shapes) == len(dtypes):
        raise ProtocolError("state header: names, shapes and dtypes must be lists of the same length")
    if len(set(names)) != len(names):
        raise ProtocolError("state header: duplicate tensor names")
    num_weights = meta.get("num_weights")
    if not _is_int(num_weights) or not 0 <= num_weights <= len(names):
        raise ProtocolError(f"state header: num_weights {num_weights!r} out of range")
    _check_sections(names, shapes, num_weights)
    total, torch_dtypes = 0, []
    for name, shape, dtype in zip(names, shapes, dtypes):
        if dtype not in STATE_DTYPES:
            raise ProtocolError(f"state header: {name}: dtype {dtype!r} not allowed")
        if len(shape) > 8:
            raise ProtocolError(f"state header: {name}: {len(shape)} dimensions")
        torch_dtypes.append(STATE_DTYPES[dtype])
        numel = math.prod(shape)  # every dim is an int >= 0 (the message schema checked it)
        total += numel * torch_dtypes[-1].itemsize
        # checked per tensor: a hostile header cannot make us sum a million huge shapes first
        if total > max_bytes:
            raise ProtocolError(f"state header: the tensors need more than max_bytes {max_bytes}")
    if meta["total_bytes"] != total:
        raise ProtocolError(f"state header: total_bytes {meta['total_bytes']} but the shapes need {total}")
    if expect is not None:
        got = {name: tuple(shape) for name, shape in zip(names[:num_weights], shapes[:num_weights])}
        want = {name: tuple(shape) for name, shape in expect.items()}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:4]
            raise ProtocolError(f"state header: weights do not match this stage's module: {diff}")
    chunk_bytes = meta.get("chunk_bytes")
    if not _is_int(chunk_bytes) or chunk_bytes < 1:
        raise ProtocolError(f"state header: chunk_bytes {chunk_bytes!r} must be a positive int")
    checksum = meta["checksum"]
    if len(checksum) != 64:
        raise ProtocolError("state header: checksum is not a sha256 hex digest")
    for key in ("inner_step", "outer_round", "optimizer_steps"):
        if not _is_int(meta.get(key)) or meta[key] < 0:
            raise ProtocolError(f"state header: {key} must be an int >= 0")
    if meta["optimizer_steps"] == 0 and any(name.startswith(MOMENTS_PREFIX) for name in names):
        raise ProtocolError("state header: optimizer moments without a step count (AdamW would divide by zero)")
    grad_norm, lr_scale = meta.get("grad_norm"), meta.get("lr_scale")
    if grad_norm is not None and not (
        isinstance(grad_norm, (int, float)) and math.isfinite(grad_norm) and grad_norm >= 0
    ):
        raise ProtocolError(f"state header: grad_norm {grad_norm!r} must be a finite number >= 0 or null")
    if not (isinstance(lr_scale, (int, float)) and math.isfinite(lr_scale) and 0 < lr_scale <= 100):
        raise ProtocolError(f"state header: lr_scale {lr_scale!r} out of range")
    return StateLayout(names, [tuple(s) for s in shapes], torch_dtypes, num_weights, total, chunk_bytes, checksum)


def _check_sections(names: Sequence[str], shapes: Sequence[Sequence[int]], num_weights: int) -> None:
    """Weights first, then the outer state, then the moments; each moment named after a weight of
    the header and shaped like it (so `expect`, checking the weights, bounds the moments too)."""
    weights = dict(zip(names[:num_weights], shapes[:num_weights]))
    if any(name.startswith((OUTER_PREFIX, MOMENTS_PREFIX)) for name in weights):
        raise ProtocolError("state header: the weights must come first, unprefixed")
    rest = names[num_weights:]
    outer = sum(1 for _ in itertools.takewhile(lambda name: name.startswith(OUTER_PREFIX), rest))
    for name, shape in zip(rest[outer:], shapes[num_weights + outer :]):
        kind, _, weight = name.removeprefix(MOMENTS_PREFIX).partition(".")
        if not name.startswith(MOMENTS_PREFIX) or kind not in MOMENT_KINDS or weights.get(weight) != shape:
            raise ProtocolError(
                f"state header: {name!r}: after the weights come {OUTER_PREFIX!r} names, then {MOMENTS_PREFIX!r} "
                f"names of a moment ({', '.join(MOMENT_KINDS)}) of a weight, shaped like it"
            )


def check_checksum(computed: str, layout: StateLayout, end_checksum: object) -> None:
    """The checksum is announced twice (header and STATE_END) and computed: all three must agree."""
    if not computed == layout.checksum == end_checksum:
        raise ProtocolError(
            f"checksum mismatch (computed {computed[:12]}, header {layout.checksum[:12]}, end {str(end_checksum)[:12]})"
        )


def decode_payload(payload: Tensor, layout: StateLayout, meta: Mapping) -> StageState:
    """The StageState a complete, checksum-checked payload holds (`meta`: its checked header)."""
    weights, outer, moments, offset = {}, {}, {}, 0
    for index, (name, shape, dtype) in enumerate(zip(layout.names, layout.shapes, layout.dtypes)):
        size = math.prod(shape) * dtype.itemsize
        # clone first: a view of the shared buffer at an odd offset cannot be reinterpreted as float
        tensor = payload[offset : offset + size].clone().view(dtype).reshape(shape)
        offset += size
        if index < layout.num_weights:
            weights[name] = tensor
        elif name.startswith(OUTER_PREFIX):
            outer[name.removeprefix(OUTER_PREFIX)] = tensor
        else:  # check_header allowed nothing else
            moments[name.removeprefix(MOMENTS_PREFIX)] = tensor
    grad_norm = meta.get("grad_norm")
    return StageState(
        stage=meta["stage"],
        weights=weights,
        outer=outer,
        moments=moments,
        optimizer_steps=meta["optimizer_steps"],
        inner_step=meta["inner_step"],
        outer_round=meta["outer_round"],
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr_scale=float(meta["lr_scale"]),
    )
