"""What a NoLoCo round puts on the wire at real size: about a byte a parameter each way (pure).

phi and Delta in fp32 both ways would be 16 bytes a parameter, 283 MB for a `125m` block stage,
which a 50 Mbit/s home uplink cannot move in any sensible time. What crosses instead
(docs/gossip.md, "A round on the wire"):

- **Delta, 4 bits a value with error feedback.** Blockwise absmax quantization (BLOCK values share
  one fp32 scale; levels -7..7, two to a byte), as SparseLoCo and Streaming DiLoCo do for outer
  gradients. What the rounding drops is kept in an error-feedback residual and added to the next
  Delta this replica sends, so over rounds partners receive all of its progress; the residual is
  committed only when a round is applied (a round that fails sent nothing).
- **phi, coded against what the receiver already holds.** The pull term needs phi_j - phi_i, and
  honest replicas' phi differ by far less than the weights themselves: quantizing phi on its own
  would drown that difference, but the receiver's own phi is side information (as in Wyner-Ziv
  coding). Each value goes on a grid of step s (phi_step x its Delta block's scale, which the
  receiver gets anyway), dithered by a hash of the round's seed and its position; only the grid
  index modulo 2**phi_bits travels. The receiver takes, of the indices with those low bits, the
  one nearest its own phi: exact to s / 2 while the replicas differ by under 2**(phi_bits-1) steps,
  and never further than that reach from its own phi whatever a partner sends. The dither makes
  the rounding error independent of phi, so the pull is unbiased.

At block 64 and 4-bit phi a direction carries 0.5 + 4/64 + 0.5 = 1.0625 bytes a parameter: a
round moves 2.125 bytes a parameter in total, 7.5x less than fp32. DiLoCo rounds send Delta alone.

Everything here runs on the stage's device (the compute thread); the codes, scales and residues
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
    "DEFAULT_PHI_BITS",
    "DEFAULT_PHI_STEP",
    "MAX_PHI_SEED",
    "GossipCodec",
    "PhiDither",
    "WireLayout",
    "dequantize4",
    "dither",
    "pack_nibbles",
    "phi_steps",
    "quantize4",
    "unpack_nibbles",
]

LEVELS = 7  # symmetric 4-bit levels -7..7; a nibble holds q + 8 in 1..15
DEFAULT_BLOCK = 64  # values per fp32 scale: 1/16 byte a value of scales
PHI_BITS = (4, 8)
MAX_PHI_SEED = 2**31 - 1
PHI_PIECE = 1 << 20  # values coded at once
DEFAULT_PHI_BITS = 4
DEFAULT_PHI_STEP = 8.0  # phi's grid step, in Delta scales (a block's absmax / 7)
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
    return pack_nibbles((q + (LEVELS + 1)).to(torch.uint8)), scales


def dequantize4(codes: Tensor, scales: Tensor, numel: int, block: int) -> Tensor:
    """The flat fp32 tensor of `numel` values that `quantize4` encoded (on the codes' device)."""
    blocks = scales.numel()
    if codes.numel() * 2 != blocks * block or blocks != math.ceil(numel / block):
        raise ValueError(f"{codes.numel()} code bytes and {blocks} scales do not encode {numel} values")
    grid = unpack_nibbles(codes, blocks * block).to(torch.float32).view(blocks, block)
    grid.sub_(LEVELS + 1).mul_(scales.to(torch.float32)[:, None])
    return grid.reshape(-1)[:numel]


# multipliers under 2**31 on values under 2**32: every product fits in int64 (no overflow to rely on)
_HASH_A = 0x5BD1E995
_HASH_B = 0x27D4EB2F
_LOW32 = 0xFFFFFFFF


def dither(start: int, stop: int, seed: int, device: torch.device) -> Tensor:
    """u in [-0.5, 0.5) for flat positions start..stop-1 (float64), by integer hashing: both sides
    of a round compute the same values from the seed, whatever their devices."""
    h = torch.arange(start, stop, dtype=torch.int64, device=device).mul_(_HASH_A).add_((seed & _LOW32) * _HASH_B)
    h.bitwise_and_(_LOW32)
    h = (h ^ (h >> 15)).mul_(_HASH_B).bitwise_and_(_LOW32)
    h = (h ^ (h >> 13)).mul_(_HASH_A).bitwise_and_(_LOW32)
    return (h ^ (h >> 16)).to(torch.float64).div_(2.0**32).sub_(0.5)


def phi_steps(delta_scales: Tensor, numel: int, block: int, step: float) -> Tensor:
    """Each value's grid step (float64): `step` x its block's Delta scale, and at least a quarter
    of the tensor's mean scale (a block where this replica made no progress may still differ
    from the partner's). Both sides compute it from the scales that travel with Delta."""
    scales = delta_scales.to(torch.float64)
    floor = scales.mean() / 4 if scales.numel() else scales.new_zeros(())
    per_block = torch.maximum(scales, floor).clamp_min_(_TINY).mul_(step)
    return per_block.repeat_interleave(block)[:numel]


@dataclass(frozen=True)
class PhiDither:
    """What a NoLoCo round's two sides share to code phi: the seed of its dither (the initiator's draw).

    phi is coded piece by piece (PHI_PIECE values): the float64 and int64 temporaries stay a few
    MiB whatever the size of a tensor."""

    seed: int

    def _indices(self, flat: Tensor, steps: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """(the grid index of each value of the piece at `start`, the piece's dither)."""
        stop = start + flat.numel()
        u = dither(start, stop, self.seed, flat.device)
        index = flat.to(torch.float64).div_(steps[start:stop]).add_(u).add_(0.5).floor_().to(torch.int64)
        return index, u

    def residues(self, phi: Tensor, steps: Tensor, bits: int) -> Tensor:
        """phi on its dithered grid, modulo 2**bits: of the grid index k = floor(phi / step + u + 1/2)
        only the low bits travel; 4-bit residues two to a byte."""
        flat = phi.reshape(-1)
        low = torch.empty(flat.numel(), dtype=torch.uint8, device=phi.device)
        for start in range(0, flat.numel(), PHI_PIECE):
            index, _ = self._indices(flat[start : start + PHI_PIECE], steps, start)
            low[start : start + PHI_PIECE] = index.remainder_(1 << bits)
        return pack_nibbles(low) if bits == 4 else low

    def decode(self, residues: Tensor, own: Tensor, steps: Tensor, bits: int) -> tuple[Tensor, Tensor]:
        """(the partner's phi, flat fp32; how many of its values decoded in the outer half of the
        reach, a 0-d tensor) from its residues and our own phi: of the grid indices with those low
        bits, the one nearest our own. Exact to half a step while the two replicas differ by under
        2**(bits-1) steps; a value further off decodes within that reach of our own, so whatever a
        partner sends moves no coordinate further than that. Residues of a replica out of reach (or
        garbage) decode uniformly over the reach: half of them in its outer half."""
        flat, modulus = own.reshape(-1), 1 << bits
        low = unpack_nibbles(residues, flat.numel()) if bits == 4 else residues.reshape(-1)
        out = torch.empty(flat.numel(), dtype=torch.float32, device=own.device)
        edge = torch.zeros((), dtype=torch.int64, device=own.device)
        for start in range(0, flat.numel(), PHI_PIECE):
            stop = min(start + PHI_PIECE, flat.numel())
            mine, u = self._indices(flat[start:stop], steps, start)
            offset = (low[start:stop].to(torch.int64) - mine).remainder_(modulus)
            offset = torch.where(offset >= modulus // 2, offset - modulus, offset)
            edge += (offset.abs() >= modulus // 4).sum()
            out[start:stop] = (mine + offset).to(torch.float64).sub_(u).mul_(steps[start:stop])
        return out, edge


def pack_nibbles(values: Tensor) -> Tensor:
    """uint8 values < 16, two to a byte (the first in the low nibble; an odd count padded with 0)."""
    flat = values.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_nibbles(packed: Tensor, numel: int) -> Tensor:
    """The first `numel` values `pack_nibbles` packed."""
    if packed.numel() != math.ceil(numel / 2):
        raise ValueError(f"{packed.numel()} bytes do not hold {numel} 4-bit values")
    out = torch.empty(2 * packed.numel(), dtype=torch.uint8, device=packed.device)
    out[0::2], out[1::2] = packed & 0x0F, packed >> 4
    return out[:numel]


@dataclass(frozen=True)
class WireLayout:
    """The shapes and dtypes of one direction's tensors, in order: for each parameter tensor its
    Delta codes (uint8) and scales (fp32), then its phi residues (uint8) in a NoLoCo round."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class GossipCodec:
    """How one stage's rounds encode Delta and phi (gossip.delta_block, gossip.phi_bits, gossip.phi_step)."""

    block: int = DEFAULT_BLOCK
    phi_bits: int = DEFAULT_PHI_BITS
    phi_step: float = DEFAULT_PHI_STEP

    def __post_init__(self) -> None:
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block must be an even number >= 2, got {self.block}")
        if self.phi_bits not in PHI_BITS or not self.phi_step > 0:
            raise ValueError(f"phi_bits must be one of {PHI_BITS} and phi_step > 0")

    def _phi_bytes(self, numel: int) -> int:
        return math.ceil(numel * self.phi_bits / 8)

    def layout(self, numels: Sequence[int], with_phi: bool) -> WireLayout:
        """What a direction carries for parameters of `numels` values: Delta codes and scales,
        and phi residues in a NoLoCo round (`with_phi`)."""
        shapes: list[tuple[int, ...]] = []
        dtypes: list[torch.dtype] = []
        for n in numels:
            blocks = math.ceil(n / self.block)
            shapes += [(blocks * self.block // 2,), (blocks,)]
            dtypes += [torch.uint8, torch.float32]
            if with_phi:
                shapes.append((self._phi_bytes(n),))
                dtypes.append(torch.uint8)
        return WireLayout(tuple(shapes), tuple(dtypes))

    def bytes_per_parameter(self, with_phi: bool = True) -> float:
        """A direction's bytes a parameter, ignoring the last blocks' padding."""
        return 0.5 + 4 / self.block + (self.phi_bits / 8 if with_phi else 0.0)

    def encode(
        self, delta: Sequence[Tensor], residual: Sequence[Tensor], phi: Sequence[Tensor], key: PhiDither | None
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Delta + the error-feedback residual, and phi with `key` (None: a DiLoCo round, no phi),
        encoded: (the wire tensors in WireLayout order; Delta as the partners decode it; the
        residual after sending it)."""
        wire: list[Tensor] = []
        sent: list[Tensor] = []
        left: list[Tensor] = []
        for k, (d, r) in enumerate(zip(delta, residual)):
            target = d.reshape(-1).to(torch.float32) + r.reshape(-1)
            codes, scales = quantize4(target, self.block)
            decoded = dequantize4(codes, scales, target.numel(), self.block)
            wire += [codes, scales]
            if key is not None:
                steps = phi_steps(scales, target.numel(), self.block, self.phi_step)
                wire.append(key.residues(phi[k], steps, self.phi_bits))
            sent.append(decoded.view_as(r))
            left.append((target - decoded).view_as(r))
        return wire, sent, left

    def decode(
        self, wire: Sequence[Tensor], own_phi: Sequence[Tensor], key: PhiDither | None
    ) -> tuple[list[Tensor], list[Tensor], float]:
        """(the partner's phi, decoded against `own_phi`: empty without `key`; its Delta; the share
        of its phi values that decoded in the outer half of the reach, 0 without `key`) from what
        it sent, shaped like `own_phi` and on the wire tensors' device. One host read."""
        per_tensor = 2 if key is None else 3
        if len(wire) != per_tensor * len(own_phi):
            raise ValueError(f"{len(wire)} wire tensors for {len(own_phi)} parameters")
        phis: list[Tensor] = []
        deltas: list[Tensor] = []
        edges: list[Tensor] = []
        for k, own in enumerate(own_phi):
            codes, scales = wire[per_tensor * k], wire[per_tensor * k + 1]
            deltas.append(dequantize4(codes, scales, own.numel(), self.block).view(own.shape))
            if key is not None:
                residues = wire[per_tensor * k + 2]
                if residues.numel() != self._phi_bytes(own.numel()):
                    raise ValueError(f"{residues.numel()} phi bytes for {own.numel()} values")
                steps = phi_steps(scales, own.numel(), self.block, self.phi_step)
                phi, edge = key.decode(residues, own, steps, self.phi_bits)
                phis.append(phi.view(own.shape))
                edges.append(edge)
        numel = sum(own.numel() for own in own_phi)
        edge_share = float(torch.stack(edges).sum().item()) / numel if edges and numel else 0.0  # host: one read
        return phis, deltas, edge_share
