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
would flush a small gradient's scale to zero): `subspace8` at R = W // 9 in int8, `subspace4` at
R = 2W // 9 in int4, so both carry R + 4 bytes (int8) or R / 2 + 4 bytes (int4) a row against 2W in
fp16: 16x at W = 288 (the 15m preset), ~17x at W = 576.

Pure tensor code: no networking, no config. protocol/tensors.py frames the result.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from protocol.errors import ProtocolError

# one row's coordinates share one scale, as fp32 (little-endian)
SCALE_BYTES = 4
# the widest row a subspace tensor may have: a receiver builds the basis of a width it has not seen
# (W x R values), so a stranger must not be able to name any width; 4096 covers every preset (1b: 1280)
MAX_WIDTH = 4096
# narrower rows would get no coordinates at int8 (R = W // 9)
MIN_WIDTH = 9
_BASIS_SEED = 0x5B5  # the basis is part of the protocol: every peer must draw the same one
_CACHED_BASES = 8


def rank_of(width: int, bits: int) -> int:
    """R for a row of `width` values: W // 9 coordinates in int8, 2W // 9 in int4 (16x under fp16 at W = 288)."""
    return width // 9 if bits == 8 else 2 * width // 9


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
    scales = absmax / levels
    # an all-zero row has scale 0: divide by the smallest subnormal instead, which keeps it zeros
    q = (c / scales.clamp_min(2.0**-149)[:, None]).round_().clamp_(-levels, levels).to(torch.int8)
    if bits == 8:
        codes = q.numpy().tobytes()
    else:
        nibbles = (q.reshape(-1).numpy().astype(np.uint8)) & 0x0F
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        codes = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    return codes, scales.numpy().astype("<f4").tobytes()


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
    return c.mul_(torch.from_numpy(np.frombuffer(scales, dtype="<f4").copy())[:, None])


def encode_rows(x: torch.Tensor, bits: int) -> tuple[bytes, bytes]:
    """x [..., W] (float32, host) -> the codes and scales of its coordinates c = x P."""
    width = x.shape[-1]
    return quantize_rows(x.reshape(-1, width) @ basis(width, rank_of(width, bits)), bits)


def decode_rows(codes: memoryview, scales: memoryview, shape: list[int], bits: int) -> torch.Tensor:
    """x_hat = c P^T [*shape] float32 from the codes and scales of `shape`'s rows."""
    width = shape[-1]
    rank = rank_of(width, bits)
    rows = math.prod(shape[:-1])
    return (dequantize_rows(codes, scales, rows, rank, bits) @ basis(width, rank).T).reshape(shape)
