"""Tensor codec: round trips with error bounds per codec, and hostile encodings."""

from __future__ import annotations

import math
import resource
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from protocol import COMPRESSIONS, DTYPES, Limits, ProtocolError, decode_tensor, encode_tensor, wire_nbytes

FLOATS = {torch.float32, torch.float16, torch.bfloat16}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=150, deadline=None)

shapes = array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


@st.composite
def tensors(draw, dtypes: tuple[torch.dtype, ...] = ()) -> torch.Tensor:
    dtypes = dtypes or tuple(DTYPES.values())
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    if dtype in FLOATS:
        # inside fp16's normal range so the fp16 bound below is a pure relative one plus subnormals
        arr = draw(arrays(np.float32, shape, elements=st.floats(-6e4, 6e4, width=32)))
        return torch.from_numpy(arr).to(dtype)
    if dtype == torch.bool:
        return torch.from_numpy(draw(arrays(np.bool_, shape)))
    np_dtype = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}[dtype]
    return torch.from_numpy(draw(arrays(np_dtype, shape)))


def assert_codec_bounds(orig: torch.Tensor, dec: torch.Tensor, compression: str, block: int = 256) -> None:
    assert dec.dtype == orig.dtype and dec.shape == orig.shape
    if orig.dtype not in FLOATS or compression == "none":
        assert torch.equal(dec, orig)
        return
    x, y = orig.double().reshape(-1), dec.double().reshape(-1)
    err = (y - x).abs()
    # rounding back into a 16-bit original dtype adds its own half-ulp
    out_eps = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[orig.dtype]
    if compression == "fp16":
        bound = x.abs() * (2.0**-11 + out_eps) + 2.0**-24
    elif compression == "bf16":
        bound = x.abs() * (2.0**-8 + out_eps) + 1e-38
    else:
        absmax = torch.zeros_like(x)
        for start in range(0, x.numel(), block):
            absmax[start : start + block] = x[start : start + block].abs().max()
        # + 2**-142: a block whose absmax is float32-subnormal (< 127 * 2**-150) gets a scale that
        # underflows to 0, so its values decode as 0: an error below 2**-142
        bound = absmax / 127 * (1 + 1e-6) + x.abs() * out_eps + 2.0**-142
    assert bool((err <= bound).all()), f"{compression} {orig.dtype}: max excess {(err - bound).max()}"


