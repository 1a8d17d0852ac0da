"""What a request service accepts, declared once per service and checked by the transport before
its handler runs (node/p2p/dispatch.py).

The protocol already checks every message against its kind's schema (protocol/messages.py:
KIND_SCHEMAS, the required keys and their types). What it cannot know is which kinds a *service*
takes (a FORWARD service handed a PING, an ABORT service handed anything but an ERROR notice), nor
the meta keys a service reads beyond its kind's schema (a microbatch's token, its purpose). A
handler that reads those unchecked fails on a stranger's message with a KeyError or a TypeError:
each service's contract names them here, so its handler reads only what was checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol import Message, MessageKind, ProtocolError

MAX_UINT64 = (1 << 64) - 1


class FieldRule(Protocol):
    def problem(self, value: Any) -> str | None:
        """Why `value` is not acceptable, or None when it is."""
        ...


@dataclass(frozen=True)
class Token:
    """A secret a peer echoes back (a microbatch's token): printable ASCII, at most `max_chars`.
    ASCII because tokens are compared in constant time, which takes bytes or ASCII strings only;
    empty is allowed, and matches nothing (what a peer echoes for a hop that came without one)."""

    max_chars: int = 64

    def problem(self, value: Any) -> str | None:
        if type(value) is not str or len(value) > self.max_chars:
            return f"a string of at most {self.max_chars} characters"
        if not (value.isascii() and value.isprintable()):
            return "printable ASCII"
        return None


@dataclass(frozen=True)
class Count:
    """An integer in [low, high] (a bool is not one)."""

    low: int = 0
    high: int = MAX_UINT64

    def problem(self, value: Any) -> str | None:
        if type(value) is not int or not self.low <= value <= self.high:
            return f"an integer in [{self.low}, {self.high}]"
        return None


@dataclass(frozen=True)
class Text:
    """A string of at most `max_chars` characters (shown or looked up, never parsed)."""

    max_chars: int

    def problem(self, value: Any) -> str | None:
        if type(value) is not str or len(value) > self.max_chars:
            return f"a string of at most {self.max_chars} characters"
        return None


@dataclass(frozen=True)
class RequestContract:
    """The kinds a service takes and the meta keys its handler reads beyond its kind's schema:
    `required` ones must be there, `optional` ones are checked when present."""

    kinds: frozenset[MessageKind]
    required: Mapping[str, FieldRule] = field(default_factory=dict)
    optional: Mapping[str, FieldRule] = field(default_factory=dict)

    def check(self, request: Message) -> None:
        """Raise ProtocolError, naming what is wrong, when `request` breaks this contract."""
        if request.kind not in self.kinds:
            expected = ", ".join(sorted(kind.value for kind in self.kinds))
            raise ProtocolError(f"expected {expected}, got {str(request.kind)[:32]}")
        meta = request.meta
        for key, rule in self.required.items():
            if key not in meta:
                raise ProtocolError(f"meta {key!r} is missing")
            _check_field(key, meta[key], rule)
        for key, rule in self.optional.items():
            if key in meta:
                _check_field(key, meta[key], rule)


def _check_field(key: str, value: Any, rule: FieldRule) -> None:
    wanted = rule.problem(value)
    if wanted is not None:
        raise ProtocolError(f"meta {key!r} must be {wanted}, got {type(value).__name__}")
