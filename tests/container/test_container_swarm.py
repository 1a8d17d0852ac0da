"""`make docker-test`: the image built from the repo's Dockerfile runs a training swarm.

A bootstrap container and two joining containers (stage 0 and stage 1), all on the host's network
and bound to 127.0.0.1 on free ports, each from the same image; a containerised `node status --json`
reads the swarm twice and the inner steps of both stages grow. The bootstrap keeps its state (the
founder key) on a host folder mounted as its volume. Every container is stopped and removed at the
end, whatever happened, and the test checks none is left.

Marked `container`: the default suite leaves it out (pytest's addopts), `make docker-test` runs it,
and it skips with the reason where podman cannot run.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.local_swarm import wait_for
from tests.container.image import (
    DEFAULT_IMAGE,
    BuildReport,
    ImageBuildError,
    build_image,
    podman_command,
    podman_missing,
)

pytestmark = pytest.mark.container

IMAGE_ENV = "PIPESWARM_IMAGE"
IMAGE_UID = 10001  # the Dockerfile's `pipeswarm` user: a mounted state folder must be writable by it
LABEL = "pipeswarm-test"
INITIAL_PEERS = re.compile(r"^INITIAL_PEERS (.+)$", re.MULTILINE)


def resource_limits() -> list[str]:
    """Explicit ulimits: runc here cannot apply podman's defaults (1048576 open files / processes)
    and refuses to start the container; nproc above 32768 was refused too (measured)."""
    import resource

    files = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    procs = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", f"nproc={procs}:{procs}"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Containers:
    """Containers started by this test, all labelled with one run id and removed by `close()`."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.run_id = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.podman = podman_command()

    def common(self) -> list[str]:
        # the host's network (loopback only: every peer binds 127.0.0.1), an init that reaps p2pd
        return ["--network", "host", "--init", "--label", f"{LABEL}={self.run_id}", *resource_limits()]

    def start(self, name: str, *args: str, volumes: tuple[str, ...] = ()) -> str:
        full = f"pipeswarm-{self.run_id}-{name}"
        mounts = [flag for volume in volumes for flag in ("-v", volume)]
        command = [*self.podman, "run", "-d", "--name", full, *self.common(), *mounts, self.image, *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"podman run {name} failed: {result.stderr}"
        self.names.append(full)
        return full

    def once(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """A container that runs one command and is removed (node status)."""
        command = [*self.podman, "run", "--rm", *self.common(), self.image, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    def logs(self, name: str) -> str:
        result = subprocess.run([*self.podman, "logs", name], capture_output=True, text=True, timeout=60)
        return result.stdout + result.stderr

    def running(self, name: str) -> bool:
        result = subprocess.run(
            [*self.podman, "inspect", "--format", "{{.State.Running}}", name], capture_output=True, text=True
        )
        return result.stdout.strip() == "true"

    def left(self) -> list[str]:
        result = subprocess.run(
            [*self.podman, "ps", "-a", "--filter", f"label={LABEL}={self.run_id}", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout.split()

    def stop(self) -> dict[str, int]:
        """SIGTERM every container (10 s to leave the swarm cleanly), then their exit codes."""
        if self.names:
            subprocess.run([*self.podman, "stop", "-t", "10", *self.names], capture_output=True, timeout=120)
        codes = {}
        for name in self.names:
            result = subprocess.run(
                [*self.podman, "inspect", "--format", "{{.State.ExitCode}}", name], capture_output=True, text=True
            )
            codes[name] = int(result.stdout.strip() or -1)
        return codes

    def close(self) -> None:
        if self.names:
            subprocess.run([*self.podman, "rm", "-f", "-t", "5", *self.names], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def image() -> Iterator[str]:
    missing = podman_missing()
    if missing:
        pytest.skip(f"no container runtime: {missing}")
    name = os.environ.get(IMAGE_ENV)
    if name:  # `make docker-test` built it already (make docker-image)
        yield name
        return
    try:
        report: BuildReport = build_image(DEFAULT_IMAGE)
    except ImageBuildError as e:
        pytest.fail(f"cannot build the image: {e}")
    print(report.line())
    yield report.image


def status(containers: Containers, initial_peers: list[str]) -> dict[str, Any]:
    result = containers.once("status", "--json", "--initial-peers", *initial_peers)
    assert result.returncode == 0, f"containerised node status failed ({result.returncode}):\n{result.stderr}"
    return json.loads(result.stdout)


def inner_steps(snapshot: dict[str, Any]) -> dict[int, int]:
    """The most advanced online peer's inner step, per stage."""
    return {
        stage["stage"]: max((p["inner_step"] for p in stage["peers"] if p["state"] == "online"), default=-1)
        for stage in snapshot["stages"]
    }


@pytest.mark.timeout(900)
def test_containers_bootstrap_join_and_train(image: str, tmp_path: Path):
    started = time.monotonic()
    state = tmp_path / "bootstrap-state"
    state.mkdir()
    if os.geteuid() == 0:  # rootful podman: the container's user must own its volume
        os.chown(state, IMAGE_UID, IMAGE_UID)
    containers = Containers(image)
    try:
        port = free_port()
        founder = containers.start(
            "bootstrap",
            *("bootstrap", "--host", "127.0.0.1", "--port", str(port), "--num-stages", "2"),
            *("--heartbeat-period", "1", "--heartbeat-ttl", "5", "--swarm-id", f"container-{containers.run_id}"),
            volumes=(f"{state}:/var/lib/pipeswarm",),
        )

        def founder_address() -> list[str] | None:
            found = INITIAL_PEERS.search(containers.logs(founder))
            if found is None and not containers.running(founder):
                raise AssertionError(f"the bootstrap container exited:\n{containers.logs(founder)[-3000:]}")
            return found.group(1).split() if found else None

        initial_peers = wait_for(founder_address, 120, lambda: f"no address:\n{containers.logs(founder)[-3000:]}")
        assert all(f"/tcp/{port}/" in maddr for maddr in initial_peers), initial_peers
        # the founder key went to the mounted volume (XDG_STATE_HOME=/var/lib/pipeswarm/state)
        assert list(state.glob("state/pipeswarm/founder-*.key")), sorted(p.name for p in state.rglob("*"))

        joiners = [
            containers.start(
                f"stage{stage}",
                *("join", "--host", "127.0.0.1", "--port", str(free_port()), "--initial-peers", *initial_peers),
                *("--stage", str(stage), "--threads", "1", "--quiet", "--name", f"container-{stage}"),
            )
            for stage in (0, 1)
        ]

        def training() -> dict[int, int] | None:
            for name in joiners:
                if not containers.running(name):
                    raise AssertionError(f"{name} exited:\n{containers.logs(name)[-3000:]}")
            steps = inner_steps(status(containers, initial_peers))
            return steps if steps and min(steps.values()) >= 1 else None

        first = wait_for(
            training,
            300,
            lambda: "the swarm did not train:\n" + "\n".join(containers.logs(n)[-2000:] for n in joiners),
            interval=5,
        )
        time.sleep(10)
        second = inner_steps(status(containers, initial_peers))
        print(f"inner steps per stage: {first} -> {second} ({time.monotonic() - started:.0f} s since the start)")
        assert all(second[stage] > first[stage] for stage in first), (first, second)

        codes = containers.stop()
        assert all(code == 0 for code in codes.values()), {n: (c, containers.logs(n)[-1500:]) for n, c in codes.items()}
    finally:
        containers.close()
        assert containers.left() == [], f"containers left behind: {containers.left()}"
