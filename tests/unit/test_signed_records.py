"""Signed DHT records (dht/signing.py): what verifies, what does not, and why.

Every forgery a stranger can try on a record is here at the unit level: a tampered field, a
record signed by someone else than the peer it describes, a record moved to another subkey or
key (a replay of another peer's record), an expiration pushed far ahead (pinning), and values that
are not envelopes at all. The multi-process version is tests/swarm/test_forged_records.py.
"""

from __future__ import annotations

import logging
import os
import random

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration

from dht.identity_keys import Identity, SignatureError
from dht.records import SWARMS_KEY, ConfigRecord, EventKind, PeerRecord, PeerState, SwarmEvent, events_key, stage_key
from dht.registry import SwarmRegistry, list_swarm_configs
from dht.signing import (
    CLOCK_SLACK,
    MAX_RECORD_TTL,
    RecordKind,
    SignedRecordValidator,
    config_subkey,
    kind_of_key,
    open_envelope,
    seal,
)
from node.server.daemon import JoinRefused, expected_founder

NOW = 1_000_000.0
KEY = stage_key("s", 1)


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def mallory() -> Identity:
    return Identity.generate()


def peer_body(peer_id: str, state: PeerState = PeerState.ONLINE, stage: int = 1) -> dict:
    return PeerRecord(peer_id=peer_id, stage=stage, state=state, throughput=1.0).to_wire()


def sealed_peer(identity: Identity, expiration: float = NOW + 10, key: str = KEY, **kwargs) -> dict:
    return seal(identity, key, identity.peer_id, peer_body(identity.peer_id, **kwargs), expiration)


def open_peer(envelope: dict, subkey: str, expiration: float = NOW + 10, key: str = KEY, **kwargs):
    return open_envelope(envelope, key=key, subkey=subkey, expiration=expiration, now=NOW, **kwargs)


def dht_record(key: str, subkey: object, value: object, expiration: float) -> DHTRecord:
    """A record as hivemind hands it to a validator: the key as its hash, subkey and value as msgpack."""
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )


# -- identity ------------------------------------------------------------------------------------


def test_identity_file_is_a_libp2p_key_whose_peer_id_p2pd_would_announce(tmp_path, alice):
    path = str(tmp_path / "id.key")
    alice.save(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o400"
    with open(path, "rb") as f:
        assert PeerID.from_identity(f.read()).to_base58() == alice.peer_id  # hivemind's own derivation
    assert Identity.from_file(path).peer_id == alice.peer_id


def test_a_non_rsa_identity_file_is_refused_with_a_message(tmp_path):
    path = tmp_path / "ed.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString())
    with pytest.raises(ValueError, match="Ed25519"):
        Identity.from_file(str(path))
    path.write_bytes(b"not a key at all")
    with pytest.raises(ValueError):
        Identity.from_file(str(path))


# -- envelopes -----------------------------------------------------------------------------------


def test_each_kind_of_record_opens_to_its_signer(alice):
    opened = open_peer(sealed_peer(alice), alice.peer_id)
    assert (opened.kind, opened.signer, opened.body["state"]) == (RecordKind.PEER, alice.peer_id, "online")

    event = SwarmEvent(NOW, EventKind.BAN, "QmSomeoneElse", 1, "bad gossip", reporter=alice.peer_id).to_wire()
    subkey = f"{alice.peer_id}:{NOW:.6f}"
    opened = open_envelope(
        seal(alice, events_key("s"), subkey, event, NOW + 300),
        key=events_key("s"),
        subkey=subkey,
        expiration=NOW + 300,
        now=NOW,
    )
    assert (opened.kind, opened.signer, opened.body["peer_id"]) == (RecordKind.EVENT, alice.peer_id, "QmSomeoneElse")

    config = ConfigRecord(1, "hash", {"swarm_id": "s"}, "0.1").to_wire()
    subkey = config_subkey("s", alice.peer_id)
    opened = open_envelope(
        seal(alice, SWARMS_KEY, subkey, config, NOW + 120), key=SWARMS_KEY, subkey=subkey, expiration=NOW + 120, now=NOW
    )
    assert (opened.kind, opened.signer) == (RecordKind.CONFIG, alice.peer_id)


def test_a_tampered_field_breaks_the_signature(alice):
    envelope = sealed_peer(alice)
    body = msgpack.unpackb(envelope["body"])
    body["state"] = "leaving"
    tampered = {**envelope, "body": msgpack.packb(body)}
    with pytest.raises(SignatureError, match="does not verify"):
        open_peer(tampered, alice.peer_id)


def test_a_record_signed_by_another_peer_than_it_describes_is_refused(alice, mallory):
    # mallory signs a record that describes alice, filed under alice's subkey
    with pytest.raises(SignatureError):  # seal itself refuses to produce it...
        seal(mallory, KEY, alice.peer_id, peer_body(alice.peer_id), NOW + 10)
    # ...so build it by hand: alice's body, mallory's key and signature
    envelope = sealed_peer(mallory)
    envelope["body"] = msgpack.packb(peer_body(alice.peer_id))
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id)
    # and a phantom: mallory's valid signature over a record of a made-up peer id
    phantom = sealed_peer(mallory)
    phantom_body = peer_body("QmMadeUpPeerIdThatNobodyHasTheKeyOf1234567890")
    phantom["body"] = msgpack.packb(phantom_body)
    with pytest.raises(SignatureError):
        open_peer(phantom, "QmMadeUpPeerIdThatNobodyHasTheKeyOf1234567890")


