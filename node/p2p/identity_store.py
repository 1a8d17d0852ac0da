"""Where a peer keeps its libp2p key when `--identity` does not say: a per-user state directory.

A restarted peer keeps its peer id, so the swarm sees the same peer come back (its bans, its
records, a founder's signature on the swarm config all stay valid). The directory is
`$XDG_STATE_HOME/pipeswarm/` (default `~/.local/state/pipeswarm/`, mode 0700), one key per role
and name, each written 0400 by dht/identity_keys.py:

    founder-<swarm id>.key    `node bootstrap` of that swarm: the founder whose signature peers trust
    peer.key, peer-<name>.key `node join` (with `--name NAME`): the public name stays just a name

Two processes must never run with one key (two peers with one peer id break routing and the
DHT), and several peers on one machine are common (`make demo`, tests, one per GPU). So a key is
*claimed*: an exclusive `flock` on `<key>.lock`, held for the process's life and released by the
kernel however the process ends. A peer that finds its key claimed takes the next slot
(`peer-<name>.2.key`, ...), so the first N peers on a machine keep their ids across restarts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

logger = logging.getLogger(__name__)

APP_DIR = "pipeswarm"
MAX_SLOTS = 64  # peers of one role and name on one machine before we give up (a runaway loop, surely)


class IdentityError(RuntimeError):
    """The state directory or a key in it cannot be used (one line for the user, with the fix)."""


class IdentityRole(StrEnum):
    FOUNDER = "founder"  # `node bootstrap`: one key per swarm id
    PEER = "peer"  # `node join`: one key per --name


def state_directory(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """`$XDG_STATE_HOME/pipeswarm`, or `~/.local/state/pipeswarm` (the XDG base directory rule: a
    relative XDG_STATE_HOME is invalid and ignored)."""
    base = environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / APP_DIR


def key_stem(role: IdentityRole, label: str) -> str:
    """The file name (without slot and suffix) for `role` and a swarm id or public name; anything
    but letters, digits, dot, dash and underscore becomes '_' (a name is free text)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label.strip())[:64].lstrip(".")
    return f"{role}-{safe}" if safe else str(role)


@dataclass
class ClaimedKey:
    """A key file this process holds the lock of (the file itself may not exist yet: p2p creates it)."""

    path: Path
    lock_fd: int

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # closing drops the flock
            self.lock_fd = -1


def _private_directory(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # a directory of private keys: nobody else may list it
    except OSError as e:
        raise IdentityError(
            f"cannot use the state directory {directory} for this peer's key: {e.strerror or e}"
        ) from None


def claim_identity(role: IdentityRole, label: str, directory: Path | None = None) -> ClaimedKey:
    """The first key slot for `role`/`label` no other running process holds, locked for this one."""
    directory = directory or state_directory()
    _private_directory(directory)
    stem = key_stem(role, label)
    for slot in range(1, MAX_SLOTS + 1):
        path = directory / (f"{stem}.key" if slot == 1 else f"{stem}.{slot}.key")
        try:
            fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise IdentityError(f"cannot create the lock file {path}.lock: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another running peer holds this key: try the next slot
            os.close(fd)
            continue
        if slot > 1:
            logger.info(f"{stem}.key is in use by another running peer: this one uses {path.name}")
        return ClaimedKey(path, fd)
    raise IdentityError(
        f"{MAX_SLOTS} peers with the key name {stem} already run on this machine: "
        "give this one its own --name or --identity FILE"
    )
