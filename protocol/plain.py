"""Plain values for serialisers that accept only built-in types (hivemind's msgpack is strict)."""

from __future__ import annotations

from enum import Enum
from typing import Any


def plain_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """A `dataclasses.asdict` factory: enum members become their values."""
    return {key: value.value if isinstance(value, Enum) else value for key, value in items}
