"""`node dashboard`: a live, full-screen view of a swarm, rendered from snapshots.

A snapshot is a plain dict, the same shape as `node status --json` (see docs/dashboard.md); the
CLI supplies an async provider that builds one from the DHT. This module only renders and
interacts:

- `DashboardState` remembers what a live view needs between frames: the stage-0 loss history (for
  the sparkline), the previous snapshot, a merged and de-duplicated event list (the snapshot's own
  events plus join/leave/lost events derived by diffing consecutive snapshots), the peer-table
  sort key and filter, and the key-handling state machine.
- `render(state, width, height=None)` builds one frame; `render_once(snapshot, width)` renders a
  single frame as plain text (`node dashboard --once`).
- `run_live(provider, refresh)` runs the full-screen loop with non-blocking key input.

Everything shown comes from peers we do not trust: every string is sanitised (control characters,
terminal escapes) and rendered as `Text`, never as rich markup, and every field may be missing,
None or of the wrong type in a snapshot from an older peer; such values render as "-".
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import re
import signal
import sys
import time
import unicodedata
from dht.records import PeerState
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = [
    "SORT_KEYS",
    "DashboardState",
    "human_count",
    "iter_peers",
    "render",
    "render_once",
    "run_live",
    "short_id",
    "sparkline",
    "stage0_loss",
]

SORT_KEYS = ("stage", "throughput", "loss", "last seen")
LOSS_HISTORY = 120
MAX_EVENTS = 200
ONCE_EVENTS = 20  # events shown by render_once / when no height is given
# a derived event (join/leave/lost) and one reported by the swarm describe the same thing if they
# agree on kind, peer and stage and lie this close in time
SAME_EVENT_WINDOW = 60.0

WIDE = 100  # at or above: every peer column
NARROW = 60  # below: only id / stage / state / loss

_SPARK = "▁▂▃▄▅▆▇█"
_BAR_EIGHTHS = " ▏▎▍▌▋▊▉"

STATUS_MARKS: dict[str, tuple[str, str]] = {
    "ok": ("✓ ok", "green"),
    "single": ("! SINGLE PEER", "bold yellow"),
    "empty": ("✗ EMPTY", "bold red"),
    "lost": ("✗ LOST", "bold red"),
    "rebuilding": ("↻ REBUILDING", "bold yellow"),
    "unrecoverable": ("✗✗ UNRECOVERABLE", "bold white on red"),
}
STATE_STYLES = {PeerState.ONLINE: "green", PeerState.JOINING: "cyan", PeerState.LEAVING: "yellow", PeerState.REBUILDING: "magenta"}
EVENT_STYLES = {
    "join": "green",
    "leave": "yellow",
    "ban": "bold red",
    "rebuild": "magenta",
    "gossip_failure": "yellow",
    "lost": "bold red",
    "unrecoverable": "bold white on red",
    "move": "cyan",
}


# --------------------------------------------------------------------------- small helpers


def _clean(value: Any, limit: int = 200) -> str:
    """A string from an untrusted peer made safe to print: no control characters or escapes."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else str(value)
    text = text[: limit * 2]
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(" " if ch in "\t\n\r" else "?")
        else:
            out.append(ch)
    text = "".join(out)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text or "-"


