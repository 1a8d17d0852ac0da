"""Spot-checks of a block stage's computation (pure rules, no networking; docs/verification.md).

A check replays what a replica computed for one microbatch at the weights the replica itself says
it ran on, one layer at a time, instead of comparing its answer with another replica's (NoLoCo
replicas drift apart between gossip rounds, early in training by more than a x1.5 fault, so no
comparison between replicas can tell drift from a fault). The replica commits to digests of its
weights and of every layer boundary of the microbatch before the checker names the layer to show;
the checker then compares:

- what the replica says it received and sent with what the checker itself sent it and received
  from it, bit for bit once the wire's codecs are accounted for (`arrived_as`);
- what it shows with the digests it committed to (`digest`);
- the layer's output and input gradient with a recomputation in fp32 at the committed weights,
  within the rounding of the precision the replica computed in (`RecomputeTolerance`).

Any mismatch is a `Finding` an honest replica cannot produce, and the only thing that strikes.
Strikes decay (`StrikeBook`); enough of them ban. A check the replica leaves unanswered strikes
nobody: it raises that peer's check rate for a while (`CheckRate`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from enum import StrEnum

import torch
from torch import Tensor

from node.config import Precision, VerificationConfig
from protocol.tensors import Compression, decode_tensor, encode_tensor

# strikes_to_ban strikes within about a minute (at the default half-life) ban, though the first
# ones have decayed a little by the time the last one lands
STRIKE_MARGIN = 0.1
# a layer that changes its input by less than this fraction of its norm (all weights zero: the
# CheckFree "zero" baseline) is measured against this floor instead of its own tiny update
_UPDATE_FLOOR = 1e-6
_DIGEST_BYTES = 16


class Finding(StrEnum):
    """What a check concluded. Every value but PASSED is evidence no honest replica can produce."""

    PASSED = "passed"
    # what the replica says it received is not what the checker sent it, under any wire codec
    NOT_WHAT_IT_RECEIVED = "not what it received"
    # what the checker received from the replica is not what the replica says it sent
    NOT_WHAT_IT_SENT = "not what it sent"
    # a tensor it showed, or the layer's weights, do not hash to what it committed to before the layer was chosen
    NOT_WHAT_IT_COMMITTED = "not what it committed to"
    # the layer recomputed at the committed weights gives another output
    WRONG_FORWARD = "wrong forward"
    # ... or another gradient with respect to the layer's input
    WRONG_BACKWARD = "wrong backward"
    # a commitment or an opening that does not fit the stage (counts, shapes, a non-finite value)
    MALFORMED = "malformed"

    @property
    def is_evidence(self) -> bool:
        return self is not Finding.PASSED


class RecomputeTolerance:
    """How far a replayed layer may be from what a replica says it computed: the rounding of the
    precision the replica computed in, with a margin (the figures: docs/verification.md, "The
    tolerance"). The replay runs in fp32, so two fp32 implementations (CPU and GPU kernels, other
    summation orders) differ by about twice fp32's error, a bf16 replica by its own."""

    def __init__(self, fp32: float, fp16: float, bf16: float) -> None:
        self._by_precision = {Precision.FP32: fp32, Precision.FP16: fp16, Precision.BF16: bf16}

    @classmethod
    def from_settings(cls, settings: VerificationConfig) -> RecomputeTolerance:
        return cls(settings.fp32_tolerance, settings.fp16_tolerance, settings.bf16_tolerance)

    def of(self, precision: Precision) -> float:
        """The tolerance for a replica that computes in `precision` (a concrete one: never auto)."""
        return self._by_precision[precision]


def parse_precision(text: str) -> Precision | None:
    """A replica's declared compute precision, or None when it is not a concrete one."""
    try:
        precision = Precision(text)
    except ValueError:
        return None
    return None if precision is Precision.AUTO else precision


def update_error(claimed: Tensor, recomputed: Tensor, start: Tensor) -> Tensor:
    """||claimed - recomputed|| / ||recomputed - start||, as a 0-d tensor on their device.

    Measured on the layer's update (a residual layer's output minus its input; a gradient minus the
    gradient arriving at the layer) rather than on the output itself: the residual stream is many
    times larger than what one layer adds to it, and a fault that scales the layer's own
    computation by 1.05 changes that update by ~15 % but the stream by a fraction of that."""
    claimed, recomputed, start = claimed.double(), recomputed.double(), start.double()
    floor = _UPDATE_FLOOR * start.norm() + 1e-30
    return (claimed - recomputed).norm() / torch.maximum((recomputed - start).norm(), floor)


