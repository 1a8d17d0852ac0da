"""One frame of the dashboard: header, stage map, peer table, events pane and footer, laid out to
fit the terminal. Untrusted strings are always rendered as `Text`, never as rich markup."""

from __future__ import annotations

import io
import time

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dht.records import EventKind, PeerState
from node.model.memory import format_bytes
from node.monitor.dashboard.events import DerivedEventKind, DisplayedEventKind
from node.monitor.dashboard.peer_table import NARROW, peer_table
from node.monitor.dashboard.snapshot_fields import iter_peers, stage0_loss, stage_entry_status
from node.monitor.dashboard.state import DashboardState
from node.monitor.dashboard.text import (
    as_dict,
    as_float,
    as_int,
    as_list,
    bar,
    cell,
    format_age,
    format_clock,
    format_float,
    format_int,
    human_count,
    peer_id_text,
    safe_text,
    sparkline,
    titled_section,
)
from node.monitor.status import StageStatus

ONCE_EVENTS = 20  # events shown by render_once / when no height is given
COMPACT_HEIGHT = 20  # below: the header drops its config line
TINY = 45  # below: no stage column in the events pane, no bar in the stage map
WITH_SIZES = 72  # from here: the stage map shows parameters and memory per peer

STATUS_MARKS: dict[StageStatus, tuple[str, str]] = {
    StageStatus.OK: ("✓ ok", "green"),
    StageStatus.SINGLE: ("! SINGLE PEER", "bold yellow"),
    StageStatus.EMPTY: ("✗ EMPTY", "bold red"),
    StageStatus.LOST: ("✗ LOST", "bold red"),
    StageStatus.REBUILDING: ("↻ REBUILDING", "bold yellow"),
    StageStatus.UNRECOVERABLE: ("✗✗ UNRECOVERABLE", "bold white on red"),
}
EVENT_STYLES: dict[DisplayedEventKind, str] = {
    DerivedEventKind.JOIN: "green",
    DerivedEventKind.LEAVE: "yellow",
    DerivedEventKind.MOVE: "cyan",
    EventKind.BAN: "bold red",
    EventKind.REBUILD: "magenta",
    EventKind.GOSSIP_FAILURE: "yellow",
    EventKind.VERIFICATION: "bold red",
    EventKind.LOST: "bold red",
    EventKind.UNRECOVERABLE: "bold white on red",
}


