"""The embedded synthetic source: a seeded, sparse k-th order Markov chain with an exact loss floor.

Token x_{t+1} depends on the k tokens before it (its context). Each of the A^k contexts has
`branching` possible successors with flat-Dirichlet probabilities, so the best possible loss, the
chain's entropy rate, is known exactly and is what the dashboard draws as the loss floor.

Why order k >= 2 (the default is 2): with k = 1 any predictor that sees only the current token is
optimal, and that is exactly what stage 0 alone computes (embedding -> norm -> LM head), so the
block stages carried nothing (docs/recovery.md measured it). With k >= 2 the next token depends on
earlier tokens that only attention can bring to the current position; the best a function of the
current token alone can do is H(X_{t+1} | X_t), the "context-free floor", which this module also
computes exactly, so the gap the blocks must close is known in advance (docs/model.md).

Irreducibility: one successor of every context is the next symbol of a de Bruijn sequence of order
k over the alphabet, a cycle through every context, so the chain over contexts is irreducible and
its stationary distribution unique (for k = 1 the cycle is the ring i -> i + 1 mod A). Every
sequence starts from that stationary distribution, so the process is stationary and the exact
floor of every target position follows from block entropies (floor_at).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch

from node.config import MAX_MARKOV_CONTEXTS, SwarmConfig

# Sequences `next_batch` draws at a time, handing them out a microbatch at a time: the chain is
# sampled one position at a time for all rows at once, so a draw costs numpy's per-call overhead
# times the sequence length whatever the row count. Measured at the defaults (8 x 65 tokens):
# 1.13 ms for one microbatch's 8 rows, 0.13 ms per 8 rows drawn 256 at once. Stage 0 draws on its
# event loop, once per microbatch it starts.
DRAWN_ROWS = 256


def stable_seed(*parts: object) -> int:
    """A 128-bit seed from any printable parts, stable across processes and machines."""
    digest = hashlib.sha256("/".join(str(p) for p in ("pipeswarm/data/v1", *parts)).encode()).digest()
    return int.from_bytes(digest[:16], "little")


def _lyndon_words(alphabet: int, n: int) -> Iterator[list[int]]:
    """Lyndon words of length dividing n over 0..alphabet-1, in lexicographic order (Duval's
    iterative form of the FKM algorithm). Each turn of the outer loop yields at most one word and
    there are fewer than alphabet^n of them, so the loop is bounded."""
    word = [-1]
    while word:
        word[-1] += 1
        size = len(word)
        if n % size == 0:
            yield list(word)
        while len(word) < n:
            word.append(word[-size])
        while word and word[-1] == alphabet - 1:
            word.pop()


def de_bruijn(alphabet: int, order: int) -> np.ndarray:
    """A cyclic sequence of length alphabet^order in which every order-tuple appears exactly once
    (the concatenation of the Lyndon words whose length divides `order`)."""
    if alphabet == 1:
        return np.zeros(1, dtype=np.int64)
    return np.array([s for w in _lyndon_words(alphabet, order) for s in w], dtype=np.int64)


def _entropy(p: np.ndarray) -> float:
    """Shannon entropy (nats) of a probability vector, 0 ln 0 = 0."""
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


class SyntheticMarkovSource:
    """x_{t+1} ~ P[context_t, :], context_t = (x_{t-k+1}, ..., x_t), over the tokens 0..A-1.

    A = `alphabet` clipped to 1..vocab_size (None: the whole vocabulary), k = `order`, b =
    `branching` clipped to 1..A successors per context: the de Bruijn successor plus b - 1 other
    distinct random symbols, probabilities from a flat Dirichlet. The chain depends on (seed,
    vocab_size, branching, order, alphabet) only; the sampling stream also on stream_id. order 1
    with the whole vocabulary is the first-order chain pipeswarm trained on before (`sample` makes
    the same draws; `next_batch` now draws DRAWN_ROWS sequences at a time).

    loss_floor is the exact best mean loss over the `seq_len` target positions of a sequence
    (floor_at); without seq_len, the entropy rate (the limit of long sequences).
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int,
        branching: int,
        stream_id: int = 0,
        *,
        order: int = 1,
        alphabet: int | None = None,
        seq_len: int | None = None,
    ) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if order < 1:
            raise ValueError("order must be >= 1")
        A = vocab_size if alphabet is None else max(1, min(int(alphabet), vocab_size))
        if A**order > MAX_MARKOV_CONTEXTS:  # the stationary solve is dense in the contexts
            raise ValueError(f"alphabet^order = {A}^{order} contexts exceed {MAX_MARKOV_CONTEXTS}")
        self.vocab_size, self.alphabet, self.order = vocab_size, A, order
        self.num_contexts = C = A**order
        self.branching = b = max(1, min(int(branching), A))
        # the first-order chain over the whole vocabulary keeps its historical seed, so old runs repeat
        legacy = order == 1 and A == vocab_size
        chain_seed = ("markov", seed, vocab_size, b) if legacy else ("markov-k", seed, vocab_size, b, order, A)
        chain_rng = np.random.default_rng(stable_seed(*chain_seed))
        cycle = de_bruijn(A, order)
        successors = np.empty((C, b), dtype=np.int64)
        # context at cycle position i is cycle[i .. i+k-1] (cyclically, oldest symbol most
        # significant); its cycle successor is the symbol that follows it
        windows = cycle[(np.arange(C)[:, None] + np.arange(order)[None, :]) % C]
        contexts = windows @ (A ** np.arange(order - 1, -1, -1))
        successors[contexts, 0] = cycle[(np.arange(C) + order) % C]
        for context in range(C):
            others = np.delete(np.arange(A), successors[context, 0])
            successors[context, 1:] = chain_rng.choice(others, size=b - 1, replace=False)
        self.successors = successors
        self.probs = chain_rng.dirichlet(np.ones(b), size=C)  # [C, b], rows sum to 1
        self._cumulative = np.cumsum(self.probs, axis=1)
        self._cumulative[:, -1] = 1.0
        self.stationary = self._stationary_distribution()
        self._stationary_cumulative = np.cumsum(self.stationary)
        self._stationary_cumulative[-1] = 1.0
        self.context_free_floor = self.conditional_entropy(1)
        self.loss_floor: float | None = self.entropy_rate() if seq_len is None else self.floor_at(seq_len)
        self.rng = np.random.default_rng(stable_seed("markov-stream", seed, stream_id))
        self._drawn = np.empty((0, 0), dtype=np.int64)  # sequences drawn and not yet handed out
        self.description = (
            f"synthetic order-{order} Markov chain ({A} tokens, {b} successors/context, "
            f"floor {self.loss_floor:.4f} nats, {self.context_free_floor:.4f} from the current token alone)"
        )

    def _next_context(self, context: np.ndarray | int, symbol: np.ndarray | int) -> np.ndarray | int:
        return (context * self.alphabet + symbol) % self.num_contexts

    def transition_matrix(self) -> np.ndarray:
        """The dense [C, C] transition matrix between contexts (rows sum to 1); for order 1 the
        contexts are the tokens and this is the token transition matrix."""
        C, b = self.num_contexts, self.branching
        P = np.zeros((C, C))
        sources = np.repeat(np.arange(C), b)
        np.add.at(P, (sources, self._next_context(sources, self.successors.ravel())), self.probs.ravel())
        return P

    def _stationary_distribution(self) -> np.ndarray:
        """pi with pi P = pi, sum(pi) = 1: an exact linear solve (unique since the chain is
        irreducible; no aperiodicity needed, unlike power iteration)."""
        C = self.num_contexts
        A = self.transition_matrix().T - np.eye(C)
        A[-1, :] = 1.0  # replace one (redundant) balance equation by the normalisation
        rhs = np.zeros(C)
        rhs[-1] = 1.0
        pi = np.clip(np.linalg.solve(A, rhs), 0.0, None)
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """H = sum_c pi_c H(P[c, :]) in nats/token: the best loss once k tokens of context are seen."""
        p = self.probs
        row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        return float(np.dot(self.stationary, row_entropy))

    def block_entropy(self, n: int) -> float:
        """H(X_1..X_n) of n consecutive tokens of the stationary process (nats), 0 <= n <= k + 1."""
        if not 0 <= n <= self.order + 1:
            raise ValueError(f"block_entropy needs 0 <= n <= order + 1 = {self.order + 1}, got {n}")
        if n == 0:
            return 0.0  # the empty block (exactly, not a rounding of the marginal's entropy)
        if n == self.order + 1:  # a context and its successor: H(context) + H(next | context)
            return _entropy(self.stationary) + self.entropy_rate()
        # the first n symbols of a stationary context: its most significant digits
        return _entropy(
            np.bincount(np.arange(self.num_contexts) // self.alphabet ** (self.order - n), weights=self.stationary)
        )

    def conditional_entropy(self, seen: int) -> float:
        """H(X_{t+1} | the `seen` tokens before it) of the stationary process, seen >= 0; for
        seen >= k it is the entropy rate. seen = 1 is the best any function of the current token
        alone achieves (stage 0 without blocks)."""
        if seen >= self.order:
            return self.entropy_rate()
        return self.block_entropy(seen + 1) - self.block_entropy(seen)

    def floor_at(self, seq_len: int) -> float:
        """The best mean loss over target positions 0..seq_len-1 of a sequence: the target at
        position t has seen t + 1 tokens, so the first k - 1 targets cannot reach the entropy rate."""
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        return sum(self.conditional_entropy(min(t + 1, self.order)) for t in range(seq_len)) / seq_len

    def sample(self, rows: int, length: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """int64 [rows, length] sequences, each started from the stationary distribution (its
        first k tokens are a context drawn from pi)."""
        rng = self.rng if rng is None else rng
        k, A = self.order, self.alphabet
        out = np.empty((rows, length), dtype=np.int64)
        context = np.searchsorted(self._stationary_cumulative, rng.random(rows), side="right")
        context = np.minimum(context, self.num_contexts - 1)
        digits = (context[:, None] // A ** np.arange(k - 1, -1, -1)[None, :]) % A
        head = min(k, length)
        out[:, :head] = digits[:, :head]
        draws = rng.random((rows, max(length - k, 0)))
        for t in range(k, length):
            index = (self._cumulative[context] <= draws[:, t - k, None]).sum(axis=1)
            symbol = self.successors[context, np.minimum(index, self.branching - 1)]
            out[:, t] = symbol
            context = self._next_context(context, symbol)
        return out

    def next_batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, next tokens), each [batch_size, seq_len]: the stream's next sequences, drawn
        DRAWN_ROWS at a time (sequences of another length start a new draw)."""
        if self._drawn.shape[1] != seq_len + 1 or len(self._drawn) < batch_size:
            self._drawn = self.sample(max(batch_size, DRAWN_ROWS), seq_len + 1)
        # host: local data, checked and moved by StageWorker.tokens_from_wire
        seq, self._drawn = torch.from_numpy(self._drawn[:batch_size]), self._drawn[batch_size:]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def markov_source(config: SwarmConfig, stream_id: int) -> SyntheticMarkovSource:
    """The swarm's embedded chain (config.data.markov_*), floor over training.sequence_length targets."""
    d = config.data
    return SyntheticMarkovSource(
        config.model.vocab_size,
        config.seed,
        d.markov_branching,
        stream_id,
        order=d.markov_order,
        alphabet=d.markov_alphabet,
        seq_len=config.training.sequence_length,
    )