def _num(value: Any) -> float | None:
    """A finite float, or None for missing/None/wrong-typed/NaN values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def short_id(peer_id: Any, n: int = 8) -> str:
    """The last n characters of a peer id (libp2p ids share their prefixes)."""
    if not isinstance(peer_id, str) or not peer_id:
        return "-"
    return _clean(peer_id[-n:], n)


def human_count(value: Any, unit: str = "") -> str:
    """1234567 -> '1.2M'; None -> '-'."""
    v = _num(value)
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


def _fmt_float(value: Any, digits: int = 3) -> str:
    v = _num(value)
    if v is None:
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def _fmt_int(value: Any) -> str:
    v = _int(value)
    return "-" if v is None else str(v)


def _ago(seconds: float | None) -> str:
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


def _clock(ts: Any) -> str:
    v = _num(ts)
    if v is None or v <= 0:
        return "-"
    try:
        return time.strftime("%H:%M:%S", time.localtime(v))
    except (OverflowError, OSError, ValueError):
        return "-"


def sparkline(values: Iterable[float], width: int) -> str:
    """A unicode sparkline of the last `width` values, scaled between their min and max."""
    vals = [v for v in values if _num(v) is not None][-max(width, 0):] if width > 0 else []
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return _SPARK[3] * len(vals)
    top = len(_SPARK) - 1
    return "".join(_SPARK[min(top, max(0, round((v - lo) / (hi - lo) * top)))] for v in vals)


def _bar(fraction: float, width: int) -> str:
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


def _older(version: Any, reference: Any) -> bool:
    mine, ref = _version_tuple(version), _version_tuple(reference)
    if mine is None or ref is None:
        return False
    width = max(len(mine), len(ref))
    return mine + (0,) * (width - len(mine)) < ref + (0,) * (width - len(ref))


def _peer_key(peer: dict) -> str | None:
    pid = peer.get("peer_id")
    if isinstance(pid, str) and pid:
        return pid
    name = peer.get("name")
    return f"name:{name}" if isinstance(name, str) and name else None


def iter_peers(snapshot: dict) -> Iterator[dict]:
    """Every peer record of a snapshot, with its `stage` filled from its stage entry if missing."""
    for entry in _list(_dict(snapshot).get("stages")):
        entry = _dict(entry)
        for peer in _list(entry.get("peers")):
            if not isinstance(peer, dict):
                continue
            if _int(peer.get("stage")) is None and _int(entry.get("stage")) is not None:
                peer = {**peer, "stage": entry["stage"]}
            yield peer


def stage0_loss(snapshot: dict) -> float | None:
    """Mean loss over the stage-0 peers that report one (stage 0 holds the head)."""
    losses = [
        v for p in iter_peers(snapshot) if _int(p.get("stage")) == 0 and (v := _num(p.get("loss"))) is not None
    ]
    return sum(losses) / len(losses) if losses else None


def _stage_status(entry: dict) -> str | None:
    status = entry.get("status")
    if isinstance(status, str) and status:
        return status
    peers = entry.get("peers")
    if isinstance(peers, list):
        return "empty" if not peers else "single" if len(peers) == 1 else "ok"
    return None


# --------------------------------------------------------------------------- state


class DashboardState:
    """What the live view remembers between frames."""

    def __init__(self, loss_history: int = LOSS_HISTORY, max_events: int = MAX_EVENTS) -> None:
        self.snapshot: dict | None = None
        self.previous: dict | None = None
        self.loss_history: list[float] = []
        self._loss_cap = loss_history
        self.events: list[dict] = []  # oldest first; `derived` marks events we inferred
        self._event_keys: set[tuple] = set()
        self._max_events = max_events
        self.sort_key: str = SORT_KEYS[0]
        self.filter_text: str = ""
        self.editing_filter: bool = False
        self.filter_buffer: str = ""
        self._filter_before: str = ""
        self.error: str | None = None  # last provider failure, shown as "reconnecting: ..."
        self.updated_at: float | None = None  # wall clock of the last good snapshot
        self.frames: int = 0

    # ---- snapshots

    def update(self, snapshot: dict) -> None:
        """Take a new snapshot: extend the loss history, merge and derive events."""
        if not isinstance(snapshot, dict):
            raise TypeError(f"snapshot must be a dict, got {type(snapshot).__name__}")
        self.previous, self.snapshot = self.snapshot, snapshot
        self.error = None
        self.updated_at = time.time()
        loss = stage0_loss(snapshot)
        if loss is not None:
            self.loss_history.append(loss)
            del self.loss_history[: -self._loss_cap]
        for event in _list(snapshot.get("events")):
            if isinstance(event, dict):
                self._add_event(event, derived=False)
        if self.previous is not None:
            for event in self._diff(self.previous, snapshot):
                self._add_event(event, derived=True)
        self.events.sort(key=lambda e: _num(e.get("time")) or 0.0)
        if len(self.events) > self._max_events:
            for old in self.events[: -self._max_events]:
                self._event_keys.discard(self._exact_key(old))
            del self.events[: -self._max_events]

    def set_error(self, reason: str) -> None:
        self.error = _clean(reason, 160)

    @property
    def now(self) -> float:
        """The time "ago" columns are measured from: the snapshot's own clock if it has one."""
        t = _num(_dict(self.snapshot).get("time"))
        return t if t is not None else time.time()

    @staticmethod
    def _exact_key(event: dict) -> tuple:
        t = _num(event.get("time"))
        return (
            None if t is None else round(t, 3),
            str(event.get("kind")),
            str(event.get("peer_id")),
            str(event.get("stage")),
            str(event.get("detail")),
        )

    def _similar(self, event: dict) -> dict | None:
        """An event already known that describes the same happening (kind, peer, stage, ~time)."""
        t = _num(event.get("time"))
        for known in reversed(self.events):
            if (
                known.get("kind") == event.get("kind")
                and known.get("peer_id") == event.get("peer_id")
                and _int(known.get("stage")) == _int(event.get("stage"))
            ):
                kt = _num(known.get("time"))
                if t is None or kt is None or abs(kt - t) <= SAME_EVENT_WINDOW:
                    return known
        return None

    def _add_event(self, event: dict, derived: bool) -> None:
        key = self._exact_key(event)
        if key in self._event_keys:
            return
        similar = self._similar(event)
        if derived and similar is not None and not similar.get("derived"):
            return  # the swarm already reported it (a peer that leaves twice is two events)
        if not derived and similar is not None and similar.get("derived"):
            # the swarm's own report of something we inferred: keep the report, it says more
            self.events.remove(similar)
            self._event_keys.discard(self._exact_key(similar))
        item = dict(event)
        if derived:
            item["derived"] = True
        self.events.append(item)
        self._event_keys.add(key)

    @staticmethod
    def _diff(old: dict, new: dict) -> list[dict]:
        now = _num(new.get("time"))
        if now is None:
            now = time.time()
        before = {k: p for p in iter_peers(old) if (k := _peer_key(p))}
        after = {k: p for p in iter_peers(new) if (k := _peer_key(p))}
        events: list[dict] = []
        for key, peer in after.items():
            name = _clean(peer.get("name"), 40)
            if key not in before:
                events.append(
                    {"time": now, "kind": "join", "peer_id": peer.get("peer_id"), "stage": _int(peer.get("stage")),
                     "detail": f"{name} appeared" if name != "-" else "appeared"}
                )
            else:
                s_old, s_new = _int(before[key].get("stage")), _int(peer.get("stage"))
                if s_old is not None and s_new is not None and s_old != s_new:
                    events.append(
                        {"time": now, "kind": "move", "peer_id": peer.get("peer_id"), "stage": s_new,
                         "detail": f"stage {s_old} -> {s_new}"}
                    )
        for key, peer in before.items():
            if key not in after:
                name = _clean(peer.get("name"), 40)
                events.append(
                    {"time": now, "kind": "leave", "peer_id": peer.get("peer_id"), "stage": _int(peer.get("stage")),
                     "detail": f"{name} disappeared" if name != "-" else "disappeared"}
                )
        old_status = {
            _int(_dict(e).get("stage")): _stage_status(_dict(e)) for e in _list(old.get("stages"))
        }
        for entry in _list(new.get("stages")):
            entry = _dict(entry)
            stage = _int(entry.get("stage"))
            if stage is None or stage not in old_status:
                continue
            was, now_status = old_status[stage], _stage_status(entry)
            if now_status in ("empty", "lost") and was not in ("empty", "lost"):
                events.append({"time": now, "kind": "lost", "peer_id": None, "stage": stage,
                               "detail": f"stage {stage} is {now_status} (was {was or '-'})"})
            elif now_status == "unrecoverable" and was != "unrecoverable":
                events.append({"time": now, "kind": "unrecoverable", "peer_id": None, "stage": stage,
                               "detail": f"stage {stage} is unrecoverable"})
        return events

    # ---- peer table: sort and filter

    def cycle_sort(self) -> str:
        """Next sort key of the peer table (stage, throughput, loss, last seen); returns it."""
        i = SORT_KEYS.index(self.sort_key) if self.sort_key in SORT_KEYS else -1
        self.sort_key = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        return self.sort_key

    def set_filter(self, text: str) -> None:
        """Show only peers whose id or name contains `text` (case-insensitive); a number, `sN`,
        `stage N` or `stage:N` shows the peers of that stage. Empty text clears the filter."""
        text = text.strip() if isinstance(text, str) else ""
        self.filter_text = _clean(text, 64) if text else ""

    def _matches(self, peer: dict) -> bool:
        text = self.filter_text.strip().lower()
        if not text:
            return True
        m = re.fullmatch(r"(?:s|stage)?\s*[:=]?\s*(\d+)", text)
        if m:
            return _int(peer.get("stage")) == int(m.group(1))
        pid = peer.get("peer_id") if isinstance(peer.get("peer_id"), str) else ""
        name = peer.get("name") if isinstance(peer.get("name"), str) else ""
        return text in pid.lower() or text in name.lower()

    def visible_peers(self) -> list[dict]:
        """The peers of the current snapshot, filtered and sorted for the peer table."""
        peers = [p for p in iter_peers(self.snapshot or {}) if self._matches(p)]
        big = float("inf")

        def stage_of(p: dict) -> int:
            s = _int(p.get("stage"))
            return s if s is not None else 1 << 30

        def ident(p: dict) -> str:
            return str(p.get("peer_id") or p.get("name") or "")

        if self.sort_key == "throughput":
            key = lambda p: (-(_num(p.get("throughput")) or 0.0), stage_of(p), ident(p))
        elif self.sort_key == "loss":
            key = lambda p: (l if (l := _num(p.get("loss"))) is not None else big, stage_of(p), ident(p))
        elif self.sort_key == "last seen":
            key = lambda p: (-(_num(p.get("updated")) or 0.0), stage_of(p), ident(p))
        else:
            key = lambda p: (stage_of(p), ident(p))
        return sorted(peers, key=key)

    # ---- keys

    def handle_key(self, key: str) -> bool:
        """Apply one key press; True means quit. Outside filter entry: q quit, s sort, / filter,
        c clear filter. In filter entry: printable characters edit (the filter applies as you
        type), Backspace deletes, Enter keeps it, Esc restores the previous filter."""
        if self.editing_filter:
            if key in ("\r", "\n"):
                self.editing_filter = False
                self.set_filter(self.filter_buffer)
            elif key == "\x1b":
                self.editing_filter = False
                self.set_filter(self._filter_before)
            elif key in ("\x7f", "\x08"):
                self.filter_buffer = self.filter_buffer[:-1]
                self.set_filter(self.filter_buffer)
            elif key == "\x15":  # Ctrl-U
                self.filter_buffer = ""
                self.set_filter("")
            elif key.isprintable() and len(self.filter_buffer) < 64:
                self.filter_buffer += key
                self.set_filter(self.filter_buffer)
            return False
        if key in ("q", "Q"):
            return True
        if key in ("s", "S"):
            self.cycle_sort()
        elif key == "/":
            self.editing_filter = True
            self._filter_before = self.filter_text
            self.filter_buffer = ""
        elif key in ("c", "C"):
            self.set_filter("")
        return False

    def feed(self, data: str) -> bool:
        """Apply a chunk read from the terminal; True means quit. Escape sequences (arrow keys
        and the like) are dropped whole."""
        if data.startswith("\x1b") and len(data) > 1:
            return False
        for ch in data:
            if self.handle_key(ch):
                return True
        return False