def _header(state: DashboardState, width: int, compact: bool = False) -> RenderableType:
    snapshot = as_dict(state.snapshot)
    peers = list(iter_peers(snapshot))
    online = sum(1 for p in peers if p.get("state") == PeerState.ONLINE)
    stages = as_list(snapshot.get("stages"))
    stage_throughputs = [v for e in stages if (v := as_float(as_dict(e).get("throughput"))) is not None]
    peer_throughputs = [v for p in peers if (v := as_float(p.get("throughput"))) is not None]
    total: float | None = (
        sum(stage_throughputs) if stage_throughputs else sum(peer_throughputs) if peer_throughputs else None
    )
    num_stages = as_int(snapshot.get("num_stages"))
    if num_stages is None and stages:
        num_stages = len(stages)

    compact = compact or width < NARROW
    sep = Text(" · " if compact else "  ·  ", style="dim")
    params = snapshot.get("model_parameters")
    preset = snapshot.get("model_preset")
    throughput_text = human_count(total) if total is not None else "-"
    line1 = Text.assemble(
        ("" if compact else "swarm ", "dim"),
        (safe_text(snapshot.get("swarm_id"), 48), "bold cyan"),
        sep,
        ("" if compact else "model ", "dim"),
        (human_count(params, "params") if as_float(params) is not None else "- params", "bold"),
        (f" ({safe_text(preset, 16)})" if isinstance(preset, str) and preset and not compact else "", "dim"),
        sep,
        ("" if compact else "stages ", "dim"),
        (format_int(num_stages), "bold"),
        (" stages" if compact else "", "dim"),
    )
    peers_line = Text.assemble(
        ("peers ", "dim"),
        (f"{online} online", "bold green" if online else "bold red"),
        (f" / {len(peers)}", "dim"),
        sep,
        ("thr " if compact else "throughput ", "dim"),
        (throughput_text, "bold"),
    )
    if compact:
        lines_top = [line1, peers_line]
    else:
        line1.append_text(sep)
        line1.append_text(peers_line)
        lines_top = [line1]
    loss = stage0_loss(snapshot) if state.snapshot is not None else None
    floor = as_float(snapshot.get("loss_floor"))
    spark_width = max(0, min(40, width - (40 if compact else 50)))
    spark = sparkline(state.loss_history, spark_width)
    line2 = Text.assemble(("loss " if compact else "stage-0 loss ", "dim"), (format_float(loss), "bold magenta"))
    if spark:
        line2.append(" ")
        line2.append(spark, style="magenta")
    val_loss = stage0_loss(snapshot, "val_loss") if state.snapshot is not None else None
    line2.append_text(sep)
    line2.append("val " if compact else "held-out ", style="dim")
    line2.append(format_float(val_loss), style="bold magenta" if val_loss is not None else "dim")
    line2.append_text(sep)
    line2.append("floor ", style="dim")
    line2.append(format_float(floor), style="bold" if floor is not None else "dim")
    if floor is not None and loss is not None and not compact:
        line2.append(f" (gap {loss - floor:+.3f})", style="dim")
    line3 = Text.assemble(
        ("config ", "dim"),
        (safe_text(snapshot.get("config_hash"), 12)[:12], ""),
        sep,
        ("protocol ", "dim"),
        (format_int(snapshot.get("protocol_version")), ""),
        sep,
        ("observer ", "dim"),
        (safe_text(snapshot.get("software_version"), 24), ""),
        sep,
        ("snapshot ", "dim"),
        (format_clock(snapshot.get("time")), ""),
    )
    lines: list[RenderableType] = [*lines_top, line2] + ([] if compact else [line3])
    if snapshot.get("unrecoverable"):
        lines.append(
            Text(
                f"✗✗ UNRECOVERABLE without a checkpoint: {safe_text(snapshot.get('unrecoverable'))} "
                "(stage-0 peers have paused training)",
                style="bold white on red",
            )
        )
    if state.error is not None:
        age = "" if state.updated_at is None else f" (last data {format_age(time.time() - state.updated_at)})"
        lines.append(Text(f"⟳ reconnecting: {state.error}{age}", style="bold red"))
    elif state.snapshot is None:
        lines.append(Text("waiting for the first snapshot…", style="yellow"))
    return Panel(
        Group(*lines),
        title=Text("pipeswarm dashboard", style="bold"),
        title_align="left",
        box=box.ROUNDED,
        padding=(0, 1),
    )


def _stage_rows(snapshot: dict) -> list[tuple[int | None, dict | None]]:
    """(stage, its entry) for every stage 0..num_stages-1 (entry None when nobody reported it),
    then the entries without a usable stage number."""
    entries = [as_dict(e) for e in as_list(snapshot.get("stages"))]
    by_stage: dict[int, dict] = {}
    extra: list[dict] = []
    for e in entries:
        s = as_int(e.get("stage"))
        if s is None or s in by_stage:
            extra.append(e)
        else:
            by_stage[s] = e
    num = as_int(snapshot.get("num_stages"))
    indices = set(by_stage)
    if num is not None and 0 < num <= 1024:  # a hostile num_stages must not make a million rows
        indices |= set(range(num))
    rows: list[tuple[int | None, dict | None]] = [(s, by_stage.get(s)) for s in sorted(indices)]
    rows += [(None, e) for e in extra]
    return rows


def _memory_text(entry: dict) -> str:
    """The memory one peer of the stage needs, from its entry's "memory" (absent in older snapshots)."""
    total = as_float(as_dict(entry.get("memory")).get("total"))
    return format_bytes(total) if total is not None and total >= 0 else "-"


