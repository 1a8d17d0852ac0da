"""A stable identity by default: the key under the per-user state directory (node/p2p/identity_store.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dht.identity_keys import Identity
from node.p2p.identity_store import IdentityError, IdentityRole, claim_identity, key_stem, state_directory
from node.p2p.network import load_identity

REPO = Path(__file__).resolve().parents[2]


def peer_id_of_run(directory: Path, role: IdentityRole, label: str) -> str:
    """What one `node join`/`bootstrap` run does before p2pd starts: claim the key, load or create it."""
    claimed = claim_identity(role, label, directory)
    try:
        identity, key_file, temporary, _ = load_identity(str(claimed.path))
        assert temporary is None and key_file == str(claimed.path)
        return identity.peer_id
    finally:
        claimed.release()


def test_two_runs_with_one_state_directory_keep_the_peer_id(tmp_path):
    directory = tmp_path / "pipeswarm"
    first = peer_id_of_run(directory, IdentityRole.PEER, "alice")
    assert peer_id_of_run(directory, IdentityRole.PEER, "alice") == first
    assert peer_id_of_run(directory, IdentityRole.PEER, "bob") != first  # another name, another peer
    assert peer_id_of_run(directory, IdentityRole.PEER, "") not in (first,)
    founder = peer_id_of_run(directory, IdentityRole.FOUNDER, "alice")  # a swarm id, not a peer name
    assert founder != first and peer_id_of_run(directory, IdentityRole.FOUNDER, "alice") == founder
    explicit, _, _, _ = load_identity(str(tmp_path / "chosen.key"))  # --identity FILE
    assert explicit.peer_id != first


def test_a_key_in_use_by_a_running_peer_is_not_shared(tmp_path):
    directory = tmp_path / "pipeswarm"
    running = claim_identity(IdentityRole.PEER, "demo", directory)
    second = claim_identity(IdentityRole.PEER, "demo", directory)  # another process on this machine
    try:
        assert running.path != second.path and second.path.name == "peer-demo.2.key"
        ids = {load_identity(str(c.path))[0].peer_id for c in (running, second)}
        assert len(ids) == 2
    finally:
        second.release()
        running.release()
    again = claim_identity(IdentityRole.PEER, "demo", directory)  # the first one restarted: its own key back
    try:
        assert again.path == running.path
    finally:
        again.release()


def test_a_claim_is_held_across_processes(tmp_path):
    """flock is per open file: a child process sees the parent's claim and takes the next slot."""
    directory = tmp_path / "pipeswarm"
    held = claim_identity(IdentityRole.PEER, "x", directory)
    try:
        code = (
            "import sys; from pathlib import Path; from node.p2p.identity_store import IdentityRole, claim_identity; "
            f"print(claim_identity(IdentityRole.PEER, 'x', Path({str(directory)!r})).path.name)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
        )
        assert out.stdout.strip() == "peer-x.2.key", out.stderr
    finally:
        held.release()


def test_private_permissions(tmp_path):
    directory = tmp_path / "state" / "pipeswarm"
    claimed = claim_identity(IdentityRole.PEER, "p", directory)
    try:
        load_identity(str(claimed.path))
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(claimed.path.stat().st_mode) & 0o077 == 0  # 0400: the owner reads it, nobody else
        assert stat.S_IMODE(Path(f"{claimed.path}.lock").stat().st_mode) & 0o077 == 0
    finally:
        claimed.release()


def test_state_directory_follows_xdg():
    assert state_directory({"XDG_STATE_HOME": "/srv/state"}) == Path("/srv/state/pipeswarm")
    home_default = Path.home() / ".local" / "state" / "pipeswarm"
    assert state_directory({}) == home_default
    assert state_directory({"XDG_STATE_HOME": "relative/dir"}) == home_default  # invalid by the XDG spec


def test_names_become_safe_file_names():
    assert key_stem(IdentityRole.PEER, "") == "peer"
    assert key_stem(IdentityRole.PEER, "gpu box #2") == "peer-gpu_box__2"
    assert key_stem(IdentityRole.FOUNDER, "../../etc/passwd") == "founder-_.._etc_passwd"
    assert "/" not in key_stem(IdentityRole.PEER, "a/b")


@pytest.mark.parametrize("content", [b"not a key at all", b""])
def test_a_corrupt_key_is_refused_in_one_line(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError) as refused:
        load_identity(str(path))
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "--identity" in message


def test_an_unreadable_key_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = tmp_path / "locked.key"
    Identity.generate().save(str(path))
    path.chmod(0)
    with pytest.raises(IdentityError, match="cannot read identity file"):
        load_identity(str(path))


def test_node_join_refuses_a_corrupt_default_key(tmp_path):
    """The whole command: exit code 2 and one `refusing to start` line, before any daemon starts."""
    state = tmp_path / "xdg"
    (state / "pipeswarm").mkdir(parents=True)
    (state / "pipeswarm" / "peer-volunteer.key").write_bytes(b"garbage")
    founder = Identity.generate().peer_id
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "node",
            "join",
            "--name",
            "volunteer",
            "--initial-peers",
            f"/ip4/127.0.0.1/tcp/9/p2p/{founder}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(state)},
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    refusals = [line for line in result.stderr.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1 and "peer-volunteer.key" in refusals[0], result.stderr
