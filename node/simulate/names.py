"""The names `node simulate` accepts (no torch here: the CLI imports them to build its parser)."""

from __future__ import annotations

from enum import StrEnum


class ExperimentName(StrEnum):
    RECOVERY = "recovery"  # one failure schedule under every recovery strategy (recovery.py)
    SYNC_SCALING = "sync-scaling"  # one NoLoCo round vs tree and ring all-reduce, N = 2..1024
    GOSSIP = "gossip"  # NoLoCo vs DiLoCo vs averaging every step, random vs load-aware routing


class SimPreset(StrEnum):
    DEFAULT = "default"  # what docs/results.md shows: minutes on 2 CPU cores
    TINY = "tiny"  # what the tests run: seconds


class FailingStages(StrEnum):
    """Which stages the recovery experiment's failures hit (stage 0, data and head, never fails)."""

    MIDDLE = "middle"  # 2..S-1: stages every rebuild strategy can rebuild
    BLOCKS = "blocks"  # 1..S: the edge block stages too, which CheckFree needs CheckFree+ for
