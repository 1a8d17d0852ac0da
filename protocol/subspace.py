"""Subspace codecs for pipeline hops: a [..., W] activation or gradient travels as its coordinates in
a fixed rank-R orthonormal basis of R^W, quantized per row (docs/wire.md).

Why a subspace: at a real preset a hop is the whole cost of a home peer (docs/wire.md has the
figures), and no per-value quantization gets 16x under fp16 without going below one bit a value.
Protocol Models (arXiv 2506.01260, Pluralis node0) and MAPL (arXiv 2606.05484) instead keep what
crosses a stage boundary in a low-dimensional subspace, and a swarm trained from its first step with
the projection on every hop learns to put what the next stage needs into it. The basis here is
fixed and known to every peer (no basis ever travels, nothing to synchronize): R columns of the
orthonormal DCT-II basis of R^W chosen by a seeded draw, with a seeded sign per row, so every
column spreads over every coordinate and per-row absmax quantization of the coordinates loses
little (the same reason TAH-Quant rotates by a Hadamard matrix before quantizing).

Forward, a hop sends c = x P and the receiver uses x_hat = c P^T (P: [W, R]). The backward
gradient with respect to x is then exactly P P^T g for the receiver's gradient g at x_hat, and P^T g
is all it needs to send: projecting the gradient costs nothing beyond what the forward projection
already did to the model. Each row's R coordinates are quantized with one fp32 absmax scale (fp16
would flush a small gradient's scale to zero, bf16 keeps its range): `subspace8` at R = W // 9 - 1
in int8, `subspace4` at twice that in int4, so both carry R + 2 bytes (int8) or R / 2 + 2 bytes
(int4) a row against 2W in fp16: 17.5x at W = 288 (the 15m preset), 17.7x at W = 576.

Token anchors (Protocol Models subtracts a frozen token embedding before sending; MAPL adds
per-stage anchor embeddings): a rank-W/9 subspace cannot carry which token a position holds, which
every later layer needs. When the hop carries its token ids (2 bytes a token as int16), the codec
sends the coordinates of x - a(t) and the receiver adds a(t) back, a(t) a fixed pseudo-random vector
per token id that both ends compute from the id alone (`anchors`: a hash, no table, no vocabulary
to agree on). So every stage sees a full-rank token identity beside the subspace part; the
gradient is unchanged (a(t) does not depend on x). The anchors' scale decides whether a stage can
read them: at the embedding's init scale (std 0.02) they vanish beside a residual stream of RMS
~1 after its norm and no layer learns to use them; at std 0.25-1.0 a block reads the token at once
(docs/wire.md has the measured sweep). Scales are bf16 rounded up (the range of fp32,
so a small gradient's scale does not flush to zero, in 2 bytes): an anchored row costs
R + 2 + 2 bytes, 35 at W = 288, 16.5x under fp16 (16.4x for the whole FORWARD message).

Pure tensor code: no networking, no config. protocol/tensors.py frames the result.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from protocol.errors import ProtocolError

# one row's coordinates share one scale, as bf16 (little-endian), rounded up so no code overflows
SCALE_BYTES = 2
# of each anchor value: the middle of the measured plateau (held-out loss on real text at width 128,
# one seed: 3.18 at 0.1, 2.83 at 0.25, 2.85 at 0.5, 2.87 at 1.0; 3.52 at the embedding's 0.02)
ANCHOR_STD = 0.5
# the token ids an anchored hop carries: int16 while they fit (every preset's 32000), else int32
ANCHOR_ID_BOUND = 1 << 31
# the widest row a subspace tensor may have: a receiver builds the basis of a width it has not seen
# (W x R values), so a stranger must not be able to name any width; 4096 covers every preset (1b: 1280)
MAX_WIDTH = 4096
# narrower rows would get no coordinates at int8 (R = W // 9 - 1)
MIN_WIDTH = 18
_BASIS_SEED = 0x5B5  # the basis is part of the protocol: every peer must draw the same one
_CACHED_BASES = 8


def rank_of(width: int, bits: int) -> int:
    """R for a row of `width` values: W // 9 - 1 coordinates in int8, 2 (W // 9 - 1) in int4, so that a
    row with its scale and its token id fits in 1/16 of its fp16 bytes, framing included (35 of 576
    bytes at W = 288)."""
    return (width // 9 - 1) * (1 if bits == 8 else 2)


def covers(shape: list[int] | torch.Size) -> bool:
    """Whether a tensor of `shape` travels in a subspace codec (else the codec falls back to int8):
    rows of MIN_WIDTH..MAX_WIDTH values, at least one row."""
    return len(shape) >= 2 and MIN_WIDTH <= shape[-1] <= MAX_WIDTH


@lru_cache(maxsize=_CACHED_BASES)
def basis(width: int, rank: int) -> torch.Tensor:
    """P [width, rank], orthonormal columns: DCT-II frequencies drawn without replacement, each row's
    sign drawn, from a seed fixed by the protocol. float32 on the host; the same on every peer."""
    if not (MIN_WIDTH <= width <= MAX_WIDTH and 1 <= rank <= width):
        raise ProtocolError(f"no subspace basis of width {width} and rank {rank}")
    rng = np.random.default_rng((_BASIS_SEED, width, rank))
    frequencies = np.sort(rng.choice(width, size=rank, replace=False))
    signs = rng.choice((-1.0, 1.0), size=width)
    n = np.arange(width, dtype=np.float64)[:, None] + 0.5
    columns = np.cos(np.pi * n * frequencies[None, :] / width) * math.sqrt(2.0 / width)
    columns[:, frequencies == 0] = math.sqrt(1.0 / width)
    return torch.from_numpy((signs[:, None] * columns).astype(np.float32))


def quantize_rows(c: torch.Tensor, bits: int) -> tuple[bytes, bytes]:
    """Coordinates [rows, R] -> (codes, scales): per row q = round(c / s), s = absmax / (2^(bits-1) - 1);
    int4 codes two to a byte, low nibble first. ProtocolError on a non-finite value."""
    levels = (1 << (bits - 1)) - 1
    absmax = c.abs().amax(dim=1)
    if absmax.numel() and not math.isfinite(float(absmax.max())):  # max propagates NaN
        raise ProtocolError("subspace compression needs finite values; use fp16/bf16/none for this tensor")
    exact = absmax / levels
    scales = exact.to(torch.bfloat16)
    low = scales.float() < exact  # rounded down: one bf16 step up, so |c / scale| <= levels holds
    scales[low] = torch.nextafter(scales[low], torch.full_like(scales[low], math.inf))
    # an all-zero row has scale 0: divide by the smallest subnormal instead, which keeps it zeros
    divisors = scales.float().clamp_min(2.0**-149)[:, None]
    q = (c / divisors).round_().clamp_(-levels, levels).to(torch.int8)
    if bits == 8:
        codes = q.numpy().tobytes()
    else:
        nibbles = (q.reshape(-1).numpy().astype(np.uint8)) & 0x0F
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        codes = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    return codes, scales.view(torch.int16).numpy().tobytes()


def code_bytes(rows: int, rank: int, bits: int) -> int:
    """Bytes of the codes of `rows` rows of `rank` coordinates at `bits` a code."""
    return rows * rank if bits == 8 else -(-(rows * rank) // 2)


def dequantize_rows(codes: memoryview, scales: memoryview, rows: int, rank: int, bits: int) -> torch.Tensor:
    """The inverse of quantize_rows: [rows, R] float32. Sizes are the caller's to check first."""
    if bits == 8:
        q = np.frombuffer(codes, dtype=np.int8).astype(np.float32)
    else:
        packed = np.frombuffer(codes, dtype=np.uint8)
        nibbles = np.empty(packed.size * 2, dtype=np.int16)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        q = (nibbles[: rows * rank] - ((nibbles[: rows * rank] & 0x8) << 1)).astype(np.float32)  # sign-extend
    c = torch.from_numpy(q).reshape(rows, rank)
    row_scales = torch.frombuffer(bytearray(scales), dtype=torch.bfloat16).float()
    return c.mul_(row_scales[:, None])


