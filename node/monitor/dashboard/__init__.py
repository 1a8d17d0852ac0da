"""`node dashboard`: a live, full-screen view of a swarm, rendered from snapshots.

A snapshot is the dict `node status --json` prints (node/monitor/status.py, see
docs/dashboard.md); the CLI supplies an async provider that builds one from the DHT. This package
only renders and interacts:

- `text`: untrusted values made safe and short to print.
- `snapshot_fields`: reading a snapshot whose fields may be missing or of the wrong type.
- `events`: events derived by comparing consecutive snapshots, merged with the swarm's own.
- `state`: `DashboardState`, what the live view remembers between frames, and the keys.
- `peer_table` and `render`: one frame; `render_once(snapshot, width)` as plain text.
- `live`: `run_live(provider, refresh)`, the full-screen loop with non-blocking key input.

Everything shown comes from peers we do not trust: every string is sanitised (control characters,
terminal escapes) and rendered as `Text`, never as rich markup, and every field may be missing,
None or of the wrong type in a snapshot from an older peer; such values render as "-".
"""

from node.monitor.dashboard.events import DerivedEventKind, DisplayedEventKind
from node.monitor.dashboard.live import run_live
from node.monitor.dashboard.render import render, render_once
from node.monitor.dashboard.snapshot_fields import iter_peers, stage0_loss
from node.monitor.dashboard.state import SORT_KEYS, DashboardState, PeerSortKey
from node.monitor.dashboard.text import human_count, peer_id_text, sparkline

__all__ = [
    "SORT_KEYS",
    "DashboardState",
    "DerivedEventKind",
    "DisplayedEventKind",
    "PeerSortKey",
    "human_count",
    "iter_peers",
    "peer_id_text",
    "render",
    "render_once",
    "run_live",
    "sparkline",
    "stage0_loss",
]
