"""The pre-shared key of a private swarm: generating it, loading it, naming it in logs.

hivemind's p2pd has no pre-shared-key network option (its daemon flags offer none; checked in
docs/security.md), so a private swarm authenticates at our layer: every stream message carries an
HMAC-SHA256 under the key (protocol/framing.py) and every DHT record a MAC (dht/registry.py).
The key file holds 64 hex characters (32 random bytes) and should be readable by its owner only.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

KEY_BYTES = 32
ENV_VAR = "PIPESWARM_SWARM_KEY_FILE"


class SwarmKeyError(ValueError):
    """The swarm key file is missing, unreadable or malformed."""


def generate_swarm_key(path: str | Path) -> bytes:
    """Write a new random key to `path` (mode 0600); refuses to overwrite an existing file."""
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{path} exists already: not overwriting a swarm key") from None
    except OSError as e:
        raise SwarmKeyError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def load_swarm_key(path: str | Path | None = None) -> bytes | None:
    """The key in `path`, else in $PIPESWARM_SWARM_KEY_FILE, else None (an open swarm)."""
    path = path or os.environ.get(ENV_VAR) or None
    if path is None:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise SwarmKeyError(f"cannot read the swarm key {path}: {e.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SwarmKeyError(f"{path} is not a swarm key (expected {2 * KEY_BYTES} hex characters)") from None
    if len(key) != KEY_BYTES:
        raise SwarmKeyError(f"{path} holds {len(key)} bytes, a swarm key has {KEY_BYTES}")
    return key


def key_fingerprint(key: bytes | None) -> str:
    """A short public name for a key (safe to log and publish; reveals nothing of the key)."""
    if key is None:
        return "open"
    return hashlib.sha256(b"pipeswarm/swarm-key/" + key).hexdigest()[:12]
