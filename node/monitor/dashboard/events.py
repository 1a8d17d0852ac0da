"""The events pane's data: events the swarm reports merged with events the dashboard derives by
comparing consecutive snapshots, de-duplicated and capped."""

from __future__ import annotations

import time
from enum import StrEnum

from dht.records import EventKind
from node.monitor.dashboard.snapshot_fields import iter_peers, peer_identity, stage_entry_status
from node.monitor.dashboard.text import as_dict, as_float, as_int, as_list, safe_text
from node.monitor.status import StageStatus

# a derived event and one reported by the swarm describe the same thing if they agree on kind,
# peer and stage and lie this close in time
SAME_EVENT_WINDOW = 60.0

_GONE = (StageStatus.EMPTY, StageStatus.LOST)


class DerivedEventKind(StrEnum):
    """Changes only the dashboard sees, by comparing consecutive snapshots. A stage that becomes
    lost or unrecoverable is derived too, under the swarm's own `EventKind` so that the swarm's
    report of it replaces ours."""

    JOIN = "join"  # a peer appeared
    LEAVE = "leave"  # a peer disappeared
    MOVE = "move"  # a peer now serves another stage


# every kind the events pane knows; a reported kind outside it (from a newer peer) is shown as is
DisplayedEventKind = DerivedEventKind | EventKind


def derive_events(previous: dict, current: dict) -> list[dict]:
    """The joins, leaves, stage moves and newly lost stages between two snapshots, timed at the
    current snapshot's clock."""
    now = as_float(current.get("time"))
    if now is None:
        now = time.time()
    before = {k: p for p in iter_peers(previous) if (k := peer_identity(p))}
    after = {k: p for p in iter_peers(current) if (k := peer_identity(p))}
    events: list[dict] = []
    for key, peer in after.items():
        name = safe_text(peer.get("name"), 40)
        if key not in before:
            events.append(
                {
                    "time": now,
                    "kind": DerivedEventKind.JOIN,
                    "peer_id": peer.get("peer_id"),
                    "stage": as_int(peer.get("stage")),
                    "detail": f"{name} appeared" if name != "-" else "appeared",
                }
            )
        else:
            old_stage, new_stage = as_int(before[key].get("stage")), as_int(peer.get("stage"))
            if old_stage is not None and new_stage is not None and old_stage != new_stage:
                events.append(
                    {
                        "time": now,
                        "kind": DerivedEventKind.MOVE,
                        "peer_id": peer.get("peer_id"),
                        "stage": new_stage,
                        "detail": f"stage {old_stage} -> {new_stage}",
                    }
                )
    for key, peer in before.items():
        if key not in after:
            name = safe_text(peer.get("name"), 40)
            events.append(
                {
                    "time": now,
                    "kind": DerivedEventKind.LEAVE,
                    "peer_id": peer.get("peer_id"),
                    "stage": as_int(peer.get("stage")),
                    "detail": f"{name} disappeared" if name != "-" else "disappeared",
                }
            )
    old_status = {
        as_int(as_dict(e).get("stage")): stage_entry_status(as_dict(e)) for e in as_list(previous.get("stages"))
    }
    for entry in as_list(current.get("stages")):
        entry = as_dict(entry)
        stage = as_int(entry.get("stage"))
        if stage is None or stage not in old_status:
            continue
        was, status = old_status[stage], stage_entry_status(entry)
        if status in _GONE and was not in _GONE:
            events.append(
                {
                    "time": now,
                    "kind": EventKind.LOST,
                    "peer_id": None,
                    "stage": stage,
                    "detail": f"stage {stage} is {status} (was {was or '-'})",
                }
            )
        elif status == StageStatus.UNRECOVERABLE and was != StageStatus.UNRECOVERABLE:
            events.append(
                {
                    "time": now,
                    "kind": EventKind.UNRECOVERABLE,
                    "peer_id": None,
                    "stage": stage,
                    "detail": f"stage {stage} is unrecoverable",
                }
            )
    return events


class EventLog:
    """The merged events, oldest first; an event we derived carries `"derived": True`."""

    def __init__(self, max_events: int) -> None:
        self.events: list[dict] = []
        self._exact_keys: set[tuple] = set()
        self._max_events = max_events

    @staticmethod
    def _exact_key(event: dict) -> tuple:
        t = as_float(event.get("time"))
        return (
            None if t is None else round(t, 3),
            str(event.get("kind")),
            str(event.get("peer_id")),
            str(event.get("stage")),
            str(event.get("detail")),
        )

    def _similar(self, event: dict) -> dict | None:
        """An event already known that describes the same happening (kind, peer, stage, ~time)."""
        t = as_float(event.get("time"))
        for known in reversed(self.events):
            if (
                known.get("kind") == event.get("kind")
                and known.get("peer_id") == event.get("peer_id")
                and as_int(known.get("stage")) == as_int(event.get("stage"))
            ):
                known_time = as_float(known.get("time"))
                if t is None or known_time is None or abs(known_time - t) <= SAME_EVENT_WINDOW:
                    return known
        return None

    def add(self, event: dict, derived: bool) -> None:
        """Keep `event` unless it is already known. Call `settle()` after a batch of additions."""
        key = self._exact_key(event)
        if key in self._exact_keys:
            return  # every snapshot repeats the swarm's recent events
        similar = self._similar(event)
        if derived and similar is not None and not similar.get("derived"):
            return  # the swarm already reported it (a peer that leaves twice is two events)
        if not derived and similar is not None and similar.get("derived"):
            # the swarm's own report of something we inferred: keep the report, it says more
            self.events.remove(similar)
            self._exact_keys.discard(self._exact_key(similar))
        item = dict(event)
        if derived:
            item["derived"] = True
        self.events.append(item)
        self._exact_keys.add(key)

    def settle(self) -> None:
        """Order the events by time and drop the oldest beyond the cap."""
        self.events.sort(key=lambda e: as_float(e.get("time")) or 0.0)
        if len(self.events) > self._max_events:
            for old in self.events[: -self._max_events]:
                self._exact_keys.discard(self._exact_key(old))
            del self.events[: -self._max_events]
