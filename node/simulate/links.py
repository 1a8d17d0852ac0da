"""The link model: a transfer of b bytes over one link costs latency + 8 b / bandwidth seconds.

Defaults are a volunteer's home internet link: 50 ms one way, 100 Mbit/s. Every peer has its own
link; a transfer between two peers is limited by the one model (links are symmetric and identical
here, as in the NoLoCo and SWARM papers' cost arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LATENCY_MS = 50.0  # one way, a residential link across a continent
DEFAULT_BANDWIDTH_MBIT = 100.0  # a typical fibre or cable home uplink


@dataclass(frozen=True)
class LinkModel:
    latency_s: float = DEFAULT_LATENCY_MS / 1000.0
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_MBIT * 1e6 / 8.0

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0.0 and self.bandwidth_bytes_per_s > 0.0):
            raise ValueError(f"link needs latency >= 0 and bandwidth > 0, got {self}")

    @classmethod
    def from_flags(cls, latency_ms: float, bandwidth_mbit: float) -> LinkModel:
        return cls(latency_s=latency_ms / 1000.0, bandwidth_bytes_per_s=bandwidth_mbit * 1e6 / 8.0)

    def transfer_seconds(self, num_bytes: float) -> float:
        """One message of `num_bytes` from one peer to another."""
        if num_bytes < 0:
            raise ValueError(f"bytes must be >= 0, got {num_bytes}")
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def bulk_seconds(self, num_bytes: float) -> float:
        """Bytes alone, no latency: a chunk of a pipelined stream (ring all-reduce steps add their own)."""
        return num_bytes / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return f"{self.latency_s * 1000:g} ms one way, {self.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s"