# splitmix64's multipliers as signed 64-bit ints: torch's int64 arithmetic wraps around like uint64's
_MIX = [c - (1 << 64) if c >= 1 << 63 else c for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]


def anchors(ids: torch.Tensor, width: int) -> torch.Tensor:
    """a(t) [len(ids), width] float32: value j of token t uniform in +-sqrt(3) ANCHOR_STD, from a
    splitmix64-style hash of (t, j) alone: the same on every peer, nothing to store or agree on."""
    z = ids.reshape(-1, 1).to(torch.int64) * _MIX[0] + torch.arange(width, dtype=torch.int64)[None, :] * _MIX[1]
    z = z ^ (z >> 31)
    z = z * _MIX[2]
    z = z ^ (z >> 29)
    z = z * _MIX[1]
    unit = ((z >> 8) & 0xFFFFFF).to(torch.float32) * (2.0 / (1 << 24)) - 1.0  # 24 high-ish bits in [-1, 1)
    return unit.mul_(math.sqrt(3.0) * ANCHOR_STD)


def encode_rows(x: torch.Tensor, bits: int, anchor_ids: torch.Tensor | None = None) -> tuple[bytes, bytes]:
    """x [..., W] (float32, host) -> the codes and scales of its coordinates c = (x - a(t)) P, a(t)
    the anchors of `anchor_ids` (one id a row) or none."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if anchor_ids is not None:
        rows = rows - anchors(anchor_ids, width)
    return quantize_rows(rows @ basis(width, rank_of(width, bits)), bits)


def decode_rows(
    codes: memoryview, scales: memoryview, shape: list[int], bits: int, anchor_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """x_hat = a(t) + c P^T [*shape] float32 from the codes and scales of `shape`'s rows."""
    width = shape[-1]
    rank = rank_of(width, bits)
    rows = math.prod(shape[:-1])
    x = dequantize_rows(codes, scales, rows, rank, bits) @ basis(width, rank).T
    if anchor_ids is not None:
        x += anchors(anchor_ids, width)
    return x.reshape(shape)
