"""The peer table: which columns fit the terminal, and one row of cells per visible peer."""

from __future__ import annotations

from collections import Counter
from enum import StrEnum
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from dht.records import LinkPath, PeerState, Reachability
from node.monitor.dashboard.snapshot_fields import iter_peers
from node.monitor.dashboard.state import DashboardState, PeerSortKey
from node.monitor.dashboard.text import (
    as_dict,
    as_float,
    cell,
    format_age,
    format_float,
    format_int,
    human_count,
    is_older_version,
    peer_id_text,
    safe_text,
    titled_section,
)

WIDE = 100  # at or above: every peer column
NARROW = 60  # below: only id / stage / state / loss


class PeerColumn(StrEnum):
    PEER_ID = "id"
    NAME = "name"
    STAGE = "stage"
    STATE = "state"
    REACHABILITY = "reach"  # public, or through a relay (behind a NAT); links to NAT'ed peers: punched, relayed, failed
    THROUGHPUT = "thr"
    INNER_STEP = "inner"
    OUTER_ROUND = "outer"
    PARTNER = "partner"  # last gossip partner
    DIVERGENCE = "div"
    STRIKES = "strikes"  # spot-check strikes others hold against the peer, and how many banned it
    LOSS = "loss"
    VAL_LOSS = "val"  # stage 0: held-out loss
    VERSION = "version"
    LAST_SEEN = "seen"


C = PeerColumn
NARROW_COLUMNS = [C.PEER_ID, C.STAGE, C.STATE, C.LOSS]
MEDIUM_COLUMNS = [C.PEER_ID, C.NAME, C.STAGE, C.STATE, C.THROUGHPUT, C.INNER_STEP, C.OUTER_ROUND, C.LOSS, C.VAL_LOSS]
WIDE_COLUMNS = list(PeerColumn)
# the optional columns, in the order they are given up when the terminal is too narrow
DROP_ORDER = (
    C.VERSION,
    C.STRIKES,
    C.REACHABILITY,
    C.DIVERGENCE,
    C.PARTNER,
    C.LAST_SEEN,
    C.INNER_STEP,
    C.OUTER_ROUND,
    C.VAL_LOSS,
    C.THROUGHPUT,
    C.NAME,
)

HEADERS = {
    C.PEER_ID: "peer",
    C.NAME: "name",
    C.STAGE: "stage",
    C.STATE: "state",
    C.REACHABILITY: "reach",
    C.THROUGHPUT: "thr",
    C.INNER_STEP: "inner",
    C.OUTER_ROUND: "outer",
    C.PARTNER: "partner",
    C.DIVERGENCE: "diverg",
    C.STRIKES: "strikes",
    C.LOSS: "loss",
    C.VAL_LOSS: "val",
    C.VERSION: "version",
    C.LAST_SEEN: "seen",
}
NUMERIC_COLUMNS = {C.STAGE, C.THROUGHPUT, C.INNER_STEP, C.OUTER_ROUND, C.DIVERGENCE, C.LOSS, C.VAL_LOSS, C.LAST_SEEN}
SORTED_COLUMN = {
    PeerSortKey.STAGE: C.STAGE,
    PeerSortKey.THROUGHPUT: C.THROUGHPUT,
    PeerSortKey.LOSS: C.LOSS,
    PeerSortKey.LAST_SEEN: C.LAST_SEEN,
}
DESCENDING = {PeerSortKey.THROUGHPUT, PeerSortKey.LAST_SEEN}
MIN_WIDTH = {C.PEER_ID: 8}
MAX_WIDTH = {C.NAME: 20}

STATE_STYLES = {
    PeerState.ONLINE: "green",
    PeerState.JOINING: "cyan",
    PeerState.LEAVING: "yellow",
    PeerState.REBUILDING: "magenta",
}


def peer_columns(width: int) -> list[PeerColumn]:
    if width < NARROW:
        return list(NARROW_COLUMNS)
    if width < WIDE:
        return list(MEDIUM_COLUMNS)
    return list(WIDE_COLUMNS)