def _stage_map(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    """One row per stage; with `max_rows`, troubled stages are kept first and the cut is shown."""
    snapshot = as_dict(state.snapshot)
    rows = []
    for stage, entry in _stage_rows(snapshot):
        throughput = as_float(as_dict(entry).get("throughput"))
        if throughput is None and entry is not None:
            peer_throughputs = [
                v for p in as_list(entry.get("peers")) if (v := as_float(as_dict(p).get("throughput"))) is not None
            ]
            throughput = sum(peer_throughputs) if peer_throughputs else None
        rows.append((stage, entry, throughput, stage_entry_status(entry) if entry is not None else None))
    top = max([r[2] for r in rows if r[2] is not None] or [0.0])
    hidden_ok = hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        keep_n = max(max_rows - 1, 1)
        order = sorted(range(len(rows)), key=lambda i: (rows[i][3] == StageStatus.OK, i))
        keep = set(order[:keep_n])
        hidden = len(rows) - len(keep)
        hidden_ok = sum(1 for i in range(len(rows)) if i not in keep and rows[i][3] == StageStatus.OK)
        rows = [r for i, r in enumerate(rows) if i in keep]
    narrow = width < NARROW
    show_bar = width >= TINY
    show_sizes = width >= WITH_SIZES
    bar_width = max(3, min(40, width - (80 if show_sizes else 40 if narrow else 60)))

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False, padding=(0, 1))
    table.add_column("st" if narrow else "stage", justify="right", no_wrap=True)
    table.add_column("n" if narrow else "peers", justify="right", no_wrap=True)
    if show_bar:
        table.add_column("thr" if narrow else "throughput", no_wrap=True, overflow="crop")
    table.add_column("thr" if not show_bar else "", justify="right", no_wrap=True)
    if show_sizes:  # what one peer of the stage holds: its share of the model, the memory it needs
        table.add_column("params", justify="right", no_wrap=True)
        table.add_column("mem/peer", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True, overflow="ellipsis")
    sizes = ["-", "-"] if show_sizes else []
    if not rows:
        table.add_row(
            Text("-", style="dim"),
            "-",
            *([""] if show_bar else []),
            "-",
            *sizes,
            Text("no stages reported", style="dim"),
        )
    for stage, entry, throughput, status in rows:
        if entry is None:
            table.add_row(
                str(stage),
                Text("-", style="dim"),
                *([Text("")] if show_bar else []),
                Text("-", style="dim"),
                *[Text(size, style="dim") for size in sizes],
                Text("? no report", style="dim"),
            )
            continue
        peers = entry.get("peers")
        count = str(len(peers)) if isinstance(peers, list) else "-"
        mark, style = STATUS_MARKS.get(status or "", (safe_text(status, 20) if status else "-", "dim"))
        if narrow and status in STATUS_MARKS:
            mark = mark.split(" ", 1)[-1]
        fraction = (throughput / top) if throughput is not None and top > 0 else 0.0
        if status == StageStatus.OK:
            bar_style = "green"
        elif status in (StageStatus.SINGLE, StageStatus.REBUILDING):
            bar_style = "yellow"
        else:
            bar_style = "red"
        cells = [format_int(stage if stage is not None else entry.get("stage")), count]
        if show_bar:
            cells.append(Text(bar(fraction, bar_width), style=bar_style))
        cells.append(cell(human_count(throughput)))
        if show_sizes:
            cells += [cell(human_count(entry.get("parameters"))), cell(_memory_text(entry))]
        table.add_row(*cells, Text(mark, style=style))
    section = titled_section(Text("stages", style="bold"), table)
    if hidden:
        section.renderables.append(
            Text(f"… {hidden} more stages ({hidden_ok} ok)", style="dim", no_wrap=True, overflow="ellipsis")
        )
    return section