def test_swapping_in_another_public_key_breaks_the_signature(alice, mallory):
    envelope = sealed_peer(alice)
    envelope["pk"] = mallory.public_key
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id)


def test_a_record_under_another_subkey_or_key_is_refused(alice, mallory):
    """Replaying a peer's genuine record as another peer's, or as another stage's."""
    envelope = sealed_peer(alice)
    with pytest.raises(SignatureError):
        open_peer(envelope, mallory.peer_id)  # alice's record filed under mallory's subkey
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id, key=stage_key("s", 2))  # moved to stage 2
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id, key=stage_key("other-swarm", 1))


def test_a_later_expiration_than_signed_is_refused(alice):
    envelope = sealed_peer(alice, expiration=NOW + 10)
    assert open_peer(envelope, alice.peer_id, expiration=NOW + 10)
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id, expiration=NOW + 11)


def test_a_far_expiration_is_refused_even_when_genuinely_signed(alice):
    pinned = sealed_peer(alice, expiration=NOW + 3600, state=PeerState.LEAVING)
    with pytest.raises(SignatureError, match="more than"):
        open_peer(pinned, alice.peer_id, expiration=NOW + 3600)
    # readers hold a swarm's peer records to its own TTL (plus clock slack)
    near = sealed_peer(alice, expiration=NOW + 15 + CLOCK_SLACK)
    assert open_peer(near, alice.peer_id, expiration=NOW + 15 + CLOCK_SLACK, max_ttl=15)
    far = sealed_peer(alice, expiration=NOW + 15 + CLOCK_SLACK + 1)
    with pytest.raises(SignatureError):
        open_peer(far, alice.peer_id, expiration=NOW + 15 + CLOCK_SLACK + 1, max_ttl=15)


def test_config_is_republished_verbatim_with_a_fresh_expiration_but_only_under_its_founder(alice, mallory):
    subkey = config_subkey("s", alice.peer_id)
    config = seal(alice, SWARMS_KEY, subkey, ConfigRecord(1, "h", {"swarm_id": "s"}, "").to_wire(), NOW + 120)
    later = open_envelope(config, key=SWARMS_KEY, subkey=subkey, expiration=NOW + 500, now=NOW + 400)
    assert later.signer == alice.peer_id
    with pytest.raises(SignatureError):  # filed as mallory's config: signature covers the subkey
        open_envelope(config, key=SWARMS_KEY, subkey=config_subkey("s", mallory.peer_id), expiration=NOW + 1, now=NOW)
    with pytest.raises(SignatureError):  # mallory signing a config for alice's slot
        seal(mallory, SWARMS_KEY, subkey, ConfigRecord(1, "h", {"swarm_id": "s"}, "").to_wire(), NOW + 120)


@pytest.mark.parametrize(
    "envelope",
    [
        None,
        b"raw",
        {"peer_id": "x", "stage": 1, "state": "online"},
        {"v": 2},
        {"v": 1, "key": KEY, "body": b"\xc1", "pk": b"", "sig": b""},
        {"v": 1, "key": KEY, "body": b"", "pk": b"\x08\x00\x12\x03abc", "sig": b"x"},
        {"v": 1, "key": KEY, "body": b"x" * 20000, "pk": b"", "sig": b""},
        {"v": 1, "key": KEY, "body": "text", "pk": b"", "sig": b""},
    ],
)
def test_garbage_is_a_signature_error_not_a_crash(envelope, alice):
    with pytest.raises(SignatureError):
        open_peer(envelope, alice.peer_id)


