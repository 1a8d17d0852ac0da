"""The message envelope: a msgpack protocol version, then a msgpack map with the message itself.

The version is a separate leading msgpack integer so that a node can name the version of a peer
whose envelope layout it does not understand, instead of failing on some field deep inside it.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.tensors import COMPRESSIONS, decode_tensor, encode_tensor
from protocol.version import PROTOCOL_VERSION

MetaValue = None | bool | int | float | str | bytes | list["MetaValue"]


class MessageKind(enum.StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    ACK = "ack"
    ERROR = "error"
    BUSY = "busy"
    PING = "ping"
    PONG = "pong"
    GOSSIP_REQUEST = "gossip_request"
    GOSSIP_ACCEPT = "gossip_accept"
    GOSSIP_CHUNK = "gossip_chunk"
    GOSSIP_DONE = "gossip_done"
    STATE_REQUEST = "state_request"
    STATE_HEADER = "state_header"
    STATE_CHUNK = "state_chunk"
    STATE_END = "state_end"
    # spot-checks of a block stage's computation (node/pipeline/verifier.py, docs/verification.md)
    CHECK = "check"  # the checker names a microbatch it saw pass through the replica
    AUDIT = "audit"  # a stage mate sends an input of its own
    COMMITMENT = "commitment"  # the replica's digests of what it computed, before a layer is chosen
    OPEN = "open"  # the checker names the layer to show
    OPENING = "opening"  # that layer's weights and boundaries, bit-exact
    # a stage-0 peer fetching the swarm's prepared data (node/server/data_service.py, docs/operations.md)
    DATA_REQUEST = "data_request"  # the manifest of `manifest`, or one of its shards by sha256
    DATA_REPLY = "data_reply"  # its bytes, as a uint8 tensor "data"


# Required meta keys per kind. Extra keys are allowed (still type- and size-checked). Every int in
# a required value must be >= 0: none of them (ids, hops, offsets, sizes, stages) can be negative,
# and rejecting it here spares each handler from indexing with a hostile negative number.
KIND_SCHEMAS: dict[MessageKind, dict[str, Any]] = {
    MessageKind.FORWARD: {"microbatch_id": int, "origin": str, "path": list[str], "order": list[int], "hop": int},
    MessageKind.BACKWARD: {"microbatch_id": int, "path": list[str], "hop": int},
    MessageKind.ACK: {},
    MessageKind.ERROR: {"reason": str},
    MessageKind.BUSY: {},
    MessageKind.PING: {},
    MessageKind.PONG: {},
    MessageKind.GOSSIP_REQUEST: {"round": int, "num_tensors": int, "total_numel": int, "phi_seed": int},
    MessageKind.GOSSIP_ACCEPT: {"round": int},
    MessageKind.GOSSIP_CHUNK: {"round": int, "index": int, "offset": int},
    MessageKind.GOSSIP_DONE: {"round": int},
    MessageKind.STATE_REQUEST: {"stage": int},
    MessageKind.STATE_HEADER: {
        "stage": int,
        "names": list[str],
        "shapes": list[list[int]],
        "total_bytes": int,
        "checksum": str,
    },
    MessageKind.STATE_CHUNK: {"index": int, "offset": int},
    MessageKind.STATE_END: {"checksum": str},
    MessageKind.CHECK: {"stage": int, "origin": str, "microbatch_id": int, "token": str},
    MessageKind.AUDIT: {"stage": int},
    MessageKind.COMMITMENT: {
        "stage": int,
        "commitment": int,
        "precision": str,
        "weights": list[str],
        "forward": list[str],
        "backward": list[str],
    },
    MessageKind.OPEN: {"stage": int, "commitment": int, "layer": int, "forward": list[int], "backward": list[int]},
    MessageKind.OPENING: {"stage": int, "commitment": int},
    MessageKind.DATA_REQUEST: {"manifest": str},
    MessageKind.DATA_REPLY: {},
}

# A request whose meta holds POSTED_KEY: True is *posted*: its receiver replies only to refuse it
# (BUSY, ERROR) and says nothing when it takes it, so a pipeline hop costs one frame instead of a
# request and an ACK (node/p2p/channels.py). A receiver that does not know the key ACKs as before.
POSTED_KEY = "posted"

# Required tensor names per kind; other names are allowed up to max_tensors (FORWARD may carry an
# optional "targets" for the last stage).
KIND_TENSORS: dict[MessageKind, frozenset[str]] = {kind: frozenset() for kind in MessageKind}
KIND_TENSORS.update(
    {
        MessageKind.FORWARD: frozenset({"hidden"}),
        MessageKind.BACKWARD: frozenset({"grad"}),
        MessageKind.AUDIT: frozenset({"hidden", "probe"}),
        MessageKind.OPENING: frozenset({"weights"}),
        MessageKind.GOSSIP_CHUNK: frozenset({"chunk"}),
        MessageKind.STATE_CHUNK: frozenset({"chunk"}),
        MessageKind.DATA_REPLY: frozenset({"data"}),
    }
)

# a hop's token ids, when it carries them: the anchors of its hidden states in a subspace codec
ANCHOR_IDS = "tokens"
# -1 is "no stage yet" (e.g. a joiner asking for state); real stages are 0..2**31-1
MIN_STAGE, MAX_STAGE = -1, (1 << 31) - 1
MAX_REQUEST_ID = (1 << 64) - 1
MAX_VERSION = (1 << 32) - 1
# meta lists may hold lists (STATE_HEADER shapes) but nothing deeper
_MAX_META_DEPTH = 2
_ENVELOPE_KEYS = frozenset({"kind", "swarm_id", "sender_stage", "request_id", "meta", "tensors"})


@dataclass
class Message:
    kind: MessageKind
    swarm_id: str
    sender_stage: int
    request_id: int
    meta: dict[str, MetaValue] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION

    def with_meta(self, meta: dict[str, MetaValue]) -> Message:
        """This message with another meta, the tensors shared (field by field: dataclasses.replace
        inspects the class on every call, and a posted pipeline hop makes one)."""
        return Message(self.kind, self.swarm_id, self.sender_stage, self.request_id, meta, self.tensors, self.version)


def encode_message(msg: Message, compression: str = "none", *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Validate msg as a receiver with `limits` would, then encode it; raises ProtocolError.

    Validating on the way out turns a bug in our own code into a local error with a stack trace
    instead of a peer silently dropping us.
    """
    if not isinstance(msg, Message):
        raise ProtocolError(f"expected a Message, got {type(msg).__name__}")
    if not _is_int(msg.version) or not 0 <= msg.version <= MAX_VERSION:
        raise ProtocolError(f"version must be an int in [0, {MAX_VERSION}], got {msg.version!r}")
    if compression not in COMPRESSIONS:
        raise ProtocolError(f"unknown compression {compression!r} (expected one of {COMPRESSIONS})")
    kind = _check_kind(msg.kind)
    _check_header(msg.swarm_id, msg.sender_stage, msg.request_id, limits)
    _check_meta(msg.meta, kind, limits)
    _check_tensor_names(msg.tensors, kind, limits)
    for name, t in msg.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ProtocolError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.numel() * t.element_size() > limits.max_tensor_bytes:
            raise ProtocolError(
                f"tensor {name!r} has {t.numel() * t.element_size()} bytes > max_tensor_bytes {limits.max_tensor_bytes}"
            )
    body = {
        "kind": kind,  # a StrEnum member packs as its value
        "swarm_id": msg.swarm_id,
        "sender_stage": msg.sender_stage,
        "request_id": msg.request_id,
        "meta": msg.meta,
        "tensors": {
            name: encode_tensor(t, compression, anchor_ids=_anchor_ids(msg.tensors, t))
            for name, t in msg.tensors.items()
        },
    }
    packer = msgpack.Packer(autoreset=False, use_bin_type=True, strict_types=False)
    try:
        packer.pack(msg.version)
        packer.pack(body)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from e
    return packer.bytes()


