"""Text helpers of the dashboard: untrusted values made safe to print, numbers made short, cells.

Every value shown comes from peers we do not trust and may be missing, None or of the wrong type
in a snapshot from an older peer: each helper turns such a value into "-" instead of failing.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections.abc import Iterable
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dht.records import short_peer_id

_SPARK = "▁▂▃▄▅▆▇█"
_BAR_EIGHTHS = " ▏▎▍▌▋▊▉"
# control, format, surrogate, private-use, unassigned and line/paragraph separators: any of them
# can move the cursor, hide text or break the layout
_UNPRINTABLE_CATEGORIES = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def safe_text(value: Any, limit: int = 200) -> str:
    """A string from an untrusted peer made safe to print: no control characters or escapes."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else str(value)
    text = text[: limit * 2]
    out = []
    for ch in text:
        if unicodedata.category(ch) in _UNPRINTABLE_CATEGORIES:
            out.append(" " if ch in "\t\n\r" else "?")
        else:
            out.append(ch)
    text = "".join(out)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text or "-"


def as_float(value: Any) -> float | None:
    """A finite float, or None for missing/None/wrong-typed/NaN values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def as_int(value: Any) -> int | None:
    """An int (or an integral float), or None for anything else (bools included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def peer_id_text(peer_id: Any) -> str:
    """The short form of an untrusted peer id, safe to print; "-" unless it is a non-empty string."""
    return safe_text(short_peer_id(peer_id if isinstance(peer_id, str) and peer_id else None))


def human_count(value: Any, unit: str = "") -> str:
    """1234567 -> '1.2M'; None -> '-'."""
    v = as_float(value)
    if v is None:
        return "-"
    suffix = ""
    for s in ("k", "M", "B", "T"):
        if abs(v) < 1000:
            break
        v /= 1000.0
        suffix = s
    if abs(v) >= 1000:  # beyond T
        text = f"{v:.0f}{suffix}"
    elif suffix:
        text = f"{v:.1f}{suffix}" if abs(v) < 100 else f"{v:.0f}{suffix}"
    elif float(v).is_integer():
        text = f"{v:.0f}"
    else:
        text = f"{v:.2f}" if abs(v) < 1 else f"{v:.1f}"
    return text + (unit and f" {unit}")


def format_float(value: Any, digits: int = 3) -> str:
    v = as_float(value)
    if v is None:
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 10**-digits):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def format_int(value: Any) -> str:
    v = as_int(value)
    return "-" if v is None else str(v)


def format_age(seconds: float | None) -> str:
    """'12s ago', '3m ago', ...; a negative age (clock skew between peers) reads as 0s."""
    if seconds is None:
        return "-"
    if seconds < 0:
        seconds = 0.0
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def format_clock(timestamp: Any) -> str:
    """The local wall-clock time (HH:MM:SS) of a unix timestamp."""
    v = as_float(timestamp)
    if v is None or v <= 0:
        return "-"
    try:
        return time.strftime("%H:%M:%S", time.localtime(v))
    except (OverflowError, OSError, ValueError):
        return "-"


def sparkline(values: Iterable[float], width: int) -> str:
    """A unicode sparkline of the last `width` values, scaled between their min and max."""
    vals = [v for v in values if as_float(v) is not None][-max(width, 0) :] if width > 0 else []
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return _SPARK[3] * len(vals)
    top = len(_SPARK) - 1
    return "".join(_SPARK[min(top, max(0, round((v - lo) / (hi - lo) * top)))] for v in vals)


def bar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide, filled to `fraction` with eighth-cell resolution."""
    if width <= 0:
        return ""
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_BAR_EIGHTHS[part] if part and full < width else "")
    return text.ljust(width)


def _version_tuple(version: Any) -> tuple[int, ...] | None:
    if not isinstance(version, str):
        return None
    parts = re.findall(r"\d+", version)
    return tuple(int(p) for p in parts[:4]) if parts else None


def is_older_version(version: Any, reference: Any) -> bool:
    """True when both parse as versions and `version` sorts before `reference` (1.2 == 1.2.0)."""
    mine, ref = _version_tuple(version), _version_tuple(reference)
    if mine is None or ref is None:
        return False
    width = max(len(mine), len(ref))
    return mine + (0,) * (width - len(mine)) < ref + (0,) * (width - len(ref))


def cell(value: str, style: str = "") -> Text:
    """A table cell; a missing value ("-") is dimmed whatever its column's style."""
    return Text(value, style=style if value != "-" else "dim")


def titled_section(title: Text, table: Table) -> Group:
    """A section: a one-line title (cut, never wrapped, so its height is known) over a table."""
    title.no_wrap = True
    title.overflow = "ellipsis"
    return Group(title, table)
