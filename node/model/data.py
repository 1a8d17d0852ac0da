"""Training data for stage 0: token streams cut into (inputs, targets) microbatches.

Three sources share one interface (TokenSource):

* SyntheticMarkovSource (node/model/synthetic.py), the embedded default ("markov"): a random sparse
  k-th order Markov chain derived from the swarm seed. Nothing to download, and its exact loss
  floor is what the dashboard draws under the loss curve; with order >= 2 it needs the blocks.
* TokenFileSource over a UTF-8 text file (byte-level tokens, ids 0..255), a nanoGPT-style
  ``.bin`` file of uint16 token ids, or the train.bin of a directory `node prepare-data` wrote
  (uint16 or uint32 as its meta.json says), read through np.memmap at random offsets.

Every stage-0 peer opens its source with a different stream_id (stream_id_from_peer) so peers draw
different batches; a given (swarm seed, stream_id) always yields the same sequence of batches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from node.config import DataConfig, SwarmConfig, SyntheticSource, synthetic_source
from node.model.corpus import PreparedData, PreparedDataError, load_prepared
from node.model.synthetic import SyntheticMarkovSource as SyntheticMarkovSource  # re-exported: its old home
from node.model.synthetic import markov_source, stable_seed

SCAN_CHUNK = 1 << 22  # tokens per chunk when checking a file's largest token id


@runtime_checkable
class TokenSource(Protocol):
    """A stream of microbatches. loss_floor is the best achievable mean loss (nats/token) if known."""

    loss_floor: float | None

    def next_batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both LongTensor[batch_size, seq_len]; targets[:, t] = inputs[:, t+1]
        of the same underlying sequence (the token that follows inputs[:, t])."""
        ...


class DataError(ValueError):
    """A data file cannot be used with this swarm's model (missing, empty, too short, bad ids)."""


# stream ids of peers are below 2**63 (stream_id_from_peer), so no stage-0 peer ever trains on this one
VALIDATION_STREAM = 1 << 63


def stream_id_from_peer(peer_id: str | bytes) -> int:
    """A stream id for a peer: a stable 63-bit hash of its peer id (bytes or base58 string)."""
    raw = peer_id if isinstance(peer_id, bytes) else str(peer_id).encode()
    return int.from_bytes(hashlib.sha256(b"pipeswarm/stream/" + raw).digest()[:8], "little") >> 1


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


class TokenFileSource:
    """Random windows of seq_len + 1 tokens from a token file (text bytes, uint16 .bin, or
    `dtype` tokens when given: a prepared directory's meta.json says which)."""

    def __init__(
        self,
        path: str | Path,
        vocab_size: int,
        seed: int,
        stream_id: int = 0,
        min_tokens: int = 2,
        dtype: np.dtype | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data file {self.path} does not exist or is not a file")
        if dtype is None:
            dtype = np.dtype("<u2") if self.path.suffix == ".bin" else np.dtype(np.uint8)
        self.kind = "text bytes" if dtype.itemsize == 1 else f"{dtype.name} tokens"
        size = self.path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{self.path}: size {size} bytes is not a whole number of {dtype.name} tokens")
        if size == 0:
            raise DataError(f"{self.path} is empty")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        if len(self.tokens) < min_tokens:
            raise DataError(
                f"{self.path} holds {len(self.tokens)} tokens, fewer than the {min_tokens} one sequence needs"
            )
        self._check_vocab(vocab_size)
        self.vocab_size = vocab_size
        self.loss_floor: float | None = None
        self.rng = np.random.default_rng(stable_seed("file-stream", seed, stream_id))
        self.description = f"{self.path.name} ({len(self.tokens):,} {self.kind})"

    def _check_vocab(self, vocab_size: int) -> None:
        """Every token id must be < vocab_size; one pass over the file by chunks."""
        if np.iinfo(self.tokens.dtype).max < vocab_size:
            return  # nothing this dtype can hold is out of range
        for start in range(0, len(self.tokens), SCAN_CHUNK):
            chunk = np.asarray(self.tokens[start : start + SCAN_CHUNK])
            if int(chunk.max()) >= vocab_size:
                where = start + int(np.argmax(chunk >= vocab_size))
                hint = " (text is read as bytes: it needs vocab_size 256)" if self.kind == "text bytes" else ""
                raise DataError(
                    f"{self.path}: token id {int(self.tokens[where])} at position {where} is out of range "
                    f"for model.vocab_size={vocab_size} (ids must be < {vocab_size}){hint}"
                )

    def next_batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.tokens)
        if n < seq_len + 1:
            raise DataError(f"{self.path} holds {n} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        starts = self.rng.integers(0, n - seq_len, size=batch_size)
        window = np.asarray(self.tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]], dtype=np.int64)
        seq = torch.from_numpy(window)  # host: local data, checked and moved by StageWorker.tokens_from_wire
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def open_prepared(data: DataConfig, vocab_size: int, directory: str | Path) -> PreparedData:
    """A directory of `node prepare-data`, if the swarm trains on data made with its tokenizer
    (data.tokenizer_hash) and its ids fit the model's `vocab_size`: the same token id must mean the
    same text on every stage-0 peer (DataError otherwise)."""
    try:
        prepared = load_prepared(directory)
    except PreparedDataError as e:
        raise DataError(str(e)) from None
    expected = data.tokenizer_hash
    if not expected:
        raise DataError(
            f"{directory} was prepared with tokenizer {prepared.tokenizer_hash}, but this swarm records no "
            "tokenizer (data.tokenizer_hash): its founder starts it with `node bootstrap --data DIR`"
        )
    if prepared.tokenizer_hash != expected:
        raise DataError(
            f"{directory} was prepared with tokenizer {prepared.tokenizer_hash}, this swarm trains with "
            f"tokenizer {expected}: use the swarm's prepared data (or its tokenizer.json)"
        )
    if prepared.vocab_size > vocab_size:
        raise DataError(f"{directory}: its tokenizer has {prepared.vocab_size} tokens, the model only {vocab_size}")
    return prepared


