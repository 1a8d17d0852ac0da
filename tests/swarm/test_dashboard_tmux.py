"""`node dashboard` end to end, in a real terminal: tmux runs the live view against a real swarm on
loopback and `capture-pane` reads what a user would see.

- a registry-only swarm (bootstrap + 4 `--no-train` peers on 3 stages, heartbeat 1 s / TTL 4 s):
  the stage map rows and every peer's short id are on screen; after `kill -9` of one peer its row
  leaves the peer table within TTL + refresh + slack, a `leave` event with its short id appears and
  its stage drops to a single peer; `q` exits with status 0 and leaves no p2pd of the observer;
- an unreachable initial peer (a free port, nobody listening): the live view says
  "reconnecting", still quits cleanly on `q` and leaks no p2pd from its failed attempts; `--once`
  exits non-zero with a clear message, never a traceback.

Needs tmux (skipped without it). Every process is started here and ended by pid; the tmux server
runs on a private socket and is killed in a `finally`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from dht.records import short_peer_id
from node.local_swarm import Swarm, wait_for

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed")

TTL = 4.0
REFRESH = 1.0
WIDTH, HEIGHT = 140, 45
# a syntactically valid libp2p peer id that no process here owns
SOME_PEER_ID = "12D3KooWLRRGaauhdUH4gvXnd7KzjSu5HLTr7BAfte8Zt8Y8zGZE"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TmuxDashboard:
    """`node dashboard` (live) in a detached tmux session on a private server."""

    def __init__(self, workdir: Path, env: dict[str, str], initial_peers: list[str], name: str = "dash"):
        self.socket = f"pipeswarm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.env = {**env, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        self.session = name
        self.exit_file = workdir / f"{name}.exit"
        self.stderr_file = workdir / f"{name}.stderr"
        self.family: set[int] = set()
        script = workdir / f"{name}.sh"
        command = [
            sys.executable,
            "-m",
            "node",
            "dashboard",
            "--initial-peers",
            *initial_peers,
            "--refresh",
            str(REFRESH),
        ]
        script.write_text(
            "#!/bin/sh\n"
            f"export PYTHONPATH={shlex.quote(env['PYTHONPATH'])} PYTHONUNBUFFERED=1 LANG=C.UTF-8 LC_ALL=C.UTF-8\n"
            f"cd {shlex.quote(str(workdir))}\n"
            f"{shlex.join(command)} 2>{shlex.quote(str(self.stderr_file))}\n"
            f'echo "EXIT=$?" > {shlex.quote(str(self.exit_file))}\n'
        )
        self.pane_pid: int | None = None
        self.socket_path: str | None = None
        try:
            self.tmux(
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-s",
                name,
                "-x",
                str(WIDTH),
                "-y",
                str(HEIGHT),
                f"sh {shlex.quote(str(script))}",
            )
            pane_pid, self.socket_path = (
                self.tmux("display-message", "-p", "-t", name, "#{pane_pid} #{socket_path}").strip().split(" ", 1)
            )
            self.pane_pid = int(pane_pid)
            self.refresh_family()
        except BaseException:
            self.close()
            raise

    def tmux(self, *args: str) -> str:
        result = subprocess.run(
            [TMUX, "-L", self.socket, *args], capture_output=True, text=True, env=self.env, timeout=30
        )
        assert result.returncode == 0, f"tmux {args}: {result.stderr}"
        return result.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.session)

    def refresh_family(self) -> set[int]:
        """The pane's shell, the dashboard and everything below it (its p2pd), as seen so far."""
        if self.pane_pid is None:
            return self.family
        try:
            root = psutil.Process(self.pane_pid)
            self.family |= {self.pane_pid, *(child.pid for child in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
        return self.family

    def p2pd_pids(self) -> list[int]:
        pids = []
        for pid in self.refresh_family():
            try:
                if "p2pd" in psutil.Process(pid).name():
                    pids.append(pid)
            except psutil.NoSuchProcess:
                pass
        return pids

    def alive(self) -> list[int]:
        alive = []
        for pid in self.family:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def exit_status(self) -> str | None:
        return self.exit_file.read_text().strip() if self.exit_file.exists() else None

    def stderr(self) -> str:
        return self.stderr_file.read_text(errors="replace") if self.stderr_file.exists() else ""

    def quit_and_check(self, timeout: float = 60.0) -> None:
        """Press q: the dashboard exits with status 0 and nothing of its process tree survives."""
        # watch the tree closely until the exit: a p2pd started just before q must be seen too
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                self.refresh_family()
                done.wait(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            self.tmux("send-keys", "-t", self.session, "q")
            status = wait_for(
                self.exit_status,
                timeout,
                lambda: f"dashboard did not exit after q:\n{self.screen()}\n{self.stderr()[-3000:]}",
            )
        finally:
            done.set()
            watcher.join()
        assert status == "EXIT=0", f"{status}\n{self.stderr()[-3000:]}"
        wait_for(lambda: not self.alive(), 20, lambda: f"left behind: {self.describe(self.alive())}")
        assert "Traceback" not in self.stderr(), self.stderr()[-3000:]

    @staticmethod
    def describe(pids: list[int]) -> list[str]:
        out = []
        for pid in pids:
            try:
                out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.NoSuchProcess:
                out.append(f"{pid} (gone)")
        return out

    def close(self) -> None:
        """Whatever happened: end the dashboard's process tree by pid, then the private tmux server."""
        self.refresh_family()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, env=self.env, timeout=30)
        with contextlib.suppress(OSError, TypeError):
            os.unlink(self.socket_path)  # type: ignore[arg-type]  # the server is gone; its socket file may stay behind


def sections(screen: str) -> dict[str, list[str]]:
    """The dashboard's panes by title: header, stages, peers, events (footer lines end up in events)."""
    out: dict[str, list[str]] = {"header": [], "stages": [], "peers": [], "events": []}
    current = "header"
    for line in screen.splitlines():
        stripped = line.strip()
        if stripped == "stages":
            current = "stages"
        elif stripped.startswith("peers  sort:"):
            current = "peers"
        elif stripped.startswith("events  newest first"):
            current = "events"
        out[current].append(line)
    return out


def stage_rows(screen: str) -> dict[int, tuple[int, str]]:
    """stage -> (peer count, status text) from the stage map."""
    rows = {}
    for line in sections(screen)["stages"]:
        m = re.match(
            r"^\s*(\d+)\s+(\d+)\s.*?((?:✓ ok)|(?:! SINGLE PEER)|(?:✗ EMPTY)|(?:✗ LOST)|(?:↻ REBUILDING))\s*$", line
        )
        if m:
            rows[int(m.group(1))] = (int(m.group(2)), m.group(3))
    return rows


def peer_ids_in_table(screen: str) -> set[str]:
    ids = set()
    for line in sections(screen)["peers"]:
        parts = line.split()
        if len(parts) >= 4 and len(parts[0]) == 8 and parts[0] not in ("────────",):
            ids.add(parts[0])
    return ids


@pytest.mark.timeout(240)
def test_live_dashboard_in_tmux_follows_a_kill_and_quits_cleanly(swarm: Swarm, tmp_path: Path):
    started = time.monotonic()
    swarm.bootstrap("--num-stages", "3", "--heartbeat-period", "1", "--heartbeat-ttl", str(TTL))
    names = {"alpha": 0, "bravo": 1, "charlie": 2, "delta": 0}
    joiners = {
        name: swarm.join(name, "--stage", str(stage), "--no-train", "--name", name) for name, stage in names.items()
    }

    def peer_ids() -> dict[str, str] | None:
        ids = {}
        for name, node in joiners.items():
            m = re.search(r"peer (\S+) serves stage (\d+)", node.log())
            if m is None:
                assert node.process.poll() is None, f"{name} exited:\n{node.log()[-3000:]}"
                return None
            assert int(m.group(2)) == names[name]
            ids[name] = m.group(1)
        return ids

    # the dashboard starts while the peers do (both take a while on a loaded machine)
    dash = TmuxDashboard(tmp_path, swarm.env, swarm.initial_peers)
    try:
        ids = wait_for(
            peer_ids, 120, lambda: "peers never joined:\n" + "\n".join(j.log()[-1500:] for j in joiners.values())
        )
        shorts = {name: short_peer_id(pid) for name, pid in ids.items()}
        assert len(set(shorts.values())) == 4

        def all_shown() -> str | None:
            screen = dash.screen()
            assert "Traceback" not in screen, screen
            assert dash.exit_status() is None, f"dashboard exited early: {dash.exit_status()}\n{dash.stderr()[-3000:]}"
            rows = stage_rows(screen)
            if (
                peer_ids_in_table(screen) == set(shorts.values())
                and "peers 4 online / 4" in screen
                and rows.get(0, (0,))[0] == 2
                and rows.get(1, (0,))[0] == 1
                and rows.get(2, (0,))[0] == 1
            ):
                return screen
            return None

        screen = wait_for(
            all_shown, 120, lambda: f"swarm never fully on screen:\n{dash.screen()}\n{dash.stderr()[-3000:]}"
        )
        assert "pipeswarm dashboard" in screen and "stages 3" in screen and "peers 4 online / 4" in screen, screen
        rows = stage_rows(screen)
        assert rows == {0: (2, "✓ ok"), 1: (1, "! SINGLE PEER"), 2: (1, "! SINGLE PEER")}, screen
        for name in names:
            assert any(name in line and shorts[name] in line for line in sections(screen)["peers"]), screen
        assert all(len(line) <= WIDTH for line in screen.splitlines())
        assert dash.p2pd_pids(), "the dashboard's observer runs its own p2pd"

        # kill -9 one stage-0 peer: no farewell, its record just expires
        victim = joiners["delta"]
        victim.refresh_family()
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        killed_at = time.monotonic()

        def victim_gone() -> str | None:
            screen = dash.screen()
            return screen if shorts["delta"] not in peer_ids_in_table(screen) else None

        screen = wait_for(
            victim_gone, TTL + REFRESH + 40, lambda: f"killed peer still in the table:\n{dash.screen()}", interval=0.5
        )
        gone_after = time.monotonic() - killed_at
        # the record lives up to TTL after its last heartbeat; the next snapshot may take a few
        # seconds on a loaded machine
        assert gone_after < TTL + REFRESH + 25, gone_after
        print(f"killed peer left the table after {gone_after:.1f} s")

        def leave_event_and_stage_single() -> str | None:
            screen = dash.screen()
            leave = any(
                re.search(rf"\bleave\b.*\b{re.escape(shorts['delta'])}\b.*delta disappeared", line)
                for line in sections(screen)["events"]
            )
            return screen if leave and stage_rows(screen).get(0) == (1, "! SINGLE PEER") else None

        screen = wait_for(leave_event_and_stage_single, 15, lambda: f"no leave event:\n{dash.screen()}")
        assert peer_ids_in_table(screen) == {shorts[n] for n in ("alpha", "bravo", "charlie")}, screen
        assert "peers 3 online / 3" in screen, screen

        dash.quit_and_check()
    finally:
        dash.close()
    print(f"test body took {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(240)
def test_dashboard_against_an_unreachable_peer_says_so_without_a_traceback(tmp_path: Path):
    unreachable = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_PEER_ID}"
    env = Swarm(tmp_path).env  # the environment the swarm's children get (PYTHONPATH = the repo)
    once = subprocess.Popen(
        [sys.executable, "-m", "node", "dashboard", "--once", "--width", "100", "--initial-peers", unreachable],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    dash = TmuxDashboard(tmp_path, env, [unreachable], name="unreachable")
    try:

        def reconnecting() -> str | None:
            dash.p2pd_pids()  # remember every p2pd a failed attempt starts
            screen = dash.screen()
            assert "Traceback" not in screen, screen
            assert dash.exit_status() is None, f"dashboard exited: {dash.exit_status()}\n{dash.stderr()[-3000:]}"
            return screen if "reconnecting:" in screen else None

        screen = wait_for(reconnecting, 120, lambda: f"no reconnecting line:\n{dash.screen()}\n{dash.stderr()}")
        assert "could not start the libp2p daemon" in screen or "could not join the DHT" in screen, screen
        assert "no peers" in screen  # the rest of the frame is still drawn
        dash.quit_and_check()

        output, _ = once.communicate(timeout=180)
        assert once.returncode == 4, output
        assert "could not reach the swarm through " + unreachable in output, output
        assert "Traceback" not in output, output
    finally:
        dash.close()
        if once.poll() is None:
            once.kill()
            once.wait()
