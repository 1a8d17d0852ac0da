"""node/model/synthetic.py: the k-th order chain's exact floors against samples, its streams, the
config names, and that only a model with blocks can get below the current-token-only floor."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch

from node.config import ConfigError, SwarmConfig, SyntheticSource, read_config, synthetic_source
from node.model.data import open_source
from node.model.llama import ReferenceModel, build_stage
from node.model.synthetic import DRAWN_ROWS, SyntheticMarkovSource, de_bruijn, markov_source
from node.monitor.status import loss_floor

CFG = SwarmConfig()


def _windows(seq: np.ndarray, order: int) -> set[tuple[int, ...]]:
    return {tuple(seq[(i + np.arange(order)) % len(seq)]) for i in range(len(seq))}


@pytest.mark.parametrize(("alphabet", "order"), [(2, 5), (3, 3), (16, 2), (7, 1), (1, 4)])
def test_de_bruijn_visits_every_context_once(alphabet: int, order: int) -> None:
    seq = de_bruijn(alphabet, order)
    assert len(seq) == alphabet**order
    assert len(_windows(seq, order)) == alphabet**order


def test_second_order_floors_match_samples() -> None:
    src = SyntheticMarkovSource(256, seed=5, branching=3, order=2, alphabet=16, seq_len=64)
    P = src.transition_matrix()
    assert P.shape == (256, 256) and np.allclose(P.sum(axis=1), 1.0)
    assert np.allclose(src.stationary @ P, src.stationary, atol=1e-12)
    assert (src.stationary > 0).all(), "irreducible: every context is reachable"

    seq = src.sample(1000, 65, rng=np.random.default_rng(0))
    assert int(seq.max()) < 16
    # the exact optimal prediction at each position: P[context] once two tokens are seen, the
    # stationary pair marginal's conditional for the very first target
    context = seq[:, :-2] * 16 + seq[:, 1:-1]
    probs = np.zeros((256, 16))
    np.put_along_axis(probs, src.successors, src.probs, axis=1)
    p_later = probs[context, seq[:, 2:]]
    assert (p_later > 0).all(), "samples only follow edges of the chain"
    pair = src.stationary.reshape(16, 16)
    p_first = pair[seq[:, 0], seq[:, 1]] / pair.sum(axis=1)[seq[:, 0]]
    empirical_rate = float(-np.log(p_later).mean())
    assert abs(empirical_rate - src.entropy_rate()) < 0.02, (empirical_rate, src.entropy_rate())
    assert abs(float(-np.log(p_first).mean()) - src.conditional_entropy(1)) < 0.1
    empirical_floor = float(-np.log(np.concatenate([p_first[:, None], p_later], axis=1)).mean())
    assert abs(empirical_floor - src.loss_floor) < 0.02, (empirical_floor, src.loss_floor)
    assert src.loss_floor == pytest.approx((src.conditional_entropy(1) + 63 * src.entropy_rate()) / 64)

    # the current token alone: the plug-in conditional entropy of the sampled bigrams
    counts = np.zeros((16, 16))
    np.add.at(counts, (seq[:, :-1].ravel(), seq[:, 1:].ravel()), 1)
    bigram = counts / counts.sum(axis=1, keepdims=True)
    plug_in = float(-(counts * np.log(np.where(bigram > 0, bigram, 1.0))).sum() / counts.sum())
    assert abs(plug_in - src.context_free_floor) < 0.02, (plug_in, src.context_free_floor)
    # and the gap the blocks must close is large
    assert src.context_free_floor > src.loss_floor + 1.0
    # stationary start: the first tokens are distributed as every later token
    first = np.bincount(seq[:, 0], minlength=16) / len(seq)
    assert np.abs(first - pair.sum(axis=1)).sum() < 0.15


def test_floor_per_position_and_block_entropies() -> None:
    src = SyntheticMarkovSource(64, seed=1, branching=2, order=3, alphabet=6)
    assert src.loss_floor == src.entropy_rate()  # no seq_len: the long-sequence limit
    assert src.block_entropy(0) == 0.0
    assert src.block_entropy(1) == pytest.approx(src.conditional_entropy(0))
    # more context never hurts, and k tokens reach the entropy rate
    chain = [src.conditional_entropy(seen) for seen in range(5)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(chain))
    assert chain[3] == chain[4] == src.entropy_rate()
    assert src.floor_at(1) == pytest.approx(chain[1])
    assert src.floor_at(3) == pytest.approx((chain[1] + chain[2] + chain[3]) / 3)
    assert src.floor_at(1000) > src.entropy_rate()
    with pytest.raises(ValueError):
        src.block_entropy(5)


def test_chain_is_a_function_of_seed_streams_differ() -> None:
    a = SyntheticMarkovSource(256, 0, 3, order=2, alphabet=16)
    b = SyntheticMarkovSource(256, 0, 3, 9, order=2, alphabet=16)
    assert np.array_equal(a.transition_matrix(), b.transition_matrix())
    assert not np.array_equal(
        a.transition_matrix(), SyntheticMarkovSource(256, 1, 3, order=2, alphabet=16).transition_matrix()
    )
    # a first-order chain over fewer tokens is a different chain from the whole-vocabulary one
    assert SyntheticMarkovSource(256, 0, 3, alphabet=16).num_contexts == 16
    first = [markov_source(CFG, 4).next_batch(3, 20) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(first[0], first[1])), "same (seed, stream): same batches"
    again = markov_source(CFG, 4)
    batches = [again.next_batch(3, 20)[0] for _ in range(2)]
    assert not torch.equal(batches[0], batches[1]), "successive batches differ"
    assert not torch.equal(markov_source(CFG, 5).next_batch(3, 20)[0], batches[0]), "streams differ"
    other_seed = markov_source(CFG.replace(seed=1), 4).next_batch(3, 20)[0]
    assert not torch.equal(other_seed, batches[0])


def test_next_batch_hands_out_sequences_drawn_many_at_a_time():
    source, twin = markov_source(CFG, 4), markov_source(CFG, 4)
    drawn = torch.from_numpy(twin.sample(DRAWN_ROWS, 21))
    handed = [source.next_batch(8, 20) for _ in range(DRAWN_ROWS // 8)]
    assert torch.equal(torch.cat([tokens for tokens, _ in handed]), drawn[:, :-1])
    assert torch.equal(torch.cat([targets for _, targets in handed]), drawn[:, 1:])
    # the draw used up, the next one follows it in the stream; another length starts a draw of its own
    assert torch.equal(source.next_batch(8, 20)[0], torch.from_numpy(twin.sample(DRAWN_ROWS, 21)[:8, :-1]))
    assert torch.equal(source.next_batch(2, 30)[0], torch.from_numpy(twin.sample(DRAWN_ROWS, 31)[:2, :-1]))


def test_deterministic_chain_has_floor_zero() -> None:
    ring = SyntheticMarkovSource(32, 0, 1, order=2, alphabet=4, seq_len=10)
    seq = ring.sample(5, 40, rng=np.random.default_rng(1))
    assert ring.entropy_rate() == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(ring.stationary, 1 / 16)  # the de Bruijn cycle through all 16 contexts
    cycle = de_bruijn(4, 2)
    for row in seq:  # every sequence walks the cycle
        start = next(i for i in range(16) if cycle[i] == row[0] and cycle[(i + 1) % 16] == row[1])
        assert np.array_equal(row, cycle[(start + np.arange(40)) % 16])
    # only the first target is uncertain (the first token does not tell where on the cycle we are)
    assert ring.loss_floor == pytest.approx(ring.conditional_entropy(1) / 10)


def test_config_names_the_source() -> None:
    assert CFG.data.source == SyntheticSource.MARKOV == "markov"
    assert synthetic_source("markov") is synthetic_source("synthetic") is SyntheticSource.MARKOV
    assert synthetic_source("corpus.txt") is None
    old = read_config({"data": {"source": "synthetic"}})
    assert old.data.source == "markov" and old.config_hash() == CFG.config_hash()
    src = open_source(CFG, None, stream_id=1)
    assert isinstance(src, SyntheticMarkovSource) and (src.order, src.alphabet, src.branching) == (2, 16, 3)
    assert src.loss_floor == src.floor_at(CFG.training.sequence_length) == loss_floor(CFG)
    assert isinstance(open_source(CFG, "markov", 1), SyntheticMarkovSource)  # --data markov
    with pytest.raises(ConfigError, match="4096 contexts"):
        read_config({"data": {"markov_order": 3}})
    with pytest.raises(ConfigError, match="markov_order"):
        read_config({"data": {"markov_order": 0}})
    # the limit is on the chain actually built: the alphabet is clipped to the vocabulary
    assert read_config({"model": {"vocab_size": 8}, "data": {"markov_order": 3}}).data.markov_order == 3
    # a file source has no floor, and no chain limits apply to it
    corpus = read_config({"data": {"source": "corpus.bin", "markov_order": 9}})
    assert loss_floor(corpus) is None


def test_only_a_model_with_blocks_gets_below_the_current_token_floor(one_thread) -> None:
    """Stage 0 alone (embedding -> norm -> head) is a function of the current token: it cannot go
    below context_free_floor. The default model (two one-layer block stages) must, clearly."""
    torch.manual_seed(0)
    seq_len, batch, budget = 32, 16, 120.0
    source, held_out = markov_source(CFG, 1), markov_source(CFG, 2)
    x_eval, y_eval = held_out.next_batch(64, seq_len)
    floor, context_free = held_out.floor_at(seq_len), held_out.context_free_floor

    def train(model: torch.nn.Module, loss_fn, steps: int) -> float:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
        started = time.monotonic()
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
            x, y = source.next_batch(batch, seq_len)
            loss = loss_fn(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert time.monotonic() - started < budget, f"training took over {budget} s"
        with torch.no_grad():
            return loss_fn(x_eval, y_eval).item()

    edge = build_stage(CFG.model, 0, CFG.seed)
    edge_only = train(edge, lambda x, y: edge.loss(edge.embed(x), y), 150)
    full = ReferenceModel(CFG.model, CFG.num_stages, CFG.seed)
    with_blocks = train(full, full, 250)
    print(
        f"\nfloor {floor:.3f}, current token alone {context_free:.3f}: stage 0 only {edge_only:.3f}, blocks {with_blocks:.3f}"
    )
    assert math.log(CFG.model.vocab_size) > edge_only > context_free - 0.05  # no better than the bigram optimum
    assert edge_only < context_free + 0.2  # it did learn what one token tells
    assert edge_only > floor + 1.0  # far above the floor
    assert with_blocks < context_free - 1.0, (with_blocks, context_free)  # the blocks carry context
    assert with_blocks > floor - 0.1  # nobody beats the floor (up to the eval batch's noise)
