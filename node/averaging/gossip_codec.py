"""What a NoLoCo round puts on the wire at real size: under 1 byte a parameter each way (pure).

A round used to move phi and Delta in fp32 both ways: 16 bytes a parameter, 283 MB for a `125m`
block stage, which a 50 Mbit/s home uplink cannot move in any sensible time. What crosses now
(docs/gossip.md, "A round on the wire"):

- **Delta, 4 bits a value with error feedback.** Blockwise absmax quantization (BLOCK values share
  one fp32 scale; levels -7..7, two to a byte), as SparseLoCo and Streaming DiLoCo do for outer
  gradients. What the rounding drops is kept in an error-feedback residual and added to the next
  Delta this replica sends, so over rounds partners receive all of its progress; the residual is
  committed only when a round is applied (a round that fails sent nothing).
- **phi, a strided sample in fp32.** The pull term needs phi_j - phi_i, and honest replicas' phi
  differ by less than fp16's rounding, so phi cannot be quantized; it is sampled instead: the
  coordinates offset, offset + stride, offset + 2 stride, ... of every tensor (flattened), exact.
  The initiator draws the offset per round and names it in its request, so both sides sample the
  same coordinates, and over rounds every coordinate is pulled. The pull (and the plausibility
  checks of phi) act on the sampled coordinates only; Delta is applied to all of them.

At the default stride 10 and block 64 a direction carries 0.5 + 4/64 + 4/10 = 0.9625 bytes a
parameter: a round moves 1.925 bytes a parameter in total, 8.3x less than before. DiLoCo rounds
send Delta alone.

Everything here runs on the stage's device (the compute thread); the codes, scales and samples
are copied to the host for the wire by the caller. Sizes are a function of the parameter shapes
and the codec: the receiver allocates its buffers from its own shapes, never from the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_PHI_STRIDE",
    "GossipCodec",
    "PhiSample",
    "WireLayout",
    "dequantize4",
    "quantize4",
]

LEVELS = 7  # symmetric 4-bit levels -7..7; a nibble holds q + 8 in 1..15
DEFAULT_BLOCK = 64  # values per fp32 scale: 1/16 byte a value of scales
DEFAULT_PHI_STRIDE = 10  # one phi coordinate in 10 per round: 0.4 bytes a parameter
_TINY = 2.0**-126  # divisor for an all-zero block (keeps its codes at zero)


def quantize4(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """(codes, scales) of the flat float tensor `x`: per block of `block` values (the last one
    zero-padded), scale = absmax / 7 and q = round(x / scale) in -7..7, stored as q + 8 two to a
    byte (the first value in the low nibble). codes: uint8, ceil(numel / block) * block / 2;
    scales: fp32, ceil(numel / block). On x's device."""
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even number >= 2, got {block}")
    numel = x.numel()
    blocks = math.ceil(numel / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:numel] = x.reshape(-1)
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1).div_(LEVELS)
    q = torch.div(grid, scales.clamp_min(_TINY)[:, None]).round_().clamp_(-LEVELS, LEVELS)
    nibbles = (q + (LEVELS + 1)).to(torch.uint8)
    codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return codes.reshape(-1), scales


def dequantize4(codes: Tensor, scales: Tensor, numel: int, block: int) -> Tensor:
    """The flat fp32 tensor of `numel` values that `quantize4` encoded (on the codes' device)."""
    blocks = scales.numel()
    if codes.numel() * 2 != blocks * block or blocks != math.ceil(numel / block):
        raise ValueError(f"{codes.numel()} code bytes and {blocks} scales do not encode {numel} values")
    pairs = codes.view(blocks, block // 2)
    grid = torch.empty(blocks, block, dtype=torch.float32, device=codes.device)
    grid[:, 0::2] = (pairs & 0x0F).to(torch.float32)
    grid[:, 1::2] = (pairs >> 4).to(torch.float32)
    grid.sub_(LEVELS + 1).mul_(scales.to(torch.float32)[:, None])
    return grid.reshape(-1)[:numel]


@dataclass(frozen=True)
class PhiSample:
    """Which phi coordinates a round exchanges: flat[offset::stride] of every tensor."""

    offset: int
    stride: int

    def take(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The sampled coordinates of each tensor, flattened (views: copy before they change)."""
        return [t.reshape(-1)[self.offset :: self.stride] for t in tensors]

    def count(self, numel: int) -> int:
        return len(range(self.offset, numel, self.stride))


@dataclass(frozen=True)
class WireLayout:
    """The shapes and dtypes of one direction's tensors, in order: for each parameter tensor its phi
    sample (fp32, with phi), then its Delta codes (uint8) and scales (fp32)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class GossipCodec:
    """How one stage's rounds encode phi and Delta (gossip.phi_stride, gossip.delta_block)."""

    block: int = DEFAULT_BLOCK
    phi_stride: int = DEFAULT_PHI_STRIDE

    def layout(self, numels: Sequence[int], sample: PhiSample | None) -> WireLayout:
        """What a direction carries for parameters of `numels` values: phi samples when `sample` is
        given (a NoLoCo round), Delta codes and scales always."""
        shapes: list[tuple[int, ...]] = []
        dtypes: list[torch.dtype] = []
        if sample is not None:
            shapes += [(sample.count(n),) for n in numels]
            dtypes += [torch.float32] * len(numels)
        for n in numels:
            blocks = math.ceil(n / self.block)
            shapes += [(blocks * self.block // 2,), (blocks,)]
            dtypes += [torch.uint8, torch.float32]
        return WireLayout(tuple(shapes), tuple(dtypes))

    def bytes_per_parameter(self, with_phi: bool = True) -> float:
        """A direction's bytes a parameter, ignoring the last blocks' padding."""
        return 0.5 + 4 / self.block + (4 / self.phi_stride if with_phi else 0.0)

    def encode_delta(
        self, delta: Sequence[Tensor], residual: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Delta + the error-feedback residual, encoded: (codes and scales of each tensor,
        interleaved; Delta as the partners decode it; the residual after sending it)."""
        wire: list[Tensor] = []
        sent: list[Tensor] = []
        left: list[Tensor] = []
        for d, r in zip(delta, residual):
            target = d.reshape(-1).to(torch.float32) + r.reshape(-1)
            codes, scales = quantize4(target, self.block)
            decoded = dequantize4(codes, scales, target.numel(), self.block)
            wire += [codes, scales]
            sent.append(decoded.view_as(r))
            left.append((target - decoded).view_as(r))
        return wire, sent, left

    def decode_delta(self, wire: Sequence[Tensor], shapes: Sequence[torch.Size]) -> list[Tensor]:
        """Delta as a partner sent it (codes and scales interleaved), on the wire tensors' device."""
        return [
            dequantize4(wire[2 * k], wire[2 * k + 1], math.prod(shape), self.block).view(shape)
            for k, shape in enumerate(shapes)
        ]
