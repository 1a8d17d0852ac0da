"""pipeswarm wire protocol: versioned msgpack messages, a tensor codec and length-prefixed frames."""

from protocol import subspace
from protocol.errors import ProtocolError
from protocol.framing import (
    FRAME_HEADER_BYTES,
    FrameSplitter,
    frame_header,
    frame_length,
    open_message,
    read_frame,
    recv_message,
    seal_message,
    send_message,
    write_frame,
    write_frame_now,
)
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    ANCHOR_IDS,
    KIND_SCHEMAS,
    KIND_TENSORS,
    POSTED_KEY,
    Message,
    MessageKind,
    MetaValue,
    decode_message,
    encode_message,
)
from protocol.microbatch_header import (
    PURPOSE_KEY,
    BackwardHeader,
    ForwardHeader,
    MicrobatchHeader,
    MicrobatchPurpose,
    purpose_of,
)
from protocol.tensors import COMPRESSIONS, DTYPES, Compression, decode_tensor, encode_tensor, wire_nbytes
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "ANCHOR_IDS",
    "COMPRESSIONS",
    "DEFAULT_LIMITS",
    "DTYPES",
    "FRAME_HEADER_BYTES",
    "KIND_SCHEMAS",
    "KIND_TENSORS",
    "POSTED_KEY",
    "PROTOCOL_VERSION",
    "PURPOSE_KEY",
    "BackwardHeader",
    "Compression",
    "ForwardHeader",
    "FrameSplitter",
    "Limits",
    "Message",
    "MessageKind",
    "MetaValue",
    "MicrobatchHeader",
    "MicrobatchPurpose",
    "ProtocolError",
    "decode_message",
    "decode_tensor",
    "encode_message",
    "encode_tensor",
    "frame_header",
    "frame_length",
    "open_message",
    "purpose_of",
    "read_frame",
    "recv_message",
    "seal_message",
    "send_message",
    "subspace",
    "wire_nbytes",
    "write_frame",
    "write_frame_now",
]
