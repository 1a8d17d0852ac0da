"""Reading a snapshot (the dict `node status --json` prints) without trusting its shape: a snapshot
from an older or hostile peer may miss any field or hold the wrong type in it."""

from __future__ import annotations

from collections.abc import Iterator

from node.monitor.dashboard.text import as_dict, as_float, as_int, as_list
from node.monitor.status import StageStatus


def iter_peers(snapshot: dict) -> Iterator[dict]:
    """Every peer record of a snapshot, with its `stage` filled from its stage entry if missing."""
    for entry in as_list(as_dict(snapshot).get("stages")):
        entry = as_dict(entry)
        for peer in as_list(entry.get("peers")):
            if not isinstance(peer, dict):
                continue
            if as_int(peer.get("stage")) is None and as_int(entry.get("stage")) is not None:
                peer = {**peer, "stage": entry["stage"]}
            yield peer


def peer_identity(peer: dict) -> str | None:
    """What tells one peer from another across snapshots: its id, else its name, else nothing."""
    peer_id = peer.get("peer_id")
    if isinstance(peer_id, str) and peer_id:
        return peer_id
    name = peer.get("name")
    return f"name:{name}" if isinstance(name, str) and name else None


def stage0_loss(snapshot: dict, key: str = "loss") -> float | None:
    """Mean training loss (or, with key "val_loss", held-out loss) over the stage-0 peers that
    report one (stage 0 holds the head)."""
    losses = [
        v for p in iter_peers(snapshot) if as_int(p.get("stage")) == 0 and (v := as_float(p.get(key))) is not None
    ]
    return sum(losses) / len(losses) if losses else None


def stage_entry_status(entry: dict) -> StageStatus | str | None:
    """The status a stage entry reports (a string we do not know is kept, to be shown as is), or
    one guessed from its peer count when an older snapshot has none."""
    status = entry.get("status")
    if isinstance(status, str) and status:
        try:
            return StageStatus(status)
        except ValueError:
            return status
    peers = entry.get("peers")
    if isinstance(peers, list):
        return StageStatus.EMPTY if not peers else StageStatus.SINGLE if len(peers) == 1 else StageStatus.OK
    return None
