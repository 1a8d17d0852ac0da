"""Message envelope: round trips of every kind, schema enforcement, and hostile payloads."""

from __future__ import annotations

import resource
import time
import tracemalloc
import types

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from protocol import (
    COMPRESSIONS,
    DTYPES,
    KIND_SCHEMAS,
    KIND_TENSORS,
    PROTOCOL_VERSION,
    Limits,
    Message,
    MessageKind,
    ProtocolError,
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SWARM = "swarm-a"
VERSION_BYTE = bytes([PROTOCOL_VERSION])  # a message starts with the protocol version

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
meta_values = scalars | st.lists(scalars, max_size=5) | st.lists(st.lists(scalars, max_size=3), max_size=3)


def value_for(spec) -> st.SearchStrategy:
    if isinstance(spec, types.GenericAlias):
        return st.lists(value_for(spec.__args__[0]), max_size=5)
    return {int: st.integers(0, 2**64 - 1), str: st.text(max_size=30), float: st.floats(allow_nan=False)}[spec]


@st.composite
def small_tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    arr = draw(
        arrays(np.float32, array_shapes(min_dims=0, max_dims=3, max_side=5), elements=st.floats(-1e3, 1e3, width=32))
    )
    return torch.from_numpy(arr).to(dtype)


@st.composite
def messages(draw, kind: MessageKind | None = None) -> Message:
    kind = kind or draw(st.sampled_from(list(MessageKind)))
    meta = {key: draw(value_for(spec)) for key, spec in KIND_SCHEMAS[kind].items()}
    extra = draw(st.dictionaries(st.text(min_size=1, max_size=10), meta_values, max_size=5))
    meta.update({k: v for k, v in extra.items() if k not in meta})
    names = sorted(KIND_TENSORS[kind]) + draw(st.lists(st.text(min_size=1, max_size=8), max_size=2, unique=True))
    return Message(
        kind=kind,
        swarm_id=draw(st.text(min_size=1, max_size=20)),
        sender_stage=draw(st.integers(-1, 2**31 - 1)),
        request_id=draw(st.integers(0, 2**64 - 1)),
        meta=meta,
        tensors={name: draw(small_tensors()) for name in names},
    )


def assert_same(msg: Message, out: Message, compression: str) -> None:
    assert (out.kind, out.swarm_id, out.sender_stage, out.request_id, out.version) == (
        msg.kind,
        msg.swarm_id,
        msg.sender_stage,
        msg.request_id,
        msg.version,
    )
    assert out.meta == msg.meta
    assert out.tensors.keys() == msg.tensors.keys()
    for name, t in msg.tensors.items():
        # the message path must give exactly what the tensor codec gives (whose error bounds
        # test_protocol_tensors proves), and stay close to the original for every codec
        expected = decode_tensor(encode_tensor(t, compression))
        assert out.tensors[name].dtype == t.dtype and torch.equal(out.tensors[name], expected)
        if t.is_floating_point() and t.numel():
            tol = 1e3 / 127 * 1.01 if compression == "int8" else 1e3 * 2**-7
            assert (out.tensors[name].float() - t.float()).abs().max() <= tol


@settings(max_examples=150, deadline=None)
@given(msg=messages(), compression=st.sampled_from(COMPRESSIONS))
def test_round_trip_every_kind(msg: Message, compression: str) -> None:
    data = encode_message(msg, compression)
    assert_same(msg, decode_message(data, expected_swarm=msg.swarm_id), compression)
    assert_same(msg, decode_message(memoryview(data)), compression)
    assert_same(msg, decode_message(bytearray(data)), compression)


@pytest.mark.parametrize("kind", list(MessageKind))
@settings(max_examples=10, deadline=None)
@given(data=st.data(), compression=st.sampled_from(COMPRESSIONS))
def test_each_kind_round_trips(kind: MessageKind, data, compression: str) -> None:
    # guarantees every kind is hit even if hypothesis sampled unevenly above
    msg = data.draw(messages(kind))
    assert_same(msg, decode_message(encode_message(msg, compression)), compression)


def _default(spec):
    if isinstance(spec, types.GenericAlias):
        return [_default(spec.__args__[0])]
    return {int: 1, str: "s", float: 1.0}[spec]


def sample(kind: MessageKind) -> Message:
    meta = {key: _default(spec) for key, spec in KIND_SCHEMAS[kind].items()}
    return Message(kind, SWARM, 0, 1, meta, {name: torch.ones(2) for name in KIND_TENSORS[kind]})


def forward(**overrides) -> Message:
    meta = {"microbatch_id": 3, "origin": "peerA", "path": ["peerA"], "order": [0, 1, 2], "hop": 1}
    msg = Message(MessageKind.FORWARD, SWARM, 0, 42, meta, {"hidden": torch.randn(2, 4)})
    for key, value in overrides.items():
        setattr(msg, key, value)
    return msg


def raw_envelope(body: dict, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb(version) + msgpack.packb(body, use_bin_type=True)


def valid_body() -> dict:
    return msgpack.unpackb(encode_message(forward())[1:], raw=False)


def test_unknown_version_names_both_versions() -> None:
    with pytest.raises(
        ProtocolError,
        match=rf"protocol version {PROTOCOL_VERSION + 1} not supported \(this node speaks {PROTOCOL_VERSION}\)",
    ):
        decode_message(encode_message(forward(version=PROTOCOL_VERSION + 1)))
    # even if a future version changed the whole layout after the version number
    with pytest.raises(ProtocolError, match="protocol version 70000 not supported"):
        decode_message(msgpack.packb(70000) + b"\xc1 anything")


def test_swarm_mismatch() -> None:
    data = encode_message(forward())
    assert decode_message(data, expected_swarm=SWARM).swarm_id == SWARM
    with pytest.raises(ProtocolError, match="swarm"):
        decode_message(data, expected_swarm="other")


@pytest.mark.parametrize("kind", [k for k in MessageKind if KIND_SCHEMAS[k]])
def test_missing_required_meta_key(kind: MessageKind) -> None:
    msg = sample(kind)
    key = next(iter(KIND_SCHEMAS[kind]))
    del msg.meta[key]
    with pytest.raises(ProtocolError, match=f"missing meta key '{key}'"):
        encode_message(msg)
    body = msgpack.unpackb(encode_message(sample(kind))[1:], raw=False)
    del body["meta"][key]
    with pytest.raises(ProtocolError, match="missing meta key"):
        decode_message(raw_envelope(body))


@pytest.mark.parametrize("kind", [k for k in MessageKind if KIND_TENSORS[k]])
def test_missing_required_tensor(kind: MessageKind) -> None:
    body = msgpack.unpackb(encode_message(sample(kind))[1:], raw=False)
    body["tensors"].pop(next(iter(KIND_TENSORS[kind])))
    with pytest.raises(ProtocolError, match="missing tensor"):
        decode_message(raw_envelope(body))


def _set(path: tuple, value):
    def mutate(body: dict) -> dict:
        target = body
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return body

    return mutate


_DELETE = object()
LONG = "x" * 1025
BAD_BODIES = {
    "unknown kind": _set(("kind",), "teleport"),
    "kind not str": _set(("kind",), 1),
    "missing envelope key": _set(("request_id",), _DELETE),
    "extra envelope key": _set(("extra",), 1),
    "empty swarm": _set(("swarm_id",), ""),
    "long swarm": _set(("swarm_id",), LONG),
    "stage too low": _set(("sender_stage",), -2),
    "stage bool": _set(("sender_stage",), True),
    "request id negative": _set(("request_id",), -1),
    "request id float": _set(("request_id",), 1.0),
    "meta not map": _set(("meta",), [1]),
    "tensors not map": _set(("tensors",), [1]),
    "wrong meta type": _set(("meta", "hop"), "1"),
    "bool as int": _set(("meta", "hop"), True),
    "negative required int": _set(("meta", "microbatch_id"), -5),
    "wrong list item type": _set(("meta", "path"), ["a", 1]),
    "list for scalar": _set(("meta", "origin"), ["a"]),
    "bool in an int list": _set(("meta", "order"), [0, True, 2]),
    "negative in an int list": _set(("meta", "order"), [0, -1, 2]),
    "long string in a str list": _set(("meta", "path"), ["a", LONG]),
    "long string in a free list": _set(("meta", "x"), ["a", LONG]),
    "meta map value": _set(("meta", "x"), {"a": 1}),
    "meta too deep": _set(("meta", "x"), [[[1]]]),
    "meta list too long": _set(("meta", "x"), list(range(1025))),
    "meta string too long": _set(("meta", "x"), LONG),
    "meta bytes too long": _set(("meta", "x"), b"x" * 1025),
    "meta empty key": _set(("meta", ""), 1),
    "too many meta entries": lambda b: {**b, "meta": {**b["meta"], **{f"k{i}": i for i in range(60)}}},
    "too many tensors": lambda b: {**b, "tensors": {f"t{i}": b["tensors"]["hidden"] for i in range(17)}},
    "tensor name empty": _set(("tensors", ""), encode_tensor(torch.zeros(1))),
    "huge tensor shape": _set(("tensors", "hidden", "shape"), [2**40, 2**40]),
    "tensor not map": _set(("tensors", "hidden"), b"\0" * 32),
}


@pytest.mark.parametrize("mutate", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_rejects_bad_envelopes(mutate) -> None:
    data = raw_envelope(mutate(valid_body()))
    start = time.perf_counter()
    with pytest.raises(ProtocolError):
        decode_message(data)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "data",
    [
        b"",
        VERSION_BYTE,
        b"\xc1",
        b"\xcd\x00",
        VERSION_BYTE + b"\xc1",
        VERSION_BYTE + b"\x90",
        VERSION_BYTE + msgpack.packb(None),
        # trailing garbage, ext types (incl. timestamp), non-str map keys
        encode_message(forward()) + b"\x00",
        VERSION_BYTE + msgpack.packb({"kind": msgpack.ExtType(5, b"x")}),
        VERSION_BYTE + b"\xd6\xff\x00\x00\x00\x00",
        VERSION_BYTE + msgpack.packb({1: 2}),
        VERSION_BYTE + b"\x81\xc4\x01k\x01",  # bin map key
    ],
    ids=lambda d: d[:12].hex(),
)
def test_rejects_malformed_bytes(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_message(data)


def test_rejects_non_buffer_and_oversize() -> None:
    with pytest.raises(ProtocolError):
        decode_message("not bytes")  # type: ignore[arg-type]
    data = encode_message(forward())
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode_message(data, Limits(max_frame_bytes=len(data) - 1))


def test_encoder_validates_before_sending() -> None:
    with pytest.raises(ProtocolError, match="missing tensor"):
        encode_message(forward(tensors={}))
    with pytest.raises(ProtocolError, match="unsupported type"):
        encode_message(forward(meta={**forward().meta, "x": (1, 2)}))
    with pytest.raises(ProtocolError, match="request_id"):
        encode_message(forward(request_id=2**64))
    with pytest.raises(ProtocolError, match="unknown compression"):
        encode_message(Message(MessageKind.PING, SWARM, 0, 0), "zstd")
    with pytest.raises(ProtocolError, match=r"torch\.Tensor"):
        encode_message(forward(tensors={"hidden": [1.0]}))
    with pytest.raises(ProtocolError, match="max_tensor_bytes"):
        encode_message(forward(), limits=Limits(max_tensor_bytes=8))
    assert decode_message(encode_message(Message("ping", SWARM, -1, 0))).kind is MessageKind.PING


def test_nested_containers_cannot_amplify_memory() -> None:
    # ~1 MiB of empty arrays would be ~60 MiB of Python lists; the item budget stops it early
    inner = b"\xdc\x04\x00" + b"\x90" * 1024  # array16 of 1024 empty arrays
    payload = VERSION_BYTE + b"\xdc\x04\x00" + inner * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="max_total_items"):
            decode_message(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


# -- fuzz ------------------------------------------------------------------------------------------


def decode_or_reject(data: bytes) -> None:
    try:
        decode_message(data)
    except ProtocolError:
        pass


VALID = [encode_message(forward(), c) for c in COMPRESSIONS] + [
    encode_message(
        Message(
            MessageKind.STATE_HEADER,
            SWARM,
            1,
            7,
            {"stage": 1, "names": ["w", "b"], "shapes": [[4, 4], [4]], "total_bytes": 80, "checksum": "ab"},
        )
    )
]


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    decode_or_reject(data)
    decode_or_reject(VERSION_BYTE + data)


@FUZZ
@given(base=st.sampled_from(VALID), data=st.data())
def test_mutated_encodings_only_raise_protocol_error(base: bytes, data) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["truncate", "flip", "set", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "truncate":
            del buf[pos:]
        elif op == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            # 0xff/0xcf/0xdd etc. turn nearby bytes into huge lengths and counts
            buf[pos] = data.draw(st.sampled_from([0x00, 0xFF, 0xCF, 0xDD, 0xDF, 0xC6, 0xDB, 0x7F]))
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 8))]
    decode_or_reject(bytes(buf))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB


any_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16)
    | st.sampled_from([2**40, [2**40, 2**40], [2**64 - 1] * 8, -1, ""]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)
FIELD_PATHS = [
    ("kind",),
    ("swarm_id",),
    ("sender_stage",),
    ("request_id",),
    ("meta",),
    ("tensors",),
    ("meta", "hop"),
    ("meta", "path"),
    ("meta", "new"),
    ("tensors", "hidden"),
    ("tensors", "hidden", "shape"),
    ("tensors", "hidden", "data"),
    ("tensors", "hidden", "dtype"),
    ("tensors", "hidden", "codec"),
    ("tensors", "extra"),
]


@FUZZ
@given(path=st.sampled_from(FIELD_PATHS), value=any_values)
def test_fuzzed_fields_only_raise_protocol_error(path: tuple, value) -> None:
    decode_or_reject(raw_envelope(_set(path, value)(valid_body())))
