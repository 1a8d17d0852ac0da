"""Tensor codec: a torch tensor <-> a plain msgpack-able dict of little-endian bytes.

Wire layout (all keys required unless noted):
    {"dtype": "float32", "codec": "none"|"fp16"|"bf16"|"int8"|"subspace8"|"subspace4", "shape": [int, ...],
     "data": bytes, "block": int, "scales": bytes, "anchored": bool}
"block" only (and always) for int8, "scales" for int8 and the subspace codecs, "anchored" for the
subspace codecs only (whether the rows were sent relative to the message's token ids). "dtype" is the
original dtype the receiver gets back; "codec" says how "data" is stored. A subspace codec stores a
[..., W] tensor's coordinates in a fixed basis (protocol/subspace.py): what the receiver gets back
is the tensor's projection onto that subspace, which a swarm using it trains through.
"""

from __future__ import annotations

import math
import sys
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from protocol import subspace
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

# torch and numpy buffers are native-endian and we ship them as-is; every machine we run on is
# little-endian, so refuse to start rather than silently exchange byte-swapped garbage.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("protocol.tensors assumes a little-endian host")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Compression(StrEnum):
    """How floating tensors travel on the wire (the receiver always gets the original dtype back)."""

    NONE = "none"  # the tensor's own dtype, bit-exact
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"  # blockwise absmax int8 with fp32 scales
    # a row's coordinates in a fixed rank-(W//9 - 1) subspace, int8 (protocol/subspace.py); rows outside
    # the subspace codecs' widths (and 1-d tensors) go in int8
    SUBSPACE8 = "subspace8"
    SUBSPACE4 = "subspace4"  # ... twice the rank, int4


SUBSPACE_BITS = {Compression.SUBSPACE8: 8, Compression.SUBSPACE4: 4}


COMPRESSIONS = tuple(Compression)
FP16_MAX = torch.finfo(torch.float16).max  # 65504: larger values overflow to inf
# bytes per element of "data" for each lossy codec ("none" uses the original dtype's itemsize)
_CODEC_ITEMSIZE = {"fp16": 2, "bf16": 2, "int8": 1}
# the 16-bit codecs' wire dtypes (little-endian, as every tensor on the wire)
_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# int8 scales are fp32: fp16 would flush the scales of typical gradients (absmax ~1e-6) to zero
_SCALE_ITEMSIZE = 4
_MAX_BLOCK = 1 << 30
_NO_SCALES_KEYS = frozenset({"dtype", "codec", "shape", "data"})
_INT8_KEYS = _NO_SCALES_KEYS | {"block", "scales"}
_SUBSPACE_KEYS = _NO_SCALES_KEYS | {"scales", "anchored"}


