"""The config's vocabulary: the enums its fields take, the embedded data sources, and its error.

Kept apart from the dataclasses and their checks in node/config/__init__.py, which re-exports
every name here: the words a config is written in, on one page.
"""

from __future__ import annotations

from enum import StrEnum


class GossipMode(StrEnum):
    """How replicas of a stage are kept together (docs/gossip.md)."""

    NOLOCO = "noloco"  # every H steps, an outer step with ONE random partner
    DILOCO = "diloco"  # every H steps, an outer step with every live replica
    NONE = "none"  # replicas drift apart (a baseline)


class RecoveryStrategy(StrEnum):
    """How a stage whose peers all vanished is rebuilt (docs/recovery.md)."""

    CHECKFREE = "checkfree"  # gradient-norm-weighted average of the two neighbours
    COPY = "copy"  # copy one neighbour
    RANDOM = "random"  # a fresh initialisation that can relearn
    ZERO = "zero"  # every parameter zero: an identity stage that never trains again (the CheckFree authors' "random")
    CHECKPOINT = "checkpoint"  # reload the stage's last local checkpoint


class RoutingMode(StrEnum):
    """How a microbatch picks its peer of the next stage (docs/algorithms.md, "SWARM routing")."""

    LOAD_AWARE = "load_aware"  # SWARM: the peer expected to finish it first
    RANDOM = "random"  # NoLoCo: uniformly among the live, unbanned peers, which mixes gradients across replicas
    SHUFFLED = "shuffled"  # NoLoCo's authors: a random permutation dealt one peer per microbatch (equal shares)


class Precision(StrEnum):
    """Arithmetic of a stage's forward and backward (node/stage/precision.py, docs/model.md "Precision").

    Weights, optimizer moments and the NoLoCo outer state are float32 whatever is chosen: only the
    compute runs under autocast."""

    AUTO = "auto"  # per peer from its device: bf16 on a CUDA device with native bf16, else fp32
    FP32 = "fp32"  # no autocast
    BF16 = "bf16"  # autocast to bfloat16 (fp32's exponent range: no loss scaling needed)
    FP16 = "fp16"  # autocast to float16 with a dynamic loss scaler on every stage


class SyntheticSource(StrEnum):
    """The embedded data sources `data.source` can name instead of a file path (docs/model.md)."""

    MARKOV = "markov"  # a seeded sparse k-th order Markov chain (data.markov_*), exact loss floor


# "synthetic" named the embedded first-order chain before markov_order existed; it still means
# the embedded chain, and is stored as "markov" so both spellings give the same config hash
SOURCE_ALIASES: dict[str, SyntheticSource] = {"synthetic": SyntheticSource.MARKOV}
MAX_MARKOV_CONTEXTS = 1024  # alphabet^order: the floor needs a dense contexts x contexts solve (8 MiB)


def synthetic_source(source: str) -> SyntheticSource | None:
    """The embedded source `source` names (an alias counts), or None when it is a file path."""
    if source in SOURCE_ALIASES:
        return SOURCE_ALIASES[source]
    try:
        return SyntheticSource(source)
    except ValueError:
        return None


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""