# --------------------------------------------------------------------------- rendering


def _titled(title: Text, table: Table) -> Group:
    """A section: a one-line title (cut, never wrapped, so its height is known) over a table."""
    title.no_wrap = True
    title.overflow = "ellipsis"
    return Group(title, table)


def _cell(value: str, style: str = "") -> Text:
    return Text(value, style=style if value != "-" else "dim")


def _header(state: DashboardState, width: int, compact: bool = False) -> RenderableType:
    snap = _dict(state.snapshot)
    peers = list(iter_peers(snap))
    online = sum(1 for p in peers if p.get("state") == PeerState.ONLINE)
    stages = _list(snap.get("stages"))
    stage_thr = [v for e in stages if (v := _num(_dict(e).get("throughput"))) is not None]
    peer_thr = [v for p in peers if (v := _num(p.get("throughput"))) is not None]
    total: float | None = sum(stage_thr) if stage_thr else sum(peer_thr) if peer_thr else None
    num_stages = _int(snap.get("num_stages"))
    if num_stages is None and stages:
        num_stages = len(stages)

    compact = compact or width < NARROW
    sep = Text(" · " if compact else "  ·  ", style="dim")
    params = snap.get("model_parameters")
    thr_text = human_count(total) if total is not None else "-"
    line1 = Text.assemble(
        ("" if compact else "swarm ", "dim"), (_clean(snap.get("swarm_id"), 48), "bold cyan"), sep,
        ("" if compact else "model ", "dim"),
        (human_count(params, "params") if _num(params) is not None else "- params", "bold"), sep,
        ("" if compact else "stages ", "dim"), (_fmt_int(num_stages), "bold"), (" stages" if compact else "", "dim"),
    )
    peers_line = Text.assemble(
        ("peers ", "dim"), (f"{online} online", "bold green" if online else "bold red"),
        (f" / {len(peers)}", "dim"), sep, ("thr " if compact else "throughput ", "dim"), (thr_text, "bold"),
    )
    if compact:
        lines_top = [line1, peers_line]
    else:
        line1.append_text(sep)
        line1.append_text(peers_line)
        lines_top = [line1]
    loss = stage0_loss(snap) if state.snapshot is not None else None
    floor = _num(snap.get("loss_floor"))
    spark_w = max(0, min(40, width - (40 if compact else 50)))
    spark = sparkline(state.loss_history, spark_w)
    line2 = Text.assemble(("loss " if compact else "stage-0 loss ", "dim"), (_fmt_float(loss), "bold magenta"))
    if spark:
        line2.append(" ")
        line2.append(spark, style="magenta")
    line2.append_text(sep)
    line2.append("floor ", style="dim")
    line2.append(_fmt_float(floor), style="bold" if floor is not None else "dim")
    if floor is not None and loss is not None and not compact:
        line2.append(f" (gap {loss - floor:+.3f})", style="dim")
    line3 = Text.assemble(
        ("config ", "dim"), (_clean(snap.get("config_hash"), 12)[:12], ""), sep,
        ("protocol ", "dim"), (_fmt_int(snap.get("protocol_version")), ""), sep,
        ("observer ", "dim"), (_clean(snap.get("software_version"), 24), ""), sep,
        ("snapshot ", "dim"), (_clock(snap.get("time")), ""),
    )
    lines: list[RenderableType] = [*lines_top, line2] + ([] if compact else [line3])
    if snap.get("unrecoverable"):
        lines.append(Text(f"✗✗ UNRECOVERABLE without a checkpoint: {_clean(snap.get('unrecoverable'))} "
                          "(stage-0 peers have paused training)", style="bold white on red"))
    if state.error is not None:
        age = "" if state.updated_at is None else f" (last data {_ago(time.time() - state.updated_at)})"
        lines.append(Text(f"⟳ reconnecting: {state.error}{age}", style="bold red"))
    elif state.snapshot is None:
        lines.append(Text("waiting for the first snapshot…", style="yellow"))
    return Panel(Group(*lines), title=Text("pipeswarm dashboard", style="bold"), title_align="left",
                 box=box.ROUNDED, padding=(0, 1))


