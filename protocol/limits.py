"""Size limits every decoder checks before it allocates; a peer that exceeds them is rejected."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = 256 * MiB
    # bytes of one decoded tensor in its original dtype, i.e. what we actually allocate
    max_tensor_bytes: int = 256 * MiB
    max_tensor_dims: int = 8
    max_tensors: int = 16
    # UTF-8 bytes of any string (swarm id, names, meta keys and values) and of a meta bytes value
    max_string_bytes: int = 1024
    max_list_items: int = 1024
    max_meta_entries: int = 64
    # Every list/map and every item in them, summed over one message: msgpack turns a 1-byte empty
    # array into a ~56-byte Python list, so without a total a legal-sized frame could cost 50x RAM.
    max_total_items: int = 1 << 16


DEFAULT_LIMITS = Limits()