@ROUND_TRIP
@given(t=tensors(), compression=st.sampled_from(COMPRESSIONS), block=st.sampled_from([1, 3, 256]))
def test_round_trip_all_dtypes_and_codecs(t: torch.Tensor, compression: str, block: int) -> None:
    enc = encode_tensor(t, compression, block_size=block)
    assert enc["dtype"] == str(t.dtype).removeprefix("torch.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable buffer" warning must not appear
        dec = decode_tensor(enc)
    assert_codec_bounds(t, dec, compression, block)
    if t.dtype not in FLOATS:
        assert enc["codec"] == "none"


def test_int8_is_smaller_and_bounded_per_block() -> None:
    x = torch.cat([torch.randn(256) * 1e-6, torch.randn(256) * 1e3, torch.zeros(100)])
    enc = encode_tensor(x, "int8")
    assert len(enc["data"]) == x.numel() and len(enc["scales"]) == 3 * 4
    dec = decode_tensor(enc)
    assert_codec_bounds(x, dec, "int8")
    assert torch.equal(dec[-100:], torch.zeros(100))
    # fp32 scales keep tiny gradients alive (fp16 scales would flush them to zero)
    assert dec[:256].abs().max() > 0


def test_int8_blocks_of_subnormal_values_decode_within_their_scale() -> None:
    # a block of subnormal values has a subnormal scale (its reciprocal would overflow fp32, and
    # its rounding can put x / scale past 127): it still decodes finite and within its scale, in a
    # full block and in the tail
    tiny = torch.full((256,), 1e-40) * torch.randn(256).sign()
    for x in (torch.cat([tiny, torch.randn(256)]), torch.cat([torch.randn(256), tiny[:37]])):
        dec = decode_tensor(encode_tensor(x, "int8", block_size=256))
        assert bool(torch.isfinite(dec).all())
        assert_codec_bounds(x, dec, "int8")
        assert dec.abs().max() > 0.1  # the normal block is untouched


def test_scalar_empty_noncontiguous_and_grad_tensors() -> None:
    for t in [torch.tensor(2.5), torch.tensor(7), torch.tensor(True), torch.zeros(0), torch.zeros(3, 0, 2)]:
        for compression in COMPRESSIONS:
            dec = decode_tensor(encode_tensor(t, compression))
            assert dec.shape == t.shape and dec.dtype == t.dtype
    base = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(decode_tensor(encode_tensor(base.t())), base.t())
    w = torch.ones(3, requires_grad=True)
    assert torch.equal(decode_tensor(encode_tensor(w * 2)), torch.full((3,), 2.0))


def test_encoding_is_a_snapshot_and_decoded_tensor_is_writable_and_independent() -> None:
    t = torch.arange(4, dtype=torch.float32)
    enc = encode_tensor(t)
    t.add_(100)  # e.g. an optimizer step while the message waits in a send queue
    data = enc["data"]
    dec = decode_tensor(enc)
    assert torch.equal(dec, torch.arange(4, dtype=torch.float32))
    dec.add_(1)
    assert enc["data"] == data  # the received bytes are untouched
    # 1-byte bytes objects are interned by CPython: writing through a view would corrupt them all
    one = decode_tensor(encode_tensor(torch.tensor([5], dtype=torch.uint8)))
    one.add_(1)
    assert bytes([5]) == b"\x05"


def test_writable_buffer_is_zero_copy() -> None:
    enc = encode_tensor(torch.arange(4, dtype=torch.int32))
    enc["data"] = bytearray(enc["data"])
    dec = decode_tensor(enc)
    enc["data"][0] = 9
    assert dec[0].item() == 9


def test_encoder_rejects_what_it_cannot_represent() -> None:
    with pytest.raises(ProtocolError, match="unsupported tensor dtype"):
        encode_tensor(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ProtocolError, match="unknown compression"):
        encode_tensor(torch.zeros(2), "zstd")
    with pytest.raises(ProtocolError, match="finite"):
        encode_tensor(torch.tensor([1.0, float("nan")]), "int8")
    # the check reads the per-block maxima: a non-finite value anywhere, beside larger ones, in a
    # full block or the tail, must still show
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (3, 300, 517):
            x = torch.randn(520) * 100
            x[where] = bad
            with pytest.raises(ProtocolError, match="finite"):
                encode_tensor(x, "int8", block_size=256)
    with pytest.raises(ProtocolError, match="block_size"):
        encode_tensor(torch.zeros(2), "int8", block_size=0)
    with pytest.raises(ProtocolError):
        encode_tensor([1, 2])  # type: ignore[arg-type]


def _valid() -> dict:
    return encode_tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3))


def _valid_int8() -> dict:
    return encode_tensor(torch.arange(600, dtype=torch.float32), "int8")


BAD_TENSORS = [
    ("not a map", lambda e: [1, 2]),
    ("unknown dtype", lambda e: {**e, "dtype": "float64"}),
    ("dtype not str", lambda e: {**e, "dtype": 3}),
    ("unknown codec", lambda e: {**e, "codec": "zstd"}),
    ("codec on ints", lambda e: {**e, "dtype": "int32", "codec": "fp16"}),
    ("missing key", lambda e: {k: v for k, v in e.items() if k != "shape"}),
    ("extra key", lambda e: {**e, "extra": 1}),
    ("shape not list", lambda e: {**e, "shape": 6}),
    ("negative dim", lambda e: {**e, "shape": [-2, -3]}),
    ("bool dim", lambda e: {**e, "shape": [True, 6]}),
    ("float dim", lambda e: {**e, "shape": [2.0, 3]}),
    ("too many dims", lambda e: {**e, "shape": [1] * 9}),
    ("short data", lambda e: {**e, "data": e["data"][:-1]}),
    ("long data", lambda e: {**e, "data": e["data"] + b"\0"}),
    ("data not bytes", lambda e: {**e, "data": "abc"}),
    ("huge shape", lambda e: {**e, "shape": [2**40, 2**40]}),
    ("huge shape many dims", lambda e: {**e, "shape": [2**64 - 1] * 8}),
    ("just over limit", lambda e: {**e, "shape": [2**26 + 1]}),
]
BAD_INT8 = [
    ("scales short", lambda e: {**e, "scales": e["scales"][:-4]}),
    ("scales missing", lambda e: {k: v for k, v in e.items() if k != "scales"}),
    ("block zero", lambda e: {**e, "block": 0}),
    ("block bool", lambda e: {**e, "block": True}),
    ("block huge", lambda e: {**e, "block": 2**64 - 1}),
    ("block changed", lambda e: {**e, "block": 100}),
    ("scales not bytes", lambda e: {**e, "scales": [1.0, 2.0, 3.0]}),
]