def _stage_rows(snap: dict) -> list[tuple[int | None, dict | None]]:
    entries = [_dict(e) for e in _list(snap.get("stages"))]
    by_stage: dict[int, dict] = {}
    extra: list[dict] = []
    for e in entries:
        s = _int(e.get("stage"))
        if s is None or s in by_stage:
            extra.append(e)
        else:
            by_stage[s] = e
    num = _int(snap.get("num_stages"))
    indices = set(by_stage)
    if num is not None and 0 < num <= 1024:
        indices |= set(range(num))
    rows: list[tuple[int | None, dict | None]] = [(s, by_stage.get(s)) for s in sorted(indices)]
    rows += [(None, e) for e in extra]
    return rows


def _stage_map(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    """One row per stage; with `max_rows`, troubled stages are kept first and the cut is shown."""
    snap = _dict(state.snapshot)
    rows = []
    for stage, entry in _stage_rows(snap):
        thr = _num(_dict(entry).get("throughput"))
        if thr is None and entry is not None:
            ps = [v for p in _list(entry.get("peers")) if (v := _num(_dict(p).get("throughput"))) is not None]
            thr = sum(ps) if ps else None
        rows.append((stage, entry, thr, _stage_status(entry) if entry is not None else None))
    top = max([r[2] for r in rows if r[2] is not None] or [0.0])
    hidden_ok = hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        keep_n = max(max_rows - 1, 1)
        order = sorted(range(len(rows)), key=lambda i: (rows[i][3] == "ok", i))
        keep = set(order[:keep_n])
        hidden = len(rows) - len(keep)
        hidden_ok = sum(1 for i in range(len(rows)) if i not in keep and rows[i][3] == "ok")
        rows = [r for i, r in enumerate(rows) if i in keep]
    narrow = width < NARROW
    show_bar = width >= 45
    bar_w = max(3, min(40, width - (60 if not narrow else 40)))

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False, padding=(0, 1))
    table.add_column("st" if narrow else "stage", justify="right", no_wrap=True)
    table.add_column("n" if narrow else "peers", justify="right", no_wrap=True)
    if show_bar:
        table.add_column("thr" if narrow else "throughput", no_wrap=True, overflow="crop")
    table.add_column("thr" if not show_bar else "", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True, overflow="ellipsis")
    if not rows:
        table.add_row(Text("-", style="dim"), "-", *([""] if show_bar else []), "-",
                      Text("no stages reported", style="dim"))
    for stage, entry, thr, status in rows:
        if entry is None:
            table.add_row(str(stage), Text("-", style="dim"), *([Text("")] if show_bar else []),
                          Text("-", style="dim"), Text("? no report", style="dim"))
            continue
        peers = entry.get("peers")
        count = str(len(peers)) if isinstance(peers, list) else "-"
        mark, style = STATUS_MARKS.get(status or "", (_clean(status, 20) if status else "-", "dim"))
        if narrow and status in STATUS_MARKS:
            mark = mark.split(" ", 1)[-1]
        frac = (thr / top) if thr is not None and top > 0 else 0.0
        bar_style = "green" if status == "ok" else "yellow" if status in ("single", "rebuilding") else "red"
        cells = [_fmt_int(stage if stage is not None else entry.get("stage")), count]
        if show_bar:
            cells.append(Text(_bar(frac, bar_w), style=bar_style))
        table.add_row(*cells, _cell(human_count(thr)), Text(mark, style=style))
    section = _titled(Text("stages", style="bold"), table)
    if hidden:
        section.renderables.append(Text(f"… {hidden} more stages ({hidden_ok} ok)", style="dim", no_wrap=True,
                                        overflow="ellipsis"))
    return section