def digest(tensor: Tensor) -> str:
    """A 128-bit BLAKE2b digest of a host fp32 tensor's shape and bytes (what a commitment holds)."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        raise ValueError(f"digests are of host fp32 tensors, got {tensor.dtype} on {tensor.device}")
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    hasher.update(repr(tuple(tensor.shape)).encode())
    hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def is_digest(text: str) -> bool:
    return len(text) == 2 * _DIGEST_BYTES and all(c in "0123456789abcdef" for c in text)


def arrived_as(sent: Tensor, received: Tensor, token_ids: Tensor | None = None) -> bool:
    """Whether `received` is exactly what `sent` becomes on the wire under one of its codecs.

    The hop's codec is chosen per link at send time (node/pipeline/link_compression.py) and is
    deterministic on the host, so an honest pair of tensors matches one of them bit for bit: no
    tolerance is left for a replica to hide a change in. `token_ids`: the hop's, which a subspace
    codec anchors its hidden states to (protocol/subspace.py)."""
    if sent.shape != received.shape or sent.dtype != received.dtype:
        return False
    anchorings = (None,) if token_ids is None else (None, token_ids)
    return any(
        torch.equal(decode_tensor(encode_tensor(sent, codec, anchor_ids=ids), anchor_ids=ids), received)
        for codec in Compression
        for ids in anchorings
    )


class StrikeBook:
    """Strikes per peer that halve every `half_life` seconds; `strikes_to_ban` of them (after decay)
    ban. Every strike is evidence; the decay forgives a replica wrong once in a long while (a
    flipped bit) while one wrong on every microbatch reaches the threshold in a few checks."""

    def __init__(self, strikes_to_ban: float, half_life: float, clock: Callable[[], float] = time.monotonic):
        if strikes_to_ban <= 0 or half_life <= 0:
            raise ValueError("strikes_to_ban and half_life must be > 0")
        self.strikes_to_ban, self.half_life, self._clock = strikes_to_ban, half_life, clock
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, when it was last updated)

    def _decayed(self, peer_id: str, now: float) -> float:
        score, updated = self._scores.get(peer_id, (0.0, now))
        return score * 0.5 ** ((now - updated) / self.half_life)

    def strike(self, peer_id: str) -> bool:
        """Add one strike; True when the peer's score reached the ban threshold (it is then reset)."""
        now = self._clock()
        score = self._decayed(peer_id, now) + 1.0
        if score >= self.strikes_to_ban - STRIKE_MARGIN:
            self._scores.pop(peer_id, None)
            return True
        self._scores[peer_id] = (score, now)
        return False

    def score(self, peer_id: str) -> float:
        return self._decayed(peer_id, self._clock())

    def scores(self, at_least: float = 0.05) -> dict[str, float]:
        """Every peer whose decayed score is still at least `at_least` (forgotten below it)."""
        now = self._clock()
        current = {peer: self._decayed(peer, now) for peer in self._scores}
        self._scores = {peer: (score, now) for peer, score in current.items() if score >= at_least}
        return {peer: score for peer, score in current.items() if score >= at_least}


class CheckRate:
    """The probability of checking a hop: `rate`, or `raised` for a peer that left a check
    unanswered within the last `raised_for` seconds (absence is not evidence, but a replica that
    dodges the checks it would fail is checked more often)."""

    def __init__(self, rate: float, raised: float, raised_for: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.raised, self.raised_for, self._clock = rate, max(rate, raised), raised_for, clock
        self._raised_until: dict[str, float] = {}

    def raise_for(self, *peer_ids: str) -> None:
        until = self._clock() + self.raised_for
        for peer_id in peer_ids:
            self._raised_until[peer_id] = until

    def of(self, peer_id: str) -> float:
        until = self._raised_until.get(peer_id)
        if until is None:
            return self.rate
        if until <= self._clock():
            del self._raised_until[peer_id]
            return self.rate
        return self.raised


def probe_direction(shape: torch.Size, generator: torch.Generator) -> Tensor:
    """An audit's gradient with respect to the stage's output: random (unit norm), so a replica
    cannot prepare a right answer without computing the backward."""
    probe = torch.randn(shape, generator=generator, device="cpu")  # drawn for the wire
    return probe / probe.norm().clamp_min(1e-12)