def decode_message(
    data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, expected_swarm: str | None = None
) -> Message:
    """Decode and fully validate one message; any malformed input raises ProtocolError.

    Order: buffer type -> version prefix -> msgpack with per-object and total size limits ->
    envelope keys and header fields -> swarm id -> kind -> meta and its schema -> tensor names ->
    each tensor (its sizes checked before its allocation).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ProtocolError("message buffer must be contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) > limits.max_frame_bytes:
        raise ProtocolError(f"message of {len(view)} bytes > max_frame_bytes {limits.max_frame_bytes}")
    version, offset = _read_version(view)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})")

    body = _unpack(view[offset:], limits)
    if not isinstance(body, dict) or body.keys() != _ENVELOPE_KEYS:
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise ProtocolError(f"envelope must be a map with keys {sorted(_ENVELOPE_KEYS)}, got {keys}")
    swarm_id = body["swarm_id"]
    _check_header(swarm_id, body["sender_stage"], body["request_id"], limits)
    if expected_swarm is not None and swarm_id != expected_swarm:
        raise ProtocolError(f"message for swarm {swarm_id!r}, this node is in swarm {expected_swarm!r}")
    kind = _check_kind(body["kind"])
    meta, encoded = body["meta"], body["tensors"]
    _check_meta(meta, kind, limits)
    _check_tensor_names(encoded, kind, limits)
    tensors = {}
    # anchored tensors last: they need the message's token ids decoded first
    for name, obj in sorted(
        encoded.items(), key=lambda item: isinstance(item[1], dict) and item[1].get("anchored") is True
    ):
        try:
            tensors[name] = decode_tensor(obj, limits, anchor_ids=tensors.get(ANCHOR_IDS))
        except ProtocolError as e:
            raise ProtocolError(f"tensor {name!r}: {e}") from None
    return Message(kind, swarm_id, body["sender_stage"], body["request_id"], meta, tensors, version)


def _anchor_ids(tensors: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor | None:
    """The message's token ids when they name `t`'s rows (a hop's hidden states): a subspace codec
    then sends the rows relative to the tokens' anchors (protocol/subspace.py)."""
    ids = tensors.get(ANCHOR_IDS)
    if ids is None or ids is t or ids.is_floating_point() or not t.is_floating_point():
        return None
    return ids if tuple(ids.shape) == tuple(t.shape[:-1]) else None


def _read_version(view: memoryview) -> tuple[int, int]:
    """Parse the leading msgpack unsigned int by hand: no msgpack state, no allocation."""
    if len(view) == 0:
        raise ProtocolError("empty message")
    first = view[0]
    if first <= 0x7F:  # positive fixint
        return first, 1
    widths = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    width = widths.get(first)
    if width is None:
        raise ProtocolError("message does not start with a protocol version")
    if len(view) < 1 + width:
        raise ProtocolError("message truncated inside its protocol version")
    return int.from_bytes(view[1 : 1 + width], "big"), 1 + width


def _unpack(view: memoryview, limits: Limits) -> Any:
    total = 0

    def count(container: Any) -> Any:
        # called bottom-up as msgpack finishes each list/map, so we stop soon after the budget
        nonlocal total
        total += len(container) + 1
        if total > limits.max_total_items:
            raise ProtocolError(f"message holds more than max_total_items {limits.max_total_items} items")
        return container

    def no_ext(code: int, data: bytes) -> Any:
        raise ProtocolError(f"msgpack extension type {code} not allowed")

    try:
        return msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            use_list=True,
            list_hook=count,
            object_hook=count,
            ext_hook=no_ext,
            max_str_len=limits.max_string_bytes,
            max_bin_len=limits.max_tensor_bytes,
            max_array_len=max(limits.max_list_items, limits.max_tensor_dims),
            max_map_len=max(limits.max_meta_entries, limits.max_tensors, len(_ENVELOPE_KEYS)),
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"malformed msgpack: {e}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bytes_over(value: str | bytes, limit: int) -> bool:
    """Whether `value` takes more than `limit` bytes (a string in UTF-8); a code point takes at most 4,
    so a short string (every id and name on the hop path) needs no encoding to tell."""
    if isinstance(value, bytes):
        return len(value) > limit
    return len(value) * 4 > limit and len(value.encode("utf-8", "surrogatepass")) > limit


def _check_string(value: Any, what: str, limits: Limits) -> None:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{what} must be a non-empty string, got {value!r:.80}")
    if _bytes_over(value, limits.max_string_bytes):
        raise ProtocolError(f"{what} is longer than max_string_bytes {limits.max_string_bytes}")


def _check_header(swarm_id: Any, sender_stage: Any, request_id: Any, limits: Limits) -> None:
    if (  # every message's header: the usual case in one test, anything else through the checks below
        type(swarm_id) is str
        and 0 < len(swarm_id) <= limits.max_string_bytes // 4
        and type(sender_stage) is int
        and MIN_STAGE <= sender_stage <= MAX_STAGE
        and type(request_id) is int
        and 0 <= request_id <= MAX_REQUEST_ID
    ):
        return
    _check_string(swarm_id, "swarm_id", limits)
    if not _is_int(sender_stage) or not MIN_STAGE <= sender_stage <= MAX_STAGE:
        raise ProtocolError(f"sender_stage must be an int in [{MIN_STAGE}, {MAX_STAGE}], got {sender_stage!r:.80}")
    if not _is_int(request_id) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError(f"request_id must be an unsigned 64-bit int, got {request_id!r:.80}")


_KIND_OF_VALUE = {kind.value: kind for kind in MessageKind}


def _check_kind(value: Any) -> MessageKind:
    if type(value) is MessageKind:  # what our own messages carry
        return value
    kind = _KIND_OF_VALUE.get(value) if type(value) is str else None
    if kind is not None:  # a plain string, as decoded: a lookup instead of the enum's constructor
        return kind
    try:
        return MessageKind(value)
    except (ValueError, TypeError):
        raise ProtocolError(f"unknown message kind {value!r:.80}") from None


def _check_meta(meta: Any, kind: MessageKind, limits: Limits) -> None:
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta must be a map, got {type(meta).__name__}")
    if len(meta) > limits.max_meta_entries:
        raise ProtocolError(f"meta has {len(meta)} entries > max_meta_entries {limits.max_meta_entries}")
    # a string of at most this many code points fits in max_string_bytes whatever its UTF-8 length
    short = limits.max_string_bytes // 4
    for key, value in meta.items():
        # every hop carries about eight entries, each a short key with an int or a short string:
        # those pass here without a call each; anything else gets the full checks (and their errors)
        if type(key) is str and 0 < len(key) <= short:
            value_type = type(value)
            if (value_type is int and -(1 << 63) <= value < (1 << 64)) or (value_type is str and len(value) <= short):
                continue
        _check_string(key, "meta key", limits)
        _check_meta_value(value, key, limits, depth=0)
    for key, spec in KIND_SCHEMAS[kind].items():
        if key not in meta:
            raise ProtocolError(f"{kind.value} message is missing meta key {key!r}")
        value = meta[key]
        if (spec is int and type(value) is int and value >= 0) or (spec is str and type(value) is str):
            continue
        if not _matches(value, spec):
            raise ProtocolError(
                f"{kind.value} meta {key!r} must be {_spec_name(spec)} (ints >= 0), got {meta[key]!r:.80}"
            )


def _check_meta_value(value: Any, key: str, limits: Limits, depth: int) -> None:
    if value is None or isinstance(value, (bool, int, float)):
        if _is_int(value) and not -(1 << 63) <= value < (1 << 64):
            raise ProtocolError(f"meta {key!r} int out of 64-bit range")
        return
    if isinstance(value, (str, bytes)):
        if _bytes_over(value, limits.max_string_bytes):
            raise ProtocolError(f"meta {key!r} value is longer than max_string_bytes {limits.max_string_bytes}")
        return
    if isinstance(value, list):
        if depth >= _MAX_META_DEPTH:
            raise ProtocolError(f"meta {key!r} nests lists deeper than {_MAX_META_DEPTH}")
        if len(value) > limits.max_list_items:
            raise ProtocolError(f"meta {key!r} has {len(value)} items > max_list_items {limits.max_list_items}")
        # every hop carries a path of peer ids and a stage order: short strings and small ints, told
        # valid in one pass without a call per item
        if all(type(item) is str and len(item) * 4 <= limits.max_string_bytes for item in value):
            return
        if all(type(item) is int and 0 <= item < (1 << 63) for item in value):
            return
        for item in value:
            _check_meta_value(item, key, limits, depth + 1)
        return
    raise ProtocolError(f"meta {key!r} has unsupported type {type(value).__name__}")


def _matches(value: Any, spec: Any) -> bool:
    if isinstance(spec, types.GenericAlias):  # list[X]
        if not isinstance(value, list):
            return False
        item_spec = spec.__args__[0]
        # the hop path's lists (peer ids, a stage order) in one pass without a call per item; a
        # subclass (an enum) takes the general way
        if (item_spec is str or item_spec is int) and all(type(item) is item_spec for item in value):
            return item_spec is str or all(item >= 0 for item in value)
        return all(_matches(item, item_spec) for item in value)
    if spec is int:
        return _is_int(value) and value >= 0
    if spec is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, spec)


def _spec_name(spec: Any) -> str:
    return str(spec) if isinstance(spec, types.GenericAlias) else spec.__name__


def _check_tensor_names(tensors: Any, kind: MessageKind, limits: Limits) -> None:
    if not isinstance(tensors, dict):
        raise ProtocolError(f"tensors must be a map, got {type(tensors).__name__}")
    if len(tensors) > limits.max_tensors:
        raise ProtocolError(f"message has {len(tensors)} tensors > max_tensors {limits.max_tensors}")
    short = limits.max_string_bytes // 4
    for name in tensors:
        if not (type(name) is str and 0 < len(name) <= short):
            _check_string(name, "tensor name", limits)
    missing = KIND_TENSORS[kind] - tensors.keys()
    if missing:
        raise ProtocolError(f"{kind.value} message is missing tensor(s) {sorted(missing)}")