def encode_tensor(
    t: torch.Tensor, compression: str = "none", block_size: int = 256, anchor_ids: torch.Tensor | None = None
) -> dict:
    """Encode a tensor; compression applies to floating tensors only, others always go as-is.

    "data" is a fresh bytes copy, or a view of the fp16/bf16 conversion made for it alone, so the
    caller may keep mutating the tensor (e.g. an optimizer step) while the encoded dict waits in a
    send queue. Raises ProtocolError on an unsupported dtype or compression, or non-finite values
    with int8 (they have no int8 representation). `anchor_ids` (one integer a row of `t`): a
    subspace codec sends `t` relative to those ids' anchors (protocol/subspace.py); the receiver
    needs the same ids to decode it.
    """
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"expected a torch.Tensor, got {type(t).__name__}")
    if compression not in COMPRESSIONS:
        raise ProtocolError(f"unknown compression {compression!r} (expected one of {COMPRESSIONS})")
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ProtocolError(f"unsupported tensor dtype {t.dtype} (supported: {sorted(DTYPES)})")
    t = t.detach().cpu().contiguous()
    codec = compression if t.dtype in FLOAT_DTYPES else "none"
    if (codec == "fp16" and t.dtype == torch.float16) or (codec == "bf16" and t.dtype == torch.bfloat16):
        codec = "none"
    if codec in SUBSPACE_BITS and not subspace.covers(t.shape):
        codec = "int8"
    if codec == "fp16" and t.numel() and _beyond_fp16(t):
        # fp16 would turn these finite values into inf, which the receiver must treat as hostile:
        # the tensor goes in its own dtype instead (the codec is per tensor, the receiver decodes both)
        codec = "none"
    out: dict[str, Any] = {"dtype": name, "codec": codec, "shape": list(t.shape)}
    if codec == "none":
        out["data"] = _to_bytes(t)
    elif codec == "fp16":
        out["data"] = _view_of_fresh(t.to(torch.float16))
    elif codec == "bf16":
        out["data"] = _view_of_fresh(t.to(torch.bfloat16))
    elif codec in SUBSPACE_BITS:
        if anchor_ids is not None and tuple(anchor_ids.shape) != tuple(t.shape[:-1]):
            raise ProtocolError(f"anchor ids of shape {list(anchor_ids.shape)} for rows of shape {list(t.shape[:-1])}")
        out["data"], out["scales"] = subspace.encode_rows(t.to(torch.float32), SUBSPACE_BITS[codec], anchor_ids)
        out["anchored"] = anchor_ids is not None
    else:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= _MAX_BLOCK:
            raise ProtocolError(f"int8 block_size must be an int in [1, {_MAX_BLOCK}], got {block_size!r}")
        q, scales = _quantize_int8(t.reshape(-1).to(torch.float32), block_size)
        out.update(data=_to_bytes(q), block=block_size, scales=_to_bytes(scales))
    return out


def wire_nbytes(t: torch.Tensor, compression: str = "none", block_size: int = 256) -> int:
    """Bytes of "data" (and "scales") `encode_tensor(t, compression, block_size)` writes, without
    encoding: what a sender weighs before choosing a codec. A float16 tensor whose values exceed
    fp16's range goes in its own dtype, which this does not look for (it would read every value)."""
    codec = compression if t.dtype in FLOAT_DTYPES else "none"
    if (codec == "fp16" and t.dtype == torch.float16) or (codec == "bf16" and t.dtype == torch.bfloat16):
        codec = "none"
    numel = t.numel()
    if codec in SUBSPACE_BITS and not subspace.covers(t.shape):
        codec = "int8"
    if codec == "none":
        return numel * t.dtype.itemsize
    if codec in SUBSPACE_BITS:
        rows, bits = numel // t.shape[-1], SUBSPACE_BITS[codec]
        return subspace.code_bytes(rows, subspace.rank_of(t.shape[-1], bits), bits) + rows * subspace.SCALE_BYTES
    if codec == "int8":
        return numel + math.ceil(numel / block_size) * _SCALE_ITEMSIZE
    return numel * _CODEC_ITEMSIZE[codec]


