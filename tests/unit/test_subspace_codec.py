"""The subspace hop codecs (protocol/subspace.py, framed by protocol/tensors.py): what a receiver
gets back is the projection of what was sent within the quantization's error, the bytes are what
the codec states, and every malformed encoding is refused before anything of its size is built."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    ANCHOR_IDS,
    Message,
    MessageKind,
    ProtocolError,
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
    subspace,
    wire_nbytes,
)
from protocol.tensors import SUBSPACE_BITS, Compression

SUBSPACE_CODECS = tuple(SUBSPACE_BITS)
# worst relative error of a row's coordinates after per-row absmax quantization: half a step of
# absmax / levels on each coordinate (the bf16 scale rounded up by at most 2^-8), measured against
# the row's norm (>= its absmax)
QUANTIZATION_ERROR = {8: 0.5 / 127 * (1 + 2**-7), 4: 0.5 / 7 * (1 + 2**-7)}


def projection(x: torch.Tensor, bits: int) -> torch.Tensor:
    width = x.shape[-1]
    basis = subspace.basis(width, subspace.rank_of(width, bits)).double()
    return ((x.double().reshape(-1, width) @ basis) @ basis.T).reshape(x.shape)


@pytest.mark.parametrize("width", [18, 64, 288, 576, 4096])
def test_the_basis_is_orthonormal_and_the_same_on_every_call(width: int) -> None:
    for bits in (8, 4):
        rank = subspace.rank_of(width, bits)
        basis = subspace.basis(width, rank)
        assert basis.shape == (width, rank) and basis.dtype == torch.float32
        gram = basis.double().T @ basis.double()
        assert torch.allclose(gram, torch.eye(rank, dtype=torch.float64), atol=1e-5)
        subspace.basis.cache_clear()
        assert torch.equal(subspace.basis(width, rank), basis)


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
def test_a_tensor_comes_back_as_its_projection_within_the_quantization_error(codec: Compression) -> None:
    bits = SUBSPACE_BITS[codec]
    x = torch.randn(4, 32, 288, generator=torch.Generator().manual_seed(1)) * 3.0
    decoded = decode_tensor(encode_tensor(x, codec))
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    expected = projection(x, bits)
    coordinates_norm = expected.reshape(-1, 288).norm(dim=1)
    row_error = (decoded.double() - expected).reshape(-1, 288).norm(dim=1)
    rank = subspace.rank_of(288, bits)
    # each of the rank coordinates is off by at most half a step; the basis is orthonormal
    assert (row_error <= math.sqrt(rank) * QUANTIZATION_ERROR[bits] * coordinates_norm + 1e-6).all()
    # and the projection drops what lies outside: most of a random tensor at rank W // 9
    assert (decoded - x).norm() > 0.5 * x.norm()


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
def test_a_tensor_inside_the_subspace_comes_back_whole(codec: Compression) -> None:
    bits = SUBSPACE_BITS[codec]
    rank = subspace.rank_of(288, bits)
    inside = torch.randn(64, rank, generator=torch.Generator().manual_seed(2)) @ subspace.basis(288, rank).T
    decoded = decode_tensor(encode_tensor(inside.reshape(2, 32, 288), codec)).reshape(64, 288)
    relative = ((decoded - inside).norm(dim=1) / inside.norm(dim=1)).max().item()
    assert relative <= math.sqrt(rank) * QUANTIZATION_ERROR[bits]


def test_the_gradient_of_the_projection_is_the_projected_gradient() -> None:
    """Why a backward hop may travel in the same codec: d(x P P^T)/dx applied to g is P P^T g."""
    x = torch.randn(3, 5, 288, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 288, dtype=torch.float64)
    (grad,) = torch.autograd.grad(projection(x, 8), [x], g)
    assert torch.allclose(grad, projection(g, 8))


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
def test_sixteen_times_fewer_bytes_than_fp16_at_the_15m_width(codec: Compression) -> None:
    hop = torch.randn(8, 256, 288)
    encoded = encode_tensor(hop, codec)
    nbytes = len(encoded["data"]) + len(encoded["scales"])
    assert nbytes == wire_nbytes(hop, codec)
    assert wire_nbytes(hop, Compression.FP16) / nbytes >= 16.0


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
@pytest.mark.parametrize("shape", [(100,), (4, 8), (2, 3, 4097)])
def test_tensors_without_rows_the_codec_covers_go_in_int8(codec: Compression, shape: tuple[int, ...]) -> None:
    t = torch.randn(shape)
    encoded = encode_tensor(t, codec)
    assert encoded["codec"] == "int8"
    assert wire_nbytes(t, codec) == wire_nbytes(t, Compression.INT8)
    assert torch.allclose(decode_tensor(encoded), t, atol=t.abs().max().item() / 100)


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_refused_at_encoding(codec: Compression, bad: float) -> None:
    t = torch.zeros(2, 4, 64)
    t[1, 2, 3] = bad
    with pytest.raises(ProtocolError, match="finite"):
        encode_tensor(t, codec)


def _valid(codec: Compression) -> dict:
    return encode_tensor(torch.randn(2, 8, 288), codec)


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
@pytest.mark.parametrize(
    "change, refusal",
    [
        (lambda e: e.update(data=bytes(e["data"])[:-1]), "bytes of codes"),
        (lambda e: e.update(data=bytes(e["data"]) + b"\0"), "bytes of codes"),
        (lambda e: e.update(scales=bytes(e["scales"])[:-4]), "of scales"),
        (lambda e: e.update(scales=bytes(e["scales"]) + b"\0" * 4), "of scales"),
        (lambda e: e.update(shape=[2, 8, 4097]), "rows of"),
        (lambda e: e.update(shape=[16, 8]), "rows of|bytes of codes"),
        (lambda e: e.update(shape=[288]), "rows of"),
        (lambda e: e.update(shape=[2, 8, 8]), "rows of"),
        (lambda e: e.update(shape=[1 << 20, 1 << 20, 288]), "max_tensor_bytes"),
        (lambda e: e.pop("scales"), "keys"),
        (lambda e: e.pop("anchored"), "keys"),
        (lambda e: e.update(anchored=1), "must be a bool"),
        (lambda e: e.update(anchored=True), "needs integer ids"),
        (lambda e: e.update(block=32), "keys"),
        (lambda e: e.update(scales="not bytes"), "must be bytes"),
        (lambda e: e.update(dtype="int64"), "only valid for floating"),
    ],
)
def test_malformed_encodings_are_refused_before_any_basis_or_buffer_is_built(
    codec: Compression, change, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded = _valid(codec)
    change(encoded)

    def no_basis(width: int, rank: int) -> torch.Tensor:
        raise AssertionError(f"a basis of width {width} was built for a malformed encoding")

    monkeypatch.setattr(subspace, "basis", no_basis)
    with pytest.raises(ProtocolError, match=refusal):
        decode_tensor(encoded)


@settings(max_examples=60, deadline=None)
@given(
    codec=st.sampled_from(SUBSPACE_CODECS),
    rows=st.integers(0, 6),
    width=st.integers(subspace.MIN_WIDTH, 300),
    scale=st.floats(1e-8, 1e4),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_the_projection_for_any_width_and_scale(
    codec: Compression, rows: int, width: int, scale: float, seed: int
) -> None:
    bits = SUBSPACE_BITS[codec]
    x = torch.randn(rows, 1, width, generator=torch.Generator().manual_seed(seed)) * scale
    encoded = encode_tensor(x, codec)
    assert encoded["codec"] == codec
    decoded = decode_tensor(encoded)
    assert decoded.shape == x.shape
    expected = projection(x, bits)
    rank = subspace.rank_of(width, bits)
    bound = math.sqrt(rank) * QUANTIZATION_ERROR[bits] * expected.reshape(-1, width).norm(dim=1) + 1e-30
    assert ((decoded.double() - expected).reshape(-1, width).norm(dim=1) <= bound * 1.001).all()


@settings(max_examples=100, deadline=None)
@given(
    codec=st.sampled_from(SUBSPACE_CODECS),
    shape=st.lists(st.integers(0, 5000), min_size=0, max_size=4),
    data=st.binary(max_size=512),
    scales=st.binary(max_size=64),
)
def test_arbitrary_encodings_decode_or_are_refused(
    codec: Compression, shape: list[int], data: bytes, scales: bytes
) -> None:
    encoded = {
        "dtype": "float32",
        "codec": codec.value,
        "shape": shape,
        "data": data,
        "scales": scales,
        "anchored": False,
    }
    try:
        decoded = decode_tensor(encoded)
    except ProtocolError:
        return
    assert list(decoded.shape) == shape


def forward_message(hidden: torch.Tensor, token_ids: torch.Tensor | None) -> Message:
    meta = {"microbatch_id": 1, "origin": "o", "path": ["o"], "order": [1], "hop": 1, "token": "t"}
    tensors = {"hidden": hidden, **({ANCHOR_IDS: token_ids} if token_ids is not None else {})}
    return Message(MessageKind.FORWARD, "swarm", 0, 1, meta, tensors)


@pytest.mark.parametrize("codec", SUBSPACE_CODECS)
def test_a_hop_with_its_token_ids_comes_back_whole_when_it_is_anchor_plus_subspace(codec: Compression) -> None:
    """The anchors carry which token each position holds at full rank; only the rest is projected."""
    bits = SUBSPACE_BITS[codec]
    rank = subspace.rank_of(288, bits)
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(3)).to(torch.int16)
    inside = torch.randn(32, rank, generator=torch.Generator().manual_seed(4)) @ subspace.basis(288, rank).T * 0.05
    hidden = (subspace.anchors(ids.reshape(-1), 288) + inside).reshape(2, 16, 288)
    received = decode_message(encode_message(forward_message(hidden, ids), codec))
    assert torch.equal(received.tensors[ANCHOR_IDS], ids)
    error = (received.tensors["hidden"] - hidden).reshape(32, 288).norm(dim=1) / inside.norm(dim=1)
    assert error.max().item() <= math.sqrt(rank) * QUANTIZATION_ERROR[bits]
    # without the ids the same hidden states lose the anchors' part outside the subspace
    plain = decode_message(encode_message(forward_message(hidden, None), codec)).tensors["hidden"]
    assert (plain - hidden).norm() > 0.5 * (hidden - inside.reshape(2, 16, 288)).norm()


def test_anchored_hidden_states_with_other_token_ids_decode_to_other_states() -> None:
    ids = torch.arange(32, dtype=torch.int16).reshape(2, 16)
    hidden = torch.randn(2, 16, 288)
    encoded = encode_tensor(hidden, Compression.SUBSPACE8, anchor_ids=ids)
    assert encoded["anchored"] is True
    same = decode_tensor(encoded, anchor_ids=ids)
    other = decode_tensor(encoded, anchor_ids=ids + 1)
    assert not torch.allclose(same, other)
    with pytest.raises(ProtocolError, match="needs integer ids"):
        decode_tensor(encoded, anchor_ids=ids[:, :8])
    with pytest.raises(ProtocolError, match="needs integer ids"):
        decode_tensor(encoded, anchor_ids=ids.float())


def test_a_hop_is_sixteen_times_smaller_than_fp16_as_a_whole_message_at_the_15m_shape() -> None:
    ids = torch.randint(0, 32000, (8, 256)).to(torch.int16)
    hidden = torch.randn(8, 256, 288)
    subspace_hop = len(encode_message(forward_message(hidden, ids), Compression.SUBSPACE8))
    fp16_hop = len(encode_message(forward_message(hidden, None), Compression.FP16))
    assert fp16_hop / subspace_hop >= 16.0


def test_the_anchors_are_a_fixed_full_rank_function_of_the_token_id() -> None:
    ids = torch.arange(1000)
    table = subspace.anchors(ids, 288)
    assert torch.equal(table, subspace.anchors(ids, 288))
    assert torch.equal(table[7], subspace.anchors(torch.tensor([7]), 288)[0])
    assert torch.linalg.matrix_rank(table).item() == 288
    assert abs(table.std().item() - subspace.ANCHOR_STD) < 0.1 * subspace.ANCHOR_STD