def test_kind_comes_from_the_key():
    assert kind_of_key(SWARMS_KEY) == RecordKind.CONFIG
    assert kind_of_key(stage_key("a-b_c.d", 12)) == RecordKind.PEER
    assert kind_of_key(events_key("s")) == RecordKind.EVENT
    with pytest.raises(SignatureError):
        kind_of_key("someone/else")


# -- inside a DHT node ---------------------------------------------------------------------------


def test_validator_accepts_signed_records_and_refuses_plain_values_and_forgeries(alice, mallory, monkeypatch):
    monkeypatch.setattr("dht.signing.get_dht_time", lambda: NOW)
    validator = SignedRecordValidator(alice)
    assert validator.validate(dht_record(KEY, alice.peer_id, sealed_peer(alice), NOW + 10))
    # finding 1: alice's subkey, state leaving, one hour ahead, not signed by alice
    forged = {"peer_id": alice.peer_id, "stage": 1, "state": "leaving"}
    assert not validator.validate(dht_record(KEY, alice.peer_id, forged, NOW + 3600))
    # a plain value under the whole stage key would replace every peer's record in hivemind's storage
    assert not validator.validate(dht_record(KEY, None, sealed_peer(alice), NOW + 10))
    # an envelope naming another key than the one it is stored under
    assert not validator.validate(dht_record(stage_key("s", 2), alice.peer_id, sealed_peer(alice), NOW + 10))
    # mallory pinning her own, genuinely signed record
    assert not validator.validate(dht_record(KEY, mallory.peer_id, sealed_peer(mallory, NOW + 3600), NOW + 3600))
    assert validator.validate(dht_record(KEY, mallory.peer_id, sealed_peer(mallory, NOW + 60), NOW + 60))
    # the swarm's own TTL is the readers' rule; every DHT node applies the same one
    validator.learn_swarm_ttl("s", 15)
    assert validator.validate(dht_record(KEY, mallory.peer_id, sealed_peer(mallory, NOW + 60), NOW + 60))
    assert validator.rejected == 4
    assert MAX_RECORD_TTL >= 300  # events live 300 s


def test_validator_never_raises_on_random_bytes(alice):
    validator = SignedRecordValidator(alice)
    rng = random.Random(7)
    for size in (0, 1, 5, 40, 300, 5000):
        for _ in range(20):
            value = bytes(rng.getrandbits(8) for _ in range(size))
            subkey = bytes(rng.getrandbits(8) for _ in range(min(size, 50)))
            assert validator.validate(DHTRecord(b"k" * 20, subkey, value, NOW)) is False


# -- reading -------------------------------------------------------------------------------------


class FakeDHT:
    """Just enough of a DHTNode for SwarmRegistry's readers: a fixed answer per key."""

    def __init__(self, entries: dict[str, dict]):
        self.entries = entries

    async def get(self, key, latest=False):
        if key not in self.entries:
            return None
        return ValueWithExpiration(
            {subkey: ValueWithExpiration(value, exp) for subkey, (value, exp) in self.entries[key].items()}, NOW + 10
        )

    async def get_many(self, keys, sufficient_expiration_time=None):
        return {key: await self.get(key) for key in keys}


def config_signed_by(dht, founder: str):
    """Swarm "s"'s config as signed by `founder`, as a joiner reads it (None if there is none)."""
    configs = run(list_swarm_configs(dht))
    return next((c for c in configs if c.founder == founder and c.config["swarm_id"] == "s"), None)


def run(coroutine):
    """pytest-asyncio is not a dependency: these tests run their own loop."""
    import asyncio

    return asyncio.run(coroutine)


def test_readers_drop_forged_peer_records_with_a_log_line(alice, mallory, monkeypatch, caplog):
    now = 2_000_000_000.0
    monkeypatch.setattr("dht.registry.get_dht_time", lambda: now)
    monkeypatch.setattr("dht.signing.get_dht_time", lambda: now)
    honest = seal(alice, KEY, alice.peer_id, peer_body(alice.peer_id), now + 10)
    phantom = {"peer_id": "QmPhantom", "stage": 1, "state": "online", "throughput": 1e9}
    replayed = honest  # alice's record re-filed under mallory's subkey
    dht = FakeDHT(
        {
            KEY: {
                alice.peer_id: (honest, now + 10),
                "QmPhantom": (phantom, now + 10),
                mallory.peer_id: (replayed, now + 10),
            }
        }
    )
    with caplog.at_level(logging.WARNING, logger="dht.registry"):
        peers = run(SwarmRegistry(dht, "s").all_peers(2))[1]  # type: ignore[arg-type]
    assert [peer.peer_id for peer in peers] == [alice.peer_id]
    assert "QmPhantom" in caplog.text and mallory.peer_id[-20:] in caplog.text