def _peer_columns(width: int) -> list[str]:
    if width < NARROW:
        return ["id", "stage", "state", "loss"]
    if width < WIDE:
        return ["id", "name", "stage", "state", "thr", "inner", "outer", "loss"]
    return ["id", "name", "stage", "state", "thr", "inner", "outer", "partner", "div", "loss", "version", "seen"]


_COLUMN_SPECS: dict[str, tuple[str, str]] = {
    # key: (header, justify)
    "id": ("peer", "left"),
    "name": ("name", "left"),
    "stage": ("stage", "right"),
    "state": ("state", "left"),
    "thr": ("thr", "right"),
    "inner": ("inner", "right"),
    "outer": ("outer", "right"),
    "partner": ("partner", "left"),
    "div": ("diverg", "right"),
    "loss": ("loss", "right"),
    "version": ("version", "left"),
    "seen": ("seen", "right"),
}


def _peer_cells(peer: dict, columns: list[str], now: float, software_version: Any) -> list[Text]:
    cells: list[Text] = []
    for col in columns:
        if col == "id":
            cells.append(_cell(short_id(peer.get("peer_id")), "bold"))
        elif col == "name":
            cells.append(_cell(_clean(peer.get("name"), 40) if peer.get("name") else "-"))
        elif col == "stage":
            cells.append(_cell(_fmt_int(peer.get("stage"))))
        elif col == "state":
            st = peer.get("state")
            text = _clean(st, 12) if isinstance(st, str) and st else "-"
            cells.append(_cell(text, STATE_STYLES.get(text, "")))
        elif col == "thr":
            cells.append(_cell(human_count(peer.get("throughput"))))
        elif col == "inner":
            cells.append(_cell(_fmt_int(peer.get("inner_step"))))
        elif col == "outer":
            cells.append(_cell(_fmt_int(peer.get("outer_round"))))
        elif col == "partner":
            cells.append(_cell(short_id(peer.get("last_partner"))))
        elif col == "div":
            cells.append(_cell(_fmt_float(peer.get("divergence"), 4)))
        elif col == "loss":
            cells.append(_cell(_fmt_float(peer.get("loss")), "magenta"))
        elif col == "version":
            v = peer.get("version")
            text = Text(_clean(v, 16) if isinstance(v, str) and v else "-",
                        style="" if isinstance(v, str) and v else "dim")
            if _older(v, software_version):
                text.append("*", style="bold yellow")
            cells.append(text)
        elif col == "seen":
            upd = _num(peer.get("updated"))
            cells.append(_cell(_ago(now - upd) if upd is not None and upd > 0 else "-"))
    return cells