def peer_cells(peer: dict, columns: list[PeerColumn], now: float, software_version: Any) -> list[Text]:
    """One cell per column; `now` dates "last seen", `software_version` (the observer's) flags older peers."""
    cells: list[Text] = []
    for col in columns:
        if col == C.PEER_ID:
            cells.append(cell(peer_id_text(peer.get("peer_id")), "bold"))
        elif col == C.NAME:
            cells.append(cell(safe_text(peer.get("name"), 40) if peer.get("name") else "-"))
        elif col == C.STAGE:
            cells.append(cell(format_int(peer.get("stage"))))
        elif col == C.STATE:
            state = peer.get("state")
            text = safe_text(state, 12) if isinstance(state, str) and state else "-"
            cells.append(cell(text, STATE_STYLES.get(text, "")))
        elif col == C.REACHABILITY:
            reach = peer.get("reachability")
            text = safe_text(reach, 8) if isinstance(reach, str) and reach else "-"
            cells.append(cell(text + paths_text(peer.get("paths")), "yellow" if text == Reachability.RELAYED else ""))
        elif col == C.THROUGHPUT:
            cells.append(cell(human_count(peer.get("throughput"))))
        elif col == C.INNER_STEP:
            cells.append(cell(format_int(peer.get("inner_step"))))
        elif col == C.OUTER_ROUND:
            cells.append(cell(format_int(peer.get("outer_round"))))
        elif col == C.PARTNER:
            cells.append(cell(peer_id_text(peer.get("last_partner"))))
        elif col == C.DIVERGENCE:
            cells.append(cell(format_float(peer.get("divergence"), 4)))
        elif col == C.STRIKES:
            cells.append(strikes_cell(peer))
        elif col == C.LOSS:
            cells.append(cell(format_float(peer.get("loss")), "magenta"))
        elif col == C.VAL_LOSS:
            cells.append(cell(format_float(peer.get("val_loss")), "magenta"))
        elif col == C.VERSION:
            version = peer.get("version")
            known = isinstance(version, str) and bool(version)
            text = Text(safe_text(version, 16) if known else "-", style="" if known else "dim")
            if is_older_version(version, software_version):
                text.append("*", style="bold yellow")
            cells.append(text)
        elif col == C.LAST_SEEN:
            updated = as_float(peer.get("updated"))
            cells.append(cell(format_age(now - updated) if updated is not None and updated > 0 else "-"))
    return cells


def strikes_cell(peer: dict) -> Text:
    """ "-" for a peer nobody suspects; else its strikes, and "ban xN" in red when N peers banned it."""
    strikes, banned_by = as_float(peer.get("strikes")) or 0.0, as_float(peer.get("banned_by")) or 0.0
    if strikes <= 0 and banned_by <= 0:
        return cell("-")
    text = Text(f"{strikes:.1f}", style="yellow")
    if banned_by > 0:
        text.append(f" ban x{int(banned_by)}", style="bold red")
    return text


def _headers(state: DashboardState, columns: list[PeerColumn]) -> list[str]:
    """Column headers; the sorted column carries ▲ or ▼."""
    headers = []
    for col in columns:
        header = HEADERS[col]
        if col == SORTED_COLUMN.get(state.sort_key):
            header += "▼" if state.sort_key in DESCENDING else "▲"
        headers.append(header)
    return headers


def _grid(state: DashboardState, columns: list[PeerColumn], rows: list[list[Text]]) -> Table:
    """The peer table from precomputed cells (`rows` hold one cell per column of `columns`)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    for col, header in zip(columns, _headers(state, columns)):
        table.add_column(
            header,
            justify="right" if col in NUMERIC_COLUMNS else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width=MIN_WIDTH.get(col),
            max_width=MAX_WIDTH.get(col),
        )
    for row in rows:
        table.add_row(*row)
    if not rows:
        message = "no peer matches the filter" if state.filter_text else "no peers"
        table.add_row(Text(message, style="dim"), *[""] * (len(columns) - 1))
    return table


def _grid_width(state: DashboardState, columns: list[PeerColumn], widths: dict[PeerColumn, int]) -> int:
    """The natural width of the peer grid: widest cell per column (cells are single lines),
    within the column's min/max, plus three cells between columns."""
    total = 0
    for col, header in zip(columns, _headers(state, columns)):
        w = max(widths.get(col, 0), cell_len(header), MIN_WIDTH.get(col, 0))
        total += min(w, MAX_WIDTH.get(col, w))
    return total + 3 * (len(columns) - 1)  # padding 1 + the box's blank divider + padding 1


def peer_table(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    """The peer table; with `max_rows`, at most that many lines of rows (the last one becomes
    "… N more" when peers are cut)."""
    snapshot = as_dict(state.snapshot)
    peers = state.visible_peers()
    total = sum(1 for _ in iter_peers(snapshot))
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
    columns = peer_columns(width)
    now, software_version = state.now, snapshot.get("software_version")
    rows = [dict(zip(columns, peer_cells(p, columns, now, software_version))) for p in shown]
    widths = {col: max((row[col].cell_len for row in rows), default=0) for col in columns}
    for col in DROP_ORDER:  # give up optional columns until the rest fits without cutting
        if _grid_width(state, columns, widths) <= width:
            break
        if col in columns:
            columns = [c for c in columns if c != col]
    table = _grid(state, columns, [[row[col] for col in columns] for row in rows])
    section = titled_section(title, table)
    if hidden:
        section.renderables.append(
            Text(f"… {hidden} more (/ to filter)", style="dim", no_wrap=True, overflow="ellipsis")
        )
    return section


def paths_text(paths: object) -> str:
    """How a peer's links to peers behind NATs went (its record's `paths`): " 2p 1r 1!" is two
    hole-punched, one relayed, one failed; "" when it has none."""
    if not isinstance(paths, dict):
        return ""
    counts = Counter(path for path in paths.values() if isinstance(path, str))
    marks = ((LinkPath.PUNCHED, "p"), (LinkPath.RELAYED, "r"), (LinkPath.FAILED, "!"))
    return "".join(f" {counts[path.value]}{mark}" for path, mark in marks if counts[path.value])