def open_source(config: SwarmConfig, data_path: str | None, stream_id: int) -> TokenSource:
    """The data source of a stage-0 peer.

    data_path (the peer's --data flag) wins; otherwise config.data.source, which names an embedded
    source (SyntheticSource: "markov", or its old name "synthetic") or a file. A directory is
    prepared data (open_prepared: its tokenizer must be the swarm's; train.bin is read); a path
    ending in .bin is read as uint16 token ids, any other path as text bytes. A swarm that records
    a tokenizer trains on prepared data only. Files are checked at open time (exists, non-empty,
    long enough for one sequence, all ids < vocab_size) and raise DataError with the reason.
    """
    path = data_path if data_path is not None else config.data.source
    min_tokens = config.training.sequence_length + 1
    embedded = synthetic_source(path)
    if embedded is None and Path(path).is_dir():
        prepared = open_prepared(config.data, config.model.vocab_size, path)
        return TokenFileSource(
            prepared.train_path, config.model.vocab_size, config.seed, stream_id, min_tokens, prepared.dtype.numpy
        )
    if config.data.tokenizer_hash:
        raise DataError(
            f"this swarm trains on data prepared with tokenizer {config.data.tokenizer_hash}: stage-0 peers "
            "need --data DIR, a directory of `node prepare-data` made with it"
        )
    if embedded is SyntheticSource.MARKOV:
        return markov_source(config, stream_id)
    return TokenFileSource(path, config.model.vocab_size, config.seed, stream_id, min_tokens=min_tokens)


def open_heldout(config: SwarmConfig, data_path: str | None) -> TokenSource:
    """The held-out data a stage-0 peer validates on (node/pipeline/validation.py), read from the
    VALIDATION_STREAM so every peer draws the same batches.

    A prepared directory: its val.bin, which no peer trains on. The embedded chain: another stream of
    the same chain (the same distribution, other sequences; its loss floor still applies). A plain
    file has no held-out part: DataError, as for a val.bin shorter than one sequence.
    """
    path = data_path if data_path is not None else config.data.source
    min_tokens = config.training.sequence_length + 1
    embedded = synthetic_source(path)
    if embedded is None and Path(path).is_dir():
        prepared = open_prepared(config.data, config.model.vocab_size, path)
        if prepared.val_tokens < min_tokens:
            raise DataError(
                f"{prepared.val_path} holds {prepared.val_tokens} tokens, fewer than the {min_tokens} of one "
                "sequence: prepare the data with a larger --val-fraction"
            )
        return TokenFileSource(
            prepared.val_path, config.model.vocab_size, config.seed, VALIDATION_STREAM, min_tokens, prepared.dtype.numpy
        )
    if embedded is SyntheticSource.MARKOV and not config.data.tokenizer_hash:
        return markov_source(config, VALIDATION_STREAM)
    raise DataError(
        f"{path} has no held-out part: validation needs a directory of `node prepare-data` (its val.bin) "
        "or the embedded source"
    )