# the optional peer columns, in the order they are given up when the terminal is too narrow
DROP_ORDER = ("version", "div", "partner", "seen", "inner", "outer", "thr", "name")


def _peer_headers(state: DashboardState, columns: list[str]) -> list[str]:
    headers = []
    for col in columns:
        header = _COLUMN_SPECS[col][0]
        if col == state_sort_column(state.sort_key):
            header += "▼" if state.sort_key in ("throughput", "last seen") else "▲"
        headers.append(header)
    return headers


_MIN_WIDTH = {"id": 8}
_MAX_WIDTH = {"name": 20}


def _peer_grid(state: DashboardState, columns: list[str], rows: list[list[Text]]) -> Table:
    """The peer table from precomputed cells (`rows` hold one cell per column of `columns`)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    for col, header in zip(columns, _peer_headers(state, columns)):
        table.add_column(
            header, justify=_COLUMN_SPECS[col][1], no_wrap=True, overflow="ellipsis",  # type: ignore[arg-type]
            min_width=_MIN_WIDTH.get(col), max_width=_MAX_WIDTH.get(col),
        )
    for row in rows:
        table.add_row(*row)
    if not rows:
        msg = "no peer matches the filter" if state.filter_text else "no peers"
        table.add_row(Text(msg, style="dim"), *[""] * (len(columns) - 1))
    return table


def _grid_width(state: DashboardState, columns: list[str], widths: dict[str, int]) -> int:
    """The natural width of the peer grid: widest cell per column (cells are single lines),
    within the column's min/max, plus three cells between columns."""
    total = 0
    for col, header in zip(columns, _peer_headers(state, columns)):
        w = max(widths.get(col, 0), cell_len(header), _MIN_WIDTH.get(col, 0))
        total += min(w, _MAX_WIDTH.get(col, w))
    return total + 3 * (len(columns) - 1)  # padding 1 + the box's blank divider + padding 1


