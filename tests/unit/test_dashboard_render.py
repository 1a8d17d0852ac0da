"""Rendering and interaction of `node dashboard` (node/monitor/dashboard/), on hand-built snapshots."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console

from dht.records import short_peer_id
from node.monitor.dashboard import (
    SORT_KEYS,
    DashboardState,
    human_count,
    peer_id_text,
    render,
    render_once,
    run_live,
    sparkline,
)

T0 = 1_700_000_000.0
PREFIX = "12D3KooWQmPrefixSharedByAll"
IDS = {
    "a": PREFIX + "AAAAaaa1",
    "b": PREFIX + "BBBBbbb2",
    "c": PREFIX + "CCCCccc3",
    "d": PREFIX + "DDDDddd4",
}


def peer(key: str, stage: int, *, loss=None, throughput=10.0, updated=T0 - 3, version="0.1.0", **extra) -> dict:
    record = {
        "peer_id": IDS[key],
        "name": f"host-{key}",
        "stage": stage,
        "state": "online",
        "throughput": throughput,
        "inner_step": 120,
        "outer_round": 4,
        "loss": loss,
        "grad_norm": 0.5,
        "version": version,
        "last_partner": IDS["b"] if key == "a" else IDS["a"],
        "divergence": 0.0123,
        "updated": updated,
        "expires": updated + 30,
    }
    record.update(extra)
    return record


def snapshot(time: float = T0, *, drop: tuple[str, ...] = (), loss_a: float = 3.5) -> dict:
    """3 stages: stage 0 with peers a, b; stage 1 with only c (single); stage 2 empty."""
    stage0 = [
        p
        for p in (
            peer("a", 0, loss=loss_a, throughput=30.0),
            peer("b", 0, loss=loss_a + 0.2, throughput=20.0, updated=time - 20, version="0.0.9"),
        )
        if p["name"][-1] not in drop
    ]
    stage1 = [p for p in (peer("c", 1, throughput=12.5),) if p["name"][-1] not in drop]
    return {
        "time": time,
        "swarm_id": "demo-swarm",
        "num_stages": 3,
        "protocol_version": 3,
        "config_hash": "abcdef0123456789",
        "model_parameters": 1_234_567,
        "loss_floor": 2.125,
        "stages": [
            {
                "stage": 0,
                "status": "ok" if len(stage0) > 1 else "single",
                "throughput": sum(p["throughput"] for p in stage0),
                "peers": stage0,
            },
            {"stage": 1, "status": "single", "throughput": 12.5, "peers": stage1},
            {"stage": 2, "status": "empty", "throughput": 0.0, "peers": []},
        ],
        "events": [
            {"time": T0 - 60, "kind": "ban", "peer_id": IDS["d"], "stage": 2, "detail": "sent a NaN gradient"},
            {
                "time": T0 - 30,
                "kind": "gossip_failure",
                "peer_id": IDS["b"],
                "stage": 0,
                "detail": "timeout to CCCCccc3",
            },
        ],
        "software_version": "0.1.0",
    }


def text_of(renderable, width: int, height: int | None = None) -> str:
    console = Console(width=width, height=height or 100, record=True, file=io.StringIO(), force_terminal=False)
    console.print(renderable)
    return console.export_text()


def state_of(*snaps: dict) -> DashboardState:
    state = DashboardState()
    for snap in snaps:
        state.update(snap)
    return state


def test_helpers():
    assert short_peer_id(IDS["a"]) == "AAAAaaa1"
    assert short_peer_id(None) == "-"
    # ids from peers we do not trust: only a non-empty string is shown, and never raw
    assert peer_id_text(IDS["a"]) == "AAAAaaa1"
    assert peer_id_text(None) == peer_id_text("") == peer_id_text(12345) == "-"
    assert peer_id_text("12D3Koo\x07WAbc") == "Koo?WAbc"
    assert human_count(1_234_567, "params") == "1.2M params"
    assert human_count(950) == "950"
    assert human_count(None) == "-"
    assert sparkline([1, 2, 3, 4], 10) == "▁▃▆█"
    assert len(sparkline(range(100), 10)) == 10
    assert sparkline([], 5) == ""


@pytest.mark.parametrize("width", [140, 70])
def test_render_shows_everything_that_matters(width):
    state = state_of(snapshot(T0 - 2, loss_a=3.9), snapshot(T0))
    out = text_of(render(state, width), width)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "demo-swarm" in out and "1.2M params" in out
    assert "2.125" in out  # loss floor
    assert "3.600" in out  # stage-0 loss: mean of 3.5 and 3.7
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")  # sparkline (and bars)
    for stage in range(3):
        assert any(line.strip().startswith(str(stage)) for line in lines), stage
    assert "EMPTY" in out and "SINGLE PEER" in out
    for key in "abc":
        assert short_peer_id(IDS[key]) in out
    assert "sent a NaN gradient" in out and "ban" in out and "gossip_failure" in out
    assert "q quit" in out and "s sort" in out and "/ filter" in out and "c clear filter" in out
    if width >= 100:
        assert "partner" in out and "diverg" in out and "version" in out and "seen" in out
        assert "0.0.9*" in out  # b runs an older version than the observer
        assert "20s ago" in out and "3s ago" in out
    else:
        for col in ("partner", "diverg", "version", "seen"):
            assert col not in out
        assert "name" in out and "host-a" in out  # 60..99 columns keep name / steps


def test_very_narrow_keeps_id_stage_state_loss():
    out = render_once(snapshot(), 50)
    assert max(len(line) for line in out.splitlines()) <= 50
    for key in "abc":
        assert short_peer_id(IDS[key]) in out
    assert "host-a" not in out and "inner" not in out
    assert "EMPTY" in out and "SINGLE" in out


@pytest.mark.parametrize("width", [20, 33, 59, 60, 99, 100, 200])
def test_no_line_exceeds_width(width):
    out = render_once(snapshot(), width)
    assert out.strip()
    assert max(len(line) for line in out.splitlines()) <= max(width, 20)


def test_live_frame_fits_the_screen():
    snap = snapshot()
    many = [peer("a", 0, loss=3.0, peer_id=PREFIX + f"X{i:07d}", name=f"h{i}") for i in range(60)]
    snap["stages"][0]["peers"] = many
    snap["events"] = [
        {"time": T0 - i, "kind": "join", "peer_id": None, "stage": 0, "detail": f"e{i}"} for i in range(100)
    ]
    state = state_of(snap)
    for width, height in ((140, 40), (70, 30), (50, 24), (40, 16)):
        out = text_of(render(state, width, height), width, height)
        assert len(out.splitlines()) <= height, (width, height)
        assert "EMPTY" in out and "q quit" in out  # stage map and footer survive
        if height >= 24:
            assert "more" in out  # the cut is visible
            assert "e0" in out  # newest event shown


def test_missing_fields_render_as_dashes():
    old = {
        "stages": [
            {"stage": 0, "peers": [{"peer_id": IDS["a"], "stage": 0}]},
            {"stage": 1, "peers": [{"peer_id": None, "state": None, "loss": "nan?", "throughput": None}]},
            {"peers": "garbage"},
        ],
        "events": [{"kind": None}, "not-an-event", {"time": "yesterday"}],
        "num_stages": 4,
    }
    for width in (140, 70, 40):
        out = render_once(old, width)
        assert "-" in out and "AAAAaaa1" in out
        assert "no report" in out  # stage 3 of 4 never reported
    assert "waiting" not in render_once({}, 100)
    render_once({"stages": None, "events": None, "time": None}, 80)


def test_untrusted_strings_are_sanitised():
    snap = snapshot()
    snap["stages"][0]["peers"][0]["name"] = "evil\x1b[2J[bold red]x[/]"
    snap["events"][0]["detail"] = "line\nbreak\x07"
    out = render_once(snap, 140)
    assert "\x1b" not in out and "\x07" not in out
    assert "[bold red]" in out  # shown literally, never interpreted as markup


def test_state_derives_join_leave_and_lost():
    first = snapshot(T0)
    second = snapshot(T0 + 2, drop=("b",))  # b leaves
    third = snapshot(T0 + 4, drop=("b", "c"))  # c leaves too: stage 1 becomes empty
    third["stages"][1]["status"] = "empty"
    fourth = snapshot(T0 + 6, drop=("c",))  # b comes back
    fourth["stages"][1]["status"] = "empty"
    state = state_of(first, second, third, fourth)
    derived = [(e["kind"], e.get("peer_id"), e.get("stage")) for e in state.events if e.get("derived")]
    assert ("leave", IDS["b"], 0) in derived
    assert ("leave", IDS["c"], 1) in derived
    assert ("lost", None, 1) in derived
    assert ("join", IDS["b"], 0) in derived
    # the snapshot's own events are merged once, not once per snapshot
    assert sum(1 for e in state.events if e["kind"] == "ban") == 1
    assert [e["time"] for e in state.events] == sorted(e["time"] for e in state.events)
    out = text_of(render(state, 140), 140)
    assert out.index("join") < out.index("ban")  # newest first


def test_a_peer_that_leaves_twice_is_two_leave_events():
    state = state_of(snapshot(T0), snapshot(T0 + 10, drop=("b",)), snapshot(T0 + 20), snapshot(T0 + 30, drop=("b",)))
    derived = [(e["kind"], e["time"]) for e in state.events if e.get("derived") and e.get("peer_id") == IDS["b"]]
    assert derived == [("leave", T0 + 10), ("join", T0 + 20), ("leave", T0 + 30)]


def test_unrecoverable_swarm_is_announced_in_the_header():
    snap = snapshot(T0)
    snap["unrecoverable"] = "stages 1 and 2 lost together"
    out = render_once(snap, 120)
    assert "UNRECOVERABLE" in out and "stages 1 and 2 lost together" in out
    assert "UNRECOVERABLE without" not in render_once(snapshot(T0), 120)


def test_reported_event_replaces_derived_duplicate():
    first, second = snapshot(T0), snapshot(T0 + 2, drop=("b",))
    state = state_of(first, second)
    assert any(e["kind"] == "leave" and e.get("derived") for e in state.events)
    third = snapshot(T0 + 4, drop=("b",))
    third["events"].append({"time": T0 + 1, "kind": "leave", "peer_id": IDS["b"], "stage": 0, "detail": "graceful"})
    state.update(third)
    leaves = [e for e in state.events if e["kind"] == "leave"]
    assert len(leaves) == 1 and leaves[0]["detail"] == "graceful" and not leaves[0].get("derived")


def test_events_are_capped():
    state = DashboardState(max_events=10)
    for i in range(30):
        snap = snapshot(T0 + i)
        snap["events"] = [{"time": T0 + i, "kind": "rebuild", "peer_id": None, "stage": 2, "detail": str(i)}]
        state.update(snap)
    assert len(state.events) == 10
    assert state.events[-1]["detail"] == "29"


def test_loss_history_tracks_stage0_mean():
    state = state_of(*(snapshot(T0 + i, loss_a=4.0 - i * 0.1) for i in range(5)))
    assert state.loss_history == pytest.approx([4.1 - i * 0.1 for i in range(5)])


def test_sort_and_filter():
    state = state_of(snapshot())

    def order() -> list[str]:
        return [p["name"] for p in state.visible_peers()]

    assert state.sort_key == "stage" and order() == ["host-a", "host-b", "host-c"]
    assert state.cycle_sort() == "throughput" and order() == ["host-a", "host-b", "host-c"]
    state.snapshot["stages"][1]["peers"][0]["throughput"] = 99.0
    assert order()[0] == "host-c"
    assert state.cycle_sort() == "loss" and order() == ["host-a", "host-b", "host-c"]  # None loss last
    assert state.cycle_sort() == "last seen" and order()[-1] == "host-b"  # b updated 20 s ago
    assert state.cycle_sort() == SORT_KEYS[0]

    state.set_filter("1")  # a stage number
    assert order() == ["host-c"]
    state.set_filter("BBBB")  # part of the id
    assert order() == ["host-b"]
    state.set_filter("HOST-A")  # name, case-insensitive
    assert order() == ["host-a"]
    out = text_of(render(state, 140), 140)
    assert "AAAAaaa1" in out and "BBBBbbb2" not in out.split("peers")[1].split("events")[0]
    state.set_filter("")
    assert len(order()) == 3


def test_keys():
    state = state_of(snapshot())
    assert state.feed("s") is False and state.sort_key == "throughput"
    state.feed("/ccc")
    assert state.editing_filter and [p["name"] for p in state.visible_peers()] == ["host-c"]
    assert "filter:" in text_of(render(state, 100), 100)
    state.feed("\r")
    assert not state.editing_filter and state.filter_text == "ccc"
    state.feed("/x\x7fb\n")
    assert state.filter_text == "b" and "q" not in state.filter_text
    state.feed("/zzz")
    state.feed("\x1b")  # Esc: back to the previous filter
    assert state.filter_text == "b"
    state.feed("\x1b[A")  # an arrow key is ignored whole
    state.feed("c")
    assert state.filter_text == ""
    assert state.feed("q") is True


class FakeProvider:
    def __init__(self, fail_first: int = 0):
        self.calls = 0
        self.fail_first = fail_first

    async def __call__(self) -> dict:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("bootstrap peer unreachable")
        snap = snapshot(T0 + self.calls)
        snap["swarm_id"] = f"swarm-call-{self.calls}"
        return snap


def live_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=120, height=40, color_system=None), buf


def test_run_live_non_tty_renders_frames_until_cancelled(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a TTY: termios is left alone
    provider = FakeProvider()
    console, buf = live_console()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_live(provider, refresh=0.05, console=console), timeout=0.6)

    asyncio.run(main())
    out = buf.getvalue()
    assert provider.calls >= 2
    assert "swarm-call-1" in out and "swarm-call-2" in out  # at least two distinct frames drawn
    assert "Traceback" not in out


def test_run_live_shows_reconnecting_when_the_provider_fails(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    provider = FakeProvider(fail_first=2)
    console, buf = live_console()

    async def main():
        # until the third snapshot is drawn (bounded: a loaded machine may take more than a few refreshes)
        live = asyncio.create_task(run_live(provider, refresh=0.05, console=console))
        deadline = asyncio.get_running_loop().time() + 10.0
        while "swarm-call-3" not in buf.getvalue() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        live.cancel()
        with pytest.raises(asyncio.CancelledError):
            await live

    asyncio.run(main())
    out = buf.getvalue()
    assert "reconnecting: ConnectionError: bootstrap peer unreachable" in out
    assert provider.calls >= 3 and "swarm-call-3" in out  # retried and recovered


def test_run_live_provider_timeout(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))

    async def hangs() -> dict:
        await asyncio.sleep(10)
        return {}

    console, buf = live_console()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_live(hangs, refresh=0.05, console=console, timeout=0.1), timeout=0.5)

    asyncio.run(main())
    assert "reconnecting: no snapshot within 0.1s" in buf.getvalue()


def test_run_live_quits_on_q_from_a_pty(monkeypatch):
    pty = pytest.importorskip("pty")
    termios = pytest.importorskip("termios")
    import os

    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    stdin = os.fdopen(slave, "r", closefd=False)
    monkeypatch.setattr("sys.stdin", stdin)
    console, _ = live_console()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, os.write, master, b"sq")
        return await asyncio.wait_for(run_live(FakeProvider(), refresh=0.05, console=console), timeout=5)

    try:
        assert asyncio.run(main()) == 0
        assert termios.tcgetattr(slave) == before  # terminal restored
    finally:
        stdin.close()
        os.close(master)
        os.close(slave)
