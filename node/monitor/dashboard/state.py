"""What the live view remembers between frames, and how keys change it."""

from __future__ import annotations

import math
import re
import time
from enum import StrEnum

from node.monitor.dashboard.events import EventLog, derive_events
from node.monitor.dashboard.snapshot_fields import iter_peers, stage0_loss
from node.monitor.dashboard.text import as_dict, as_float, as_int, as_list, safe_text

LOSS_HISTORY = 120
MAX_EVENTS = 200
MAX_FILTER_CHARS = 64


class PeerSortKey(StrEnum):
    """The peer table's sort orders, in the order the `s` key cycles through them."""

    STAGE = "stage"
    THROUGHPUT = "throughput"  # highest first
    LOSS = "loss"  # lowest first, peers without one last
    LAST_SEEN = "last seen"  # most recent first


SORT_KEYS = tuple(PeerSortKey)


# ties (and peers without the sorted field) fall back to stage order, then to a stable identity
def _stage_of(peer: dict) -> int:
    stage = as_int(peer.get("stage"))
    return stage if stage is not None else 1 << 30


def _identity(peer: dict) -> str:
    return str(peer.get("peer_id") or peer.get("name") or "")


def _by_stage(peer: dict) -> tuple:
    return _stage_of(peer), _identity(peer)


def _by_throughput(peer: dict) -> tuple:
    return -(as_float(peer.get("throughput")) or 0.0), _stage_of(peer), _identity(peer)


def _by_loss(peer: dict) -> tuple:
    loss = as_float(peer.get("loss"))
    return loss if loss is not None else math.inf, _stage_of(peer), _identity(peer)


def _by_last_seen(peer: dict) -> tuple:
    return -(as_float(peer.get("updated")) or 0.0), _stage_of(peer), _identity(peer)


_SORT_ORDERS = {
    PeerSortKey.STAGE: _by_stage,
    PeerSortKey.THROUGHPUT: _by_throughput,
    PeerSortKey.LOSS: _by_loss,
    PeerSortKey.LAST_SEEN: _by_last_seen,
}


class DashboardState:
    """The latest snapshot and what the live view keeps across snapshots: the stage-0 loss history
    (for the sparkline), the merged events, the peer-table sort and filter, the filter being typed."""

    def __init__(self, loss_history: int = LOSS_HISTORY, max_events: int = MAX_EVENTS) -> None:
        self.snapshot: dict | None = None
        self.previous_snapshot: dict | None = None
        self.loss_history: list[float] = []
        self._loss_cap = loss_history
        self.event_log = EventLog(max_events)
        self.sort_key: PeerSortKey = PeerSortKey.STAGE
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
        self.previous_snapshot, self.snapshot = self.snapshot, snapshot
        self.error = None
        self.updated_at = time.time()
        loss = stage0_loss(snapshot)
        if loss is not None:
            self.loss_history.append(loss)
            del self.loss_history[: -self._loss_cap]
        for event in as_list(snapshot.get("events")):
            if isinstance(event, dict):
                self.event_log.add(event, derived=False)
        if self.previous_snapshot is not None:
            for event in derive_events(self.previous_snapshot, snapshot):
                self.event_log.add(event, derived=True)
        self.event_log.settle()

    @property
    def events(self) -> list[dict]:
        """The merged events, oldest first."""
        return self.event_log.events

    def set_error(self, reason: str) -> None:
        self.error = safe_text(reason, 160)

    @property
    def now(self) -> float:
        """The time "ago" columns are measured from: the snapshot's own clock if it has one."""
        t = as_float(as_dict(self.snapshot).get("time"))
        return t if t is not None else time.time()

    # ---- peer table: sort and filter

    def cycle_sort(self) -> PeerSortKey:
        """Next sort key of the peer table (stage, throughput, loss, last seen); returns it."""
        i = SORT_KEYS.index(self.sort_key) if self.sort_key in SORT_KEYS else -1
        self.sort_key = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        return self.sort_key

    def set_filter(self, text: str) -> None:
        """Show only peers whose id or name contains `text` (case-insensitive); a number, `sN`,
        `stage N` or `stage:N` shows the peers of that stage. Empty text clears the filter."""
        text = text.strip() if isinstance(text, str) else ""
        self.filter_text = safe_text(text, MAX_FILTER_CHARS) if text else ""

    def _matches(self, peer: dict) -> bool:
        text = self.filter_text.strip().lower()
        if not text:
            return True
        stage_filter = re.fullmatch(r"(?:s|stage)?\s*[:=]?\s*(\d+)", text)
        if stage_filter:
            return as_int(peer.get("stage")) == int(stage_filter.group(1))
        peer_id = peer.get("peer_id") if isinstance(peer.get("peer_id"), str) else ""
        name = peer.get("name") if isinstance(peer.get("name"), str) else ""
        return text in peer_id.lower() or text in name.lower()

    def visible_peers(self) -> list[dict]:
        """The peers of the current snapshot, filtered and sorted for the peer table."""
        peers = [p for p in iter_peers(self.snapshot or {}) if self._matches(p)]
        return sorted(peers, key=_SORT_ORDERS.get(self.sort_key, _by_stage))

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
            elif key.isprintable() and len(self.filter_buffer) < MAX_FILTER_CHARS:
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