def _peer_table(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    """The peer table; with `max_rows`, at most that many lines of rows (the last one becomes
    "… N more" when peers are cut)."""
    snap = _dict(state.snapshot)
    peers = state.visible_peers()
    total = sum(1 for _ in iter_peers(snap))
    title = Text("peers", style="bold")
    title.append(f"  sort: {state.sort_key}", style="dim")
    if state.filter_text:
        title.append("  filter: ", style="dim")
        title.append(state.filter_text, style="bold yellow")
        title.append(f" ({len(peers)}/{total})", style="dim")
    shown, hidden = peers, 0
    if max_rows is not None and len(peers) > max_rows:
        keep = max(max_rows - 1, 0)
        shown, hidden = peers[:keep], len(peers) - keep
    columns = _peer_columns(width)
    now, software_version = state.now, snap.get("software_version")
    cells = [dict(zip(columns, _peer_cells(p, columns, now, software_version))) for p in shown]
    widths = {col: max((row[col].cell_len for row in cells), default=0) for col in columns}
    for col in DROP_ORDER:  # give up optional columns until the rest fits without cutting
        if _grid_width(state, columns, widths) <= width:
            break
        if col in columns:
            columns = [c for c in columns if c != col]
    table = _peer_grid(state, columns, [[row[col] for col in columns] for row in cells])
    section = _titled(title, table)
    if hidden:
        section.renderables.append(Text(f"… {hidden} more (/ to filter)", style="dim", no_wrap=True,
                                        overflow="ellipsis"))
    return section


def state_sort_column(sort_key: str) -> str:
    return {"stage": "stage", "throughput": "thr", "loss": "loss", "last seen": "seen"}.get(sort_key, "")


def _events_table(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    events = list(reversed(state.events))  # newest first
    limit = ONCE_EVENTS if max_rows is None else max_rows
    shown = events[: max(limit, 0)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    narrow = width < NARROW
    table.add_column("time", no_wrap=True, min_width=8)
    table.add_column("kind", no_wrap=True, overflow="ellipsis", max_width=10 if narrow else 14)
    tiny = width < 45
    if not tiny:
        table.add_column("st" if narrow else "stage", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("peer", no_wrap=True, min_width=8)
    table.add_column("detail", no_wrap=True, overflow="ellipsis")
    for ev in shown:
        kind = _clean(ev.get("kind"), 20) if ev.get("kind") else "-"
        row = [_cell(_clock(ev.get("time"))), _cell(kind, EVENT_STYLES.get(kind, ""))]
        if not tiny:
            row.append(_cell(_fmt_int(ev.get("stage"))))
        if not narrow:
            row.append(_cell(short_id(ev.get("peer_id"))))
        detail = _cell(_clean(ev.get("detail"), 200) if ev.get("detail") else "-")
        row.append(detail)
        table.add_row(*row)
    if not shown:
        table.add_row(Text("-", style="dim"), Text("no events yet", style="dim"), *[""] * (len(table.columns) - 2))
    title = Text.assemble(("events", "bold"), (f"  newest first, {len(events)} kept", "dim"))
    return _titled(title, table)


def _footer(state: DashboardState, width: int) -> Text:
    if state.editing_filter:
        return Text.assemble(
            ("filter: ", "bold yellow"), (state.filter_buffer, "bold"), ("▌", "blink"),
            ("   Enter keep  Esc cancel  (id, name, or a stage number)", "dim"),
        )
    keys = [("q", "quit"), ("s", "sort"), ("/", "filter"), ("c", "clear filter")]
    text = Text()
    for i, (k, what) in enumerate(keys):
        if i:
            text.append("  ")
        text.append(k, style="bold reverse")
        text.append(f" {what}")
    return text


def _measure(renderable: RenderableType, width: int) -> int:
    console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    return len(console.render_lines(renderable, console.options.update(width=width), pad=False))


def render(state: DashboardState, width: int, height: int | None = None) -> RenderableType:
    """One frame. With `height` (the live view) the peer table and the events pane are cut to fit
    the screen (the cut is shown as "… N more"); without it everything is shown (20 newest events)."""
    width = max(int(width), 20)
    state.frames += 1
    header = _header(state, width, compact=height is not None and height < 20)
    footer = _footer(state, width)
    if height is None:
        return Group(header, _stage_map(state, width), Text(""), _peer_table(state, width), Text(""),
                     _events_table(state, width), footer)
    height = max(int(height), 1)
    header_h, footer_h = _measure(header, width), _measure(footer, width)
    stage_map = _stage_map(state, width, max_rows=max(height // 4, 3))
    stage_h = _measure(stage_map, width)
    peer_overhead = _measure(_peer_table(state, width, max_rows=0), width) - 1  # minus the "…" line
    event_overhead = _measure(_events_table(state, width, max_rows=0), width) - 1  # minus "no events"
    n_peers = max(len(state.visible_peers()), 1)
    n_events = max(len(state.events), 1)
    room = height - header_h - stage_h - footer_h
    if room >= peer_overhead + event_overhead + 1 + 1:
        spacers = room >= peer_overhead + event_overhead + 2 + 2 + 2
        room -= 2 if spacers else 0
        # events get a third of the room (or what they need), peers the rest
        event_rows = min(n_events, max(room // 3 - event_overhead, 1 if room < 12 else 2))
        peer_rows = max(room - event_overhead - event_rows - peer_overhead, 1)
        if n_peers < peer_rows:  # give what peers do not need back to the events
            event_rows += peer_rows - n_peers
            peer_rows = n_peers
        event_rows = max(min(event_rows, n_events), 1)
        gap = [Text("")] if spacers else []
        return Group(header, stage_map, *gap, _peer_table(state, width, max_rows=peer_rows), *gap,
                     _events_table(state, width, max_rows=event_rows), footer)
    # a short screen: no events pane; the peers if they fit, else at least the stage map
    parts: list[RenderableType] = [header]
    if room >= peer_overhead + 2:
        parts.append(stage_map)
        if room >= peer_overhead + 3:
            parts.append(Text(""))
            room -= 1
        parts.append(_peer_table(state, width, max_rows=room - peer_overhead))
    else:
        avail = height - header_h - footer_h
        parts.append(stage_map if stage_h <= avail else _stage_map(state, width, max_rows=max(avail - 3, 1)))
    parts.append(footer)
    return Group(*parts)


def render_once(snapshot: dict, width: int) -> str:
    """One frame of `snapshot` as plain text (`node dashboard --once`)."""
    state = DashboardState()
    state.update(snapshot)
    width = max(int(width), 20)
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(render(state, width))
    return console.export_text()


# --------------------------------------------------------------------------- live loop


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Put the terminal in cbreak mode (keys arrive one by one, Ctrl-C still interrupts) and
    restore it on the way out, whatever happens."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _stdin_tty_fd() -> int | None:
    try:
        stream = sys.stdin
        if stream is None or not stream.isatty():
            return None
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return None


async def run_live(
    provider: Callable[[], Awaitable[dict]],
    refresh: float = 1.5,
    console: Console | None = None,
    *,
    timeout: float | None = None,
) -> int:
    """The full-screen dashboard. Every `refresh` seconds awaits `provider()` for a snapshot (a
    failure or a call slower than `timeout`, default max(10, 5 * refresh), shows "reconnecting:
    <reason>" in the header and is retried next period). Returns 0 when the user presses q; runs
    until cancelled otherwise (CancelledError propagates). The terminal is restored on every exit.
    Keys are read only when stdin is a TTY."""
    console = console or Console()
    refresh = max(float(refresh), 0.05)
    call_timeout = timeout if timeout is not None else max(10.0, 5.0 * refresh)
    state = DashboardState()
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    quit_requested = asyncio.Event()

    async def fetch_forever() -> None:
        while True:
            started = loop.time()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                async with asyncio.timeout(call_timeout):
                    snapshot = await provider()
                state.update(snapshot)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                state.set_error(f"no snapshot within {call_timeout:g}s")
            except Exception as exc:  # noqa: BLE001 - any provider failure is shown, never raised
                state.set_error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            wake.set()
            await asyncio.sleep(max(refresh - (loop.time() - started), 0.05))

    def on_keys(fd: int) -> None:
        try:
            data = os.read(fd, 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            loop.remove_reader(fd)
            return
        if not data:  # EOF on the terminal: stop reading, keep running
            loop.remove_reader(fd)
            return
        if state.feed(data.decode("utf-8", errors="ignore")):
            quit_requested.set()
        wake.set()

    def frame() -> RenderableType:
        size = console.size
        try:
            return render(state, size.width, size.height)
        except Exception as exc:  # noqa: BLE001 - a snapshot we failed to foresee: say so, keep running
            return Panel(Text(f"cannot render this snapshot: {type(exc).__name__}: {_clean(str(exc), 200)}\n"
                              "q quits", style="bold red"), title="pipeswarm dashboard")

    fd = _stdin_tty_fd()
    fetcher: asyncio.Task | None = None
    with contextlib.ExitStack() as stack:
        if fd is not None:
            stack.enter_context(_cbreak(fd))
        live = stack.enter_context(
            Live(frame(), console=console, screen=True, auto_refresh=False, transient=False)
        )
        if fd is not None:
            loop.add_reader(fd, on_keys, fd)
            stack.callback(loop.remove_reader, fd)
        with contextlib.suppress(AttributeError, NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGWINCH, wake.set)  # redraw at once on resize
            stack.callback(loop.remove_signal_handler, signal.SIGWINCH)
        fetcher = asyncio.ensure_future(fetch_forever())
        try:
            while not quit_requested.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(refresh):
                        await wake.wait()
                wake.clear()
                if fetcher.done() and not fetcher.cancelled() and fetcher.exception() is not None:
                    # cannot happen (fetch_forever catches everything) but never die silently
                    state.set_error(repr(fetcher.exception()))
                    fetcher = asyncio.ensure_future(fetch_forever())
                live.update(frame(), refresh=True)
            return 0
        finally:
            fetcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await fetcher
