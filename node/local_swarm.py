"""Real multi-process swarms on loopback: `make demo`, the tests and the benchmarks use it.

Every process is started here, remembered with its whole process tree (p2pd included), and ended
by pid in `close()`, whatever the test did: no orphaned daemons, no fixed ports. Each process gets
its own state directory (XDG_STATE_HOME under the work directory), so it starts with a fresh peer
id of its own, as a new volunteer would: never the user's keys, never another local peer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from dht.records import PeerState
from node.p2p.rejoin import peer_id_of_maddr

REPO = Path(__file__).resolve().parent.parent  # PYTHONPATH for children, so a source checkout works too


@dataclass
class NodeProcess:
    name: str
    process: subprocess.Popen
    log_path: Path
    family: set[int] = field(default_factory=set)  # pids of the process and its descendants, as last seen

    @property
    def pid(self) -> int:
        return self.process.pid

    def refresh_family(self) -> set[int]:
        try:
            children = psutil.Process(self.pid).children(recursive=True)
            self.family |= {self.pid, *(child.pid for child in children)}
        except psutil.NoSuchProcess:
            pass
        return self.family

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill_hard(self) -> None:
        """SIGKILL the process and every descendant (its p2pd too), as a crash or a pulled plug
        would end them, and reap it."""
        self.refresh_family()
        for pid in self.alive_family():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()

    def alive_family(self) -> list[int]:
        alive = []
        for pid in self.family:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


class Swarm:
    def __init__(self, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = workdir
        self.nodes: list[NodeProcess] = []
        self.initial_peers: list[str] = []
        # the founder's peer id, once later peers and observers enter through others (`enter_through`)
        self.founder: str | None = None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})}

    def spawn(
        self, name: str, args: list[str], python_prefix: list[str] | None = None, launcher: list[str] | None = None
    ) -> NodeProcess:
        """Start `python -m node ARGS` (or `python PYTHON_PREFIX ARGS`), after `launcher` when given
        (e.g. `ip netns exec NS`, which execs in place: the pid is still the node's)."""
        log_path = self.workdir / f"{name}.log"
        command = [*(launcher or []), sys.executable, *(python_prefix or ["-m", "node"]), *args]
        # a name may be started again (a restart): a new directory per process keeps every id fresh
        env = {**self.env, "XDG_STATE_HOME": str(self.workdir / "state" / f"{len(self.nodes)}-{name}")}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        node = NodeProcess(name, process, log_path)
        self.nodes.append(node)
        return node

    def bootstrap(
        self, *extra: str, timeout: float = 60.0, host: str = "127.0.0.1", launcher: list[str] | None = None
    ) -> NodeProcess:
        node = self.spawn("bootstrap", ["bootstrap", "--host", host, *extra], launcher=launcher)
        self.initial_peers = wait_for(
            lambda: _initial_peers(node), timeout, f"bootstrap did not print its address:\n{node.log()}"
        )
        return node

    def enter_through(self, maddrs: list[str]) -> None:
        """Later joins and `status` calls enter through the peers at `maddrs`, not the bootstrapper
        (which a test may have stopped), and still trust only the founder's swarm config."""
        self.founder = self.founder or peer_id_of_maddr(self.initial_peers[0])
        self.initial_peers = list(maddrs)

    def _entry(self) -> list[str]:
        founder = ["--swarm-founder", self.founder] if self.founder else []
        return ["--initial-peers", *self.initial_peers, *founder]

    def join(
        self,
        name: str,
        *extra: str,
        python_prefix: list[str] | None = None,
        host: str = "127.0.0.1",
        launcher: list[str] | None = None,
    ) -> NodeProcess:
        return self.spawn(name, ["join", "--host", host, *self._entry(), *extra], python_prefix, launcher)

    def status(self, timeout: float = 60.0, launcher: list[str] | None = None) -> dict[str, Any]:
        """`node status --json` (run after `launcher` when given: from inside a network namespace)."""
        result = subprocess.run(
            [
                *(launcher or []),
                sys.executable,
                "-m",
                "node",
                "status",
                "--json",
                *self._entry(),
            ],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=timeout,
        )
        assert result.returncode == 0, f"node status failed ({result.returncode}):\n{result.stderr}"
        return json.loads(result.stdout)

    def observe(self) -> dict[str, Any]:
        """A snapshot through an observer inside this process: faster than spawning `node status`."""
        import asyncio

        from node.monitor.observer import observe_once

        return asyncio.run(observe_once(self.initial_peers, None, founder=self.founder))

    def refresh_families(self) -> None:
        for node in self.nodes:
            node.refresh_family()

    def close(self) -> None:
        """End every process this swarm started, children included, by pid."""
        self.refresh_families()
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for node in self.nodes:
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            for pid in node.alive_family():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if node.process.poll() is None:
                node.process.kill()
                node.process.wait()


def _initial_peers(node: NodeProcess) -> list[str] | None:
    for line in node.log().splitlines():
        if line.startswith("INITIAL_PEERS "):
            return line.split()[1:]
    if node.process.poll() is not None:
        raise AssertionError(f"{node.name} exited with {node.process.returncode}:\n{node.log()}")
    return None


def wait_for(predicate: Callable[[], Any], timeout: float, message: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(interval)


def peers_by_stage(snapshot: dict[str, Any], states: tuple[str, ...] = (PeerState.ONLINE,)) -> dict[int, list[str]]:
    return {
        stage["stage"]: [peer["peer_id"] for peer in stage["peers"] if peer["state"] in states]
        for stage in snapshot["stages"]
    }