def _events_table(state: DashboardState, width: int, max_rows: int | None = None) -> RenderableType:
    events = list(reversed(state.events))  # newest first
    limit = ONCE_EVENTS if max_rows is None else max_rows
    shown = events[: max(limit, 0)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    narrow = width < NARROW
    table.add_column("time", no_wrap=True, min_width=8)
    table.add_column("kind", no_wrap=True, overflow="ellipsis", max_width=10 if narrow else 14)
    tiny = width < TINY
    if not tiny:
        table.add_column("st" if narrow else "stage", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("peer", no_wrap=True, min_width=8)
    table.add_column("detail", no_wrap=True, overflow="ellipsis")
    for event in shown:
        kind = safe_text(event.get("kind"), 20) if event.get("kind") else "-"
        row = [cell(format_clock(event.get("time"))), cell(kind, EVENT_STYLES.get(kind, ""))]
        if not tiny:
            row.append(cell(format_int(event.get("stage"))))
        if not narrow:
            row.append(cell(peer_id_text(event.get("peer_id"))))
        row.append(cell(safe_text(event.get("detail"), 200) if event.get("detail") else "-"))
        table.add_row(*row)
    if not shown:
        table.add_row(Text("-", style="dim"), Text("no events yet", style="dim"), *[""] * (len(table.columns) - 2))
    title = Text.assemble(("events", "bold"), (f"  newest first, {len(events)} kept", "dim"))
    return titled_section(title, table)


def _footer(state: DashboardState) -> Text:
    if state.editing_filter:
        return Text.assemble(
            ("filter: ", "bold yellow"),
            (state.filter_buffer, "bold"),
            ("▌", "blink"),
            ("   Enter keep  Esc cancel  (id, name, or a stage number)", "dim"),
        )
    keys = [("q", "quit"), ("s", "sort"), ("/", "filter"), ("c", "clear filter")]
    text = Text()
    for i, (key, effect) in enumerate(keys):
        if i:
            text.append("  ")
        text.append(key, style="bold reverse")
        text.append(f" {effect}")
    return text


def _height(renderable: RenderableType, width: int) -> int:
    console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    return len(console.render_lines(renderable, console.options.update(width=width), pad=False))


def render(state: DashboardState, width: int, height: int | None = None) -> RenderableType:
    """One frame. With `height` (the live view) the peer table and the events pane are cut to fit
    the screen (the cut is shown as "… N more"); without it everything is shown (20 newest events)."""
    width = max(int(width), 20)
    state.frames += 1
    header = _header(state, width, compact=height is not None and height < COMPACT_HEIGHT)
    footer = _footer(state)
    if height is None:
        return Group(
            header,
            _stage_map(state, width),
            Text(""),
            peer_table(state, width),
            Text(""),
            _events_table(state, width),
            footer,
        )
    height = max(int(height), 1)
    header_h, footer_h = _height(header, width), _height(footer, width)
    stage_map = _stage_map(state, width, max_rows=max(height // 4, 3))
    stage_h = _height(stage_map, width)
    peer_overhead = _height(peer_table(state, width, max_rows=0), width) - 1  # minus the "…" line
    event_overhead = _height(_events_table(state, width, max_rows=0), width) - 1  # minus "no events"
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
        return Group(
            header,
            stage_map,
            *gap,
            peer_table(state, width, max_rows=peer_rows),
            *gap,
            _events_table(state, width, max_rows=event_rows),
            footer,
        )
    # a short screen: no events pane; the peers if they fit, else at least the stage map
    parts: list[RenderableType] = [header]
    if room >= peer_overhead + 2:
        parts.append(stage_map)
        if room >= peer_overhead + 3:
            parts.append(Text(""))
            room -= 1
        parts.append(peer_table(state, width, max_rows=room - peer_overhead))
    else:
        available = height - header_h - footer_h
        parts.append(stage_map if stage_h <= available else _stage_map(state, width, max_rows=max(available - 3, 1)))
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