@pytest.mark.parametrize(
    "int8,mutate",
    [(False, m) for _, m in BAD_TENSORS] + [(True, m) for _, m in BAD_INT8],
    ids=[n for n, _ in BAD_TENSORS + BAD_INT8],
)
def test_rejects_malformed_tensor(int8: bool, mutate) -> None:
    base = _valid_int8() if int8 else _valid()
    start = time.perf_counter()
    with pytest.raises(ProtocolError):
        decode_tensor(mutate(base))
    assert time.perf_counter() - start < 0.5  # fail fast, before any allocation


def test_size_limit_is_about_the_decoded_dtype() -> None:
    limits = Limits(max_tensor_bytes=1000)
    ok = encode_tensor(torch.zeros(250), "fp16")  # 500 wire bytes, 1000 decoded
    assert decode_tensor(ok, limits).numel() == 250
    with pytest.raises(ProtocolError, match="max_tensor_bytes"):
        decode_tensor(encode_tensor(torch.zeros(251), "int8"), limits)


def test_empty_int8_still_validates_block_and_scales() -> None:
    enc = encode_tensor(torch.zeros(0), "int8")
    assert enc["scales"] == b"" and decode_tensor(enc).numel() == 0
    for bad in ({**enc, "block": 0}, {**enc, "scales": b"\0" * 4}):
        with pytest.raises(ProtocolError):
            decode_tensor(bad)


def test_huge_int8_block_does_not_pad() -> None:
    enc = encode_tensor(torch.tensor([3.0]), "int8", block_size=2**30)
    assert decode_tensor(enc).item() == pytest.approx(3.0)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    key=st.sampled_from(["dtype", "codec", "shape", "data", "block", "scales", "junk"]),
    value=msgpack_values,
    int8=st.booleans(),
    drop=st.booleans(),
)
def test_fuzzed_fields_only_raise_protocol_error(key: str, value, int8: bool, drop: bool) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    enc = _valid_int8() if int8 else _valid()
    if drop:
        enc.pop(key, None)
    else:
        enc[key] = value
    try:
        out = decode_tensor(enc)
    except ProtocolError:
        return
    assert isinstance(out, torch.Tensor) and math.prod(out.shape) <= 600
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB


def test_fp16_leaves_values_beyond_its_range_in_their_own_dtype():
    """A diverging model's activations past 65504 would become inf in fp16, which a receiver must
    refuse as hostile: such a tensor travels uncompressed, and one in range still goes as fp16."""
    big = torch.tensor([1.0, -70000.0, 3.5])
    encoded = encode_tensor(big, "fp16")
    assert encoded["codec"] == "none"
    assert torch.equal(decode_tensor(encoded), big)
    in_range = torch.tensor([1.0, -65000.0, 3.5])
    encoded = encode_tensor(in_range, "fp16")
    assert encoded["codec"] == "fp16" and len(encoded["data"]) == 2 * 3
    assert torch.isfinite(decode_tensor(encoded)).all()


@given(t=tensors(), compression=st.sampled_from(COMPRESSIONS), block=st.sampled_from((1, 7, 256)))
@ROUND_TRIP
def test_wire_nbytes_is_what_the_encoding_writes(t: torch.Tensor, compression: str, block: int) -> None:
    if compression == "int8" and t.dtype in FLOATS and not bool(torch.isfinite(t).all()):
        return  # int8 refuses non-finite values: nothing is written
    encoded = encode_tensor(t, compression, block)
    written = len(encoded["data"]) + len(encoded.get("scales", b""))
    if t.dtype == torch.float32 and compression == "fp16" and encoded["codec"] == "none":
        return  # beyond fp16's range: sent in its own dtype, which wire_nbytes does not look for
    assert wire_nbytes(t, compression, block) == written
