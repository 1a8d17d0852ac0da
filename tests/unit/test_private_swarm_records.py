"""Private swarms, DHT side: records carry a MAC under the swarm key; members refuse any without it."""

from __future__ import annotations

import time

import pytest

from dht.identity_keys import Identity, SignatureError
from dht.records import PeerRecord, stage_key
from dht.signing import open_envelope, seal


@pytest.fixture(scope="module")
def identity() -> Identity:
    return Identity.generate()


def _record(identity: Identity) -> tuple[str, dict, float]:
    return stage_key("s", 1), PeerRecord(peer_id=identity.peer_id, stage=1).to_wire(), time.time() + 10


def test_a_keyed_record_opens_only_under_the_same_key(identity):
    key, body, expiration = _record(identity)
    swarm_key, other = b"k" * 32, b"o" * 32
    envelope = seal(identity, key, identity.peer_id, body, expiration, swarm_key)
    opened = open_envelope(envelope, key=key, subkey=identity.peer_id, expiration=expiration, swarm_key=swarm_key)
    assert opened.signer == identity.peer_id
    with pytest.raises(SignatureError, match="MAC"):
        open_envelope(envelope, key=key, subkey=identity.peer_id, expiration=expiration, swarm_key=other)
    # an open-swarm reader (no key) still verifies the signature: privacy is authenticity, not secrecy
    assert open_envelope(envelope, key=key, subkey=identity.peer_id, expiration=expiration).signer == identity.peer_id


def test_a_member_refuses_a_record_without_a_mac_or_with_a_forged_one(identity):
    key, body, expiration = _record(identity)
    swarm_key = b"k" * 32
    unkeyed = seal(identity, key, identity.peer_id, body, expiration)
    with pytest.raises(SignatureError, match="MAC"):
        open_envelope(unkeyed, key=key, subkey=identity.peer_id, expiration=expiration, swarm_key=swarm_key)
    forged = {**unkeyed, "mac": b"\0" * 32}
    with pytest.raises(SignatureError, match="MAC"):
        open_envelope(forged, key=key, subkey=identity.peer_id, expiration=expiration, swarm_key=swarm_key)
    # the MAC binds the expiration too: a member's record cannot be re-stored to live longer
    keyed = seal(identity, key, identity.peer_id, body, expiration, swarm_key)
    with pytest.raises(SignatureError):
        open_envelope(keyed, key=key, subkey=identity.peer_id, expiration=expiration + 5, swarm_key=swarm_key)