def test_readers_hold_peer_records_to_the_swarms_ttl(alice, mallory, monkeypatch, caplog):
    now = 2_000_000_000.0
    monkeypatch.setattr("dht.registry.get_dht_time", lambda: now)
    monkeypatch.setattr("dht.signing.get_dht_time", lambda: now)
    near = seal(alice, KEY, alice.peer_id, peer_body(alice.peer_id), now + 5)
    pinned = seal(mallory, KEY, mallory.peer_id, peer_body(mallory.peer_id), now + 600)  # her own, 10 min ahead
    dht = FakeDHT({KEY: {alice.peer_id: (near, now + 5), mallory.peer_id: (pinned, now + 600)}})
    dht.protocol = type("Protocol", (), {"record_validator": SignedRecordValidator()})()
    registry = SwarmRegistry(dht, "s")  # type: ignore[arg-type]
    assert {p.peer_id for p in run(registry.all_peers(2))[1]} == {alice.peer_id, mallory.peer_id}
    dht.protocol.record_validator.learn_swarm_ttl("s", 5)
    with caplog.at_level(logging.WARNING, logger="dht.registry"):
        assert [p.peer_id for p in run(registry.all_peers(2))[1]] == [alice.peer_id]
    assert "600 s from now" in caplog.text


def test_readers_keep_configs_and_events_only_from_their_signers(alice, mallory, monkeypatch):
    now = 2_000_000_000.0
    monkeypatch.setattr("dht.registry.get_dht_time", lambda: now)
    monkeypatch.setattr("dht.signing.get_dht_time", lambda: now)
    good = ConfigRecord(1, "h", {"swarm_id": "s", "num_stages": 3}, "").to_wire()
    evil = ConfigRecord(1, "h5", {"swarm_id": "s", "num_stages": 5}, "").to_wire()
    good_key, evil_key = config_subkey("s", alice.peer_id), config_subkey("s", mallory.peer_id)
    tampered = seal(alice, SWARMS_KEY, good_key, good, now + 100)
    tampered = {**tampered, "body": msgpack.packb(evil)}
    event = SwarmEvent(now, EventKind.UNRECOVERABLE, alice.peer_id, None, "forged", reporter=alice.peer_id)
    event_subkey = f"{alice.peer_id}:{now:.6f}"
    dht = FakeDHT(
        {
            SWARMS_KEY: {
                good_key: (seal(alice, SWARMS_KEY, good_key, good, now + 100), now + 100),
                evil_key: (seal(mallory, SWARMS_KEY, evil_key, evil, now + 100), now + 100),
                "s": (evil, now + 3600),
            },
            events_key("s"): {event_subkey: (event.to_wire(), now + 100)},  # unsigned, claims alice
        }
    )
    registry = SwarmRegistry(dht, "s")  # type: ignore[arg-type]
    assert config_signed_by(dht, alice.peer_id).config["num_stages"] == 3
    assert config_signed_by(dht, mallory.peer_id).config["num_stages"] == 5  # mallory's own, beside alice's
    dht.entries[SWARMS_KEY][good_key] = (tampered, now + 100)
    assert config_signed_by(dht, alice.peer_id) is None
    assert run(registry.fetch_events()) == []


# -- whose config a joiner trusts ----------------------------------------------------------------


def test_the_founder_comes_from_the_bootstrap_address_or_the_flag(alice, mallory):
    a, m = alice.peer_id, mallory.peer_id
    assert expected_founder([f"/ip4/127.0.0.1/tcp/1/p2p/{a}", f"/ip4/10.0.0.1/tcp/1/p2p/{a}"]) == a
    assert expected_founder([f"/ip4/127.0.0.1/tcp/1/p2p/{m}"], a) == a
    with pytest.raises(JoinRefused, match="--swarm-founder"):
        expected_founder([f"/ip4/127.0.0.1/tcp/1/p2p/{a}", f"/ip4/127.0.0.1/tcp/2/p2p/{m}"])
    with pytest.raises(JoinRefused, match="/p2p/"):
        expected_founder(["/ip4/127.0.0.1/tcp/1"])
    with pytest.raises(JoinRefused, match="not a peer id"):
        expected_founder([f"/ip4/127.0.0.1/tcp/1/p2p/{a}"], "not-a-peer-id")