def decode_tensor(obj: Any, limits: Limits = DEFAULT_LIMITS, anchor_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Validate an encoded tensor dict and rebuild the tensor in its original dtype.

    Every size is checked with Python ints before anything is allocated. The result is always
    writable and owns its memory, except when "data" is a writable buffer (bytearray, writable
    memoryview) with codec "none": then the tensor is a zero-copy view over that buffer. Bytes
    (what msgpack produces) are immutable and CPython shares 1-byte bytes objects process-wide,
    so we copy them once instead of handing out a tensor that could write into them.
    Values are not checked for finiteness; that is the training layer's call. An anchored
    subspace tensor needs `anchor_ids`, one integer a row (protocol/messages.py passes the
    message's token ids); any other tensor ignores them.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"tensor must be a map, got {type(obj).__name__}")
    dtype_name, codec = obj.get("dtype"), obj.get("codec")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ProtocolError(f"unsupported tensor dtype {dtype_name!r:.80}")
    if not isinstance(codec, str) or codec not in COMPRESSIONS:
        raise ProtocolError(f"unknown tensor codec {codec!r:.80}")
    dtype = DTYPES[dtype_name]
    if codec != "none" and dtype not in FLOAT_DTYPES:
        raise ProtocolError(f"codec {codec!r} is only valid for floating tensors, not {dtype_name}")
    expected_keys = _INT8_KEYS if codec == "int8" else _SUBSPACE_KEYS if codec in SUBSPACE_BITS else _NO_SCALES_KEYS
    if obj.keys() != expected_keys:
        raise ProtocolError(f"tensor map keys {sorted(map(str, obj))} != {sorted(expected_keys)}")

    shape = _check_shape(obj["shape"], limits)
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    if numel * itemsize > limits.max_tensor_bytes:
        raise ProtocolError(
            f"tensor of shape {shape} {dtype_name} needs {numel * itemsize} bytes "
            f"> max_tensor_bytes {limits.max_tensor_bytes}"
        )
    data = _check_buffer(obj["data"], "data")
    if codec in SUBSPACE_BITS:
        anchored = obj["anchored"]
        if not isinstance(anchored, bool):
            raise ProtocolError(f"subspace 'anchored' must be a bool, got {type(anchored).__name__}")
        if anchored and (anchor_ids is None or list(anchor_ids.shape) != shape[:-1] or anchor_ids.is_floating_point()):
            raise ProtocolError(f"an anchored subspace tensor of shape {shape} needs integer ids of shape {shape[:-1]}")
        ids = anchor_ids if anchored else None
        return _decode_subspace(data, obj["scales"], shape, SUBSPACE_BITS[codec], ids).to(dtype)
    wire_itemsize = itemsize if codec == "none" else _CODEC_ITEMSIZE[codec]
    if len(data) != numel * wire_itemsize:
        raise ProtocolError(
            f"tensor data has {len(data)} bytes, shape {shape} with codec {codec!r} needs {numel * wire_itemsize}"
        )
    scales = _check_int8(obj["block"], obj["scales"], numel) if codec == "int8" else None
    if numel == 0:
        return torch.empty(shape, dtype=dtype)

    if codec == "none":
        if data.readonly:
            data = memoryview(bytearray(data))
        flat = torch.frombuffer(data, dtype=dtype)
    elif codec in ("fp16", "bf16"):
        # widening is exact; torch's conversion is vectorized where numpy's float16 one is not (0.12
        # against 0.02 ms for a 32k-element activation here). The bytearray copy makes the buffer
        # writable for torch (msgpack's bytes are not) and is ~3 us of that.
        flat = torch.frombuffer(bytearray(data), dtype=_WIRE_DTYPES[codec]).to(torch.float32)
    else:
        flat = _dequantize_int8(data, obj["block"], scales, numel)
    return flat.to(dtype).reshape(shape)


def _decode_subspace(
    data: memoryview, scales_obj: Any, shape: list[int], bits: int, anchor_ids: torch.Tensor | None
) -> torch.Tensor:
    """Sizes first (the rows' width is within the codec's, the codes and scales fill the rows
    exactly), then the projection back to the rows' width (protocol/subspace.py)."""
    if not subspace.covers(shape):
        raise ProtocolError(
            f"subspace codec needs rows of {subspace.MIN_WIDTH}..{subspace.MAX_WIDTH} values, got shape {shape}"
        )
    rows = math.prod(shape[:-1])
    rank = subspace.rank_of(shape[-1], bits)
    scales = _check_buffer(scales_obj, "scales")
    if len(data) != subspace.code_bytes(rows, rank, bits) or len(scales) != rows * subspace.SCALE_BYTES:
        raise ProtocolError(
            f"subspace{bits} tensor of shape {shape} needs {subspace.code_bytes(rows, rank, bits)} bytes of codes "
            f"and {rows * subspace.SCALE_BYTES} of scales, got {len(data)} and {len(scales)}"
        )
    if rows == 0:
        return torch.empty(shape)
    return subspace.decode_rows(data, scales, shape, bits, anchor_ids)


def _beyond_fp16(t: torch.Tensor) -> bool:
    """Whether a value of `t` is outside fp16's range: one pass, no |t| copy on the hop path, and the
    comparison on Python floats (two tensor comparisons cost more than the pass itself)."""
    low, high = torch.aminmax(t)
    return high.item() > FP16_MAX or low.item() < -FP16_MAX


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same 16 bits as int16
        t = t.view(torch.int16)
    return t.numpy()


def _to_bytes(t: torch.Tensor) -> bytes:
    return _as_numpy(t).tobytes()


def _view_of_fresh(t: torch.Tensor) -> memoryview | bytes:
    """The bytes of a tensor made for this encoding alone (a conversion's result), without the copy
    `_to_bytes` makes: nobody else holds it, so nothing can change it before it is packed."""
    return memoryview(_as_numpy(t)).cast("B") if t.numel() else b""


def _check_shape(shape: Any, limits: Limits) -> list[int]:
    if not isinstance(shape, list):
        raise ProtocolError(f"tensor shape must be a list, got {type(shape).__name__}")
    if len(shape) > limits.max_tensor_dims:
        raise ProtocolError(f"tensor has {len(shape)} dims > max_tensor_dims {limits.max_tensor_dims}")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ProtocolError(f"tensor shape {shape!r} must hold non-negative ints")
    return shape


def _check_buffer(value: Any, what: str) -> memoryview:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"tensor {what} must be bytes, got {type(value).__name__}")
    view = memoryview(value)
    if not view.c_contiguous:
        raise ProtocolError(f"tensor {what} must be a contiguous byte buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _blocks(numel: int, block: int) -> tuple[int, int]:
    """(number of full blocks, size of the trailing partial block)."""
    return numel // block, numel % block


def _quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = absmax / 127, q = round(x / scale). Every int8 hop over a slow link runs
    this on the event loop, and at a 32k-element activation the cost is mostly torch's per-op
    overhead, so it takes as few ops as it can."""
    full, tail = _blocks(x.numel(), block)
    if not full and not tail:
        return torch.empty(0, dtype=torch.int8), torch.empty(0)
    blocks, rest = x[: full * block].view(full, block), x[full * block :]
    absmax = [blocks.abs().amax(dim=1)] if full else []
    if tail:
        absmax.append(rest.abs().amax().reshape(1))
    amax = torch.cat(absmax) if len(absmax) > 1 else absmax[0]
    # the largest block maximum carries any NaN or inf of the tensor (max propagates NaN)
    if not math.isfinite(float(amax.max())):
        raise ProtocolError("int8 compression needs finite values; use fp16/bf16/none for this tensor")
    scales = amax.div_(127.0)
    # an all-zero block has scale 0: divide by the smallest subnormal instead, which keeps it zeros.
    # The clamp is for subnormal scales, whose rounding can put x / scale past 127
    divisors = scales.clamp_min(2.0**-149)
    scaled = torch.empty_like(x)  # one buffer, rounded and clamped in place
    if full:
        torch.div(blocks, divisors[:full, None], out=scaled[: full * block].view(full, block))
    if tail:
        torch.div(rest, divisors[full], out=scaled[full * block :])
    return scaled.round_().clamp_(-127, 127).to(torch.int8), scales


def _check_int8(block: Any, scales_obj: Any, numel: int) -> memoryview:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= _MAX_BLOCK:
        raise ProtocolError(f"int8 block must be an int in [1, {_MAX_BLOCK}], got {block!r}")
    scales = _check_buffer(scales_obj, "scales")
    nblocks = -(-numel // block)
    if len(scales) != nblocks * _SCALE_ITEMSIZE:
        raise ProtocolError(f"int8 scales have {len(scales)} bytes, {nblocks} blocks need {nblocks * _SCALE_ITEMSIZE}")
    return scales


def _dequantize_int8(data: memoryview, block: int, scales_buf: memoryview, numel: int) -> torch.Tensor:
    full, tail = _blocks(numel, block)
    scales = torch.from_numpy(np.frombuffer(scales_buf, dtype="<f4").copy())
    x = torch.from_numpy(np.frombuffer(data, dtype=np.int8).astype(np.float32))
    # no padding to a whole block: a hostile block of 2**30 with 1 element must not allocate 4 GiB
    if full:
        x[: full * block].view(full, block).mul_(scales[:full, None])
    if tail:
        x[full * block :].mul_(scales[full])
    return x
