"""Signed DHT records: who wrote a record, checked from the peer id alone.

Every value pipeswarm stores in the DHT is an *envelope* (a msgpack map):

    {"v": 1, "key": <the DHT key, as text>, "body": <msgpack of the record>,
     "pk": <the signer's libp2p public key, protobuf>, "sig": <signature>}

signed with the signer's libp2p identity key (the key p2pd runs with; dht/identity_keys.py). A
libp2p peer id is the multihash of that public key, so "the signer is the peer the record describes"
is checked from the record's peer id alone: no key directory, no trust in whoever relayed the record.

The signature covers a domain tag, the key, the subkey, the body bytes and, for peer records and
events, the expiration time. A signed record therefore cannot be moved to another key or subkey
(replayed as someone else's, or as another stage's), altered, or given a later expiration. The
swarm config is the exception: its signature leaves the expiration out, so that every peer can
re-publish the founder's config verbatim with a fresh expiration (the swarm outlives its
founder) while nobody but the founder can change it.

Three kinds of records, told apart by their key:

- `PEER`   pipeswarm/<swarm>/stage/<k>, subkey = the signer's peer id, body["peer_id"] = signer;
- `EVENT`  pipeswarm/<swarm>/events,    subkey = "<signer>:<time>",    body["reporter"] = signer;
- `CONFIG` pipeswarm/swarms,            subkey = "<swarm id>@<signer>" (the founder).

`SignedRecordValidator` applies the same checks inside every DHT node we run (hivemind calls it for
every store it is asked to do and every value another node returns), so a forged store is refused
by the honest nodes themselves and cannot displace an honest record; readers (dht/registry.py)
check again, with the swarm's own TTL, and log what they drop. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from dht.identity_keys import Identity, SignatureError, signer_of, verify_signature
from dht.rate_limited_log import RateLimitedLog
from dht.records import SWARMS_KEY

logger = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
SIGNATURE_DOMAIN = b"pipeswarm-record"  # so that a record signature can never pass for another libp2p signature

# No record may expire further ahead than this (DHT nodes refuse it, readers ignore it): bounds how
# long anyone, the owner included, can pin a record. Readers apply the swarm's own TTL on top.
MAX_RECORD_TTL = 900.0
# Peers' clocks disagree a little (the DHT runs on wall-clock time); this much is tolerated.
CLOCK_SLACK = 30.0

MAX_KEY_CHARS = 256
MAX_SUBKEY_CHARS = 256
MAX_BODY_BYTES = 16 * 1024  # a swarm config is ~1 KB, a peer record ~0.5 KB
MAX_PUBLIC_KEY_BYTES = 1024  # an RSA-4096 key in libp2p's protobuf is ~550 bytes
MAX_SIGNATURE_BYTES = 1024
MAX_ENVELOPE_BYTES = MAX_BODY_BYTES + MAX_PUBLIC_KEY_BYTES + MAX_SIGNATURE_BYTES + 1024

_STAGE_KEY_RE = re.compile(r"pipeswarm/([A-Za-z0-9._-]{1,64})/stage/(\d{1,4})")
_EVENTS_KEY_RE = re.compile(r"pipeswarm/([A-Za-z0-9._-]{1,64})/events")


class RecordKind(StrEnum):
    """What a signed record is, as told by its key."""

    PEER = "peer"
    EVENT = "event"
    CONFIG = "config"


def kind_of_key(key: str) -> RecordKind:
    """The kind of record stored under `key`; SignatureError for a key pipeswarm never writes."""
    if key == SWARMS_KEY:
        return RecordKind.CONFIG
    if _STAGE_KEY_RE.fullmatch(key):
        return RecordKind.PEER
    if _EVENTS_KEY_RE.fullmatch(key):
        return RecordKind.EVENT
    raise SignatureError(f"{key[:80]!r} is not a pipeswarm key")


def stage_of_key(key: str) -> int | None:
    match = _STAGE_KEY_RE.fullmatch(key)
    return None if match is None else int(match.group(2))


def config_subkey(swarm_id: str, founder: str) -> str:
    """Where a founder's config for `swarm_id` lives under SWARMS_KEY: one entry per (swarm, founder),
    so a stranger's config for the same swarm id sits beside the founder's and never replaces it."""
    return f"{swarm_id}@{founder}"


def split_config_subkey(subkey: str) -> tuple[str, str]:
    """(swarm id, founder peer id) of a config subkey."""
    swarm_id, at, founder = subkey.rpartition("@")
    if not at or not swarm_id or not founder:
        raise SignatureError(f"config subkey {subkey[:80]!r} is not '<swarm id>@<founder>'")
    return swarm_id, founder


# -- envelopes -----------------------------------------------------------------------------------


def _signed_bytes(key: str, subkey: str, body: bytes, expiration: float | None) -> bytes:
    return msgpack.packb([SIGNATURE_DOMAIN, ENVELOPE_VERSION, key, subkey, body, expiration], use_bin_type=True)


def _signs_expiration(kind: RecordKind) -> bool:
    # the founder's config is re-published by everyone with fresh expirations (see module doc)
    return kind != RecordKind.CONFIG


def record_mac(swarm_key: bytes, signed: bytes, signature: bytes) -> bytes:
    """A private swarm's MAC over a signed record: only holders of the swarm key can make one."""
    return hmac.new(swarm_key, b"pipeswarm-record-mac" + signed + signature, hashlib.sha256).digest()


def seal(
    identity: Identity,
    key: str,
    subkey: str,
    body: Mapping[str, Any],
    expiration: float,
    swarm_key: bytes | None = None,
) -> dict[str, Any]:
    """The signed envelope of `body` stored under (`key`, `subkey`) until `expiration`; in a private
    swarm (`swarm_key`) it also carries a MAC under the key."""
    kind = kind_of_key(key)
    body_bytes = msgpack.packb(dict(body), use_bin_type=True)
    if len(body_bytes) > MAX_BODY_BYTES:
        raise ValueError(f"record body is {len(body_bytes)} bytes, more than {MAX_BODY_BYTES}")
    check_binding(kind, subkey, body, identity.peer_id)  # our own bug, not the network's: fail loudly
    # a float, as hivemind hands it back (msgpack packs 5 and 5.0 differently)
    signed_expiration = float(expiration) if _signs_expiration(kind) else None
    signed = _signed_bytes(key, subkey, body_bytes, signed_expiration)
    signature = identity.sign(signed)
    envelope = {"v": ENVELOPE_VERSION, "key": key, "body": body_bytes, "pk": identity.public_key, "sig": signature}
    if swarm_key is not None:
        envelope["mac"] = record_mac(swarm_key, signed, signature)
    return envelope


def check_binding(kind: RecordKind, subkey: str, body: Mapping[str, Any], signer: str) -> None:
    """The record must be filed under, and speak for, the peer that signed it."""
    _check_subkey(kind, subkey, signer)
    if kind == RecordKind.PEER and body.get("peer_id") != signer:
        raise SignatureError(f"peer record for {str(body.get('peer_id'))[:80]!r} is signed by {signer}")
    if kind == RecordKind.EVENT and body.get("reporter") != signer:
        raise SignatureError(f"event reported by {str(body.get('reporter'))[:80]!r} is signed by {signer}")


def _check_subkey(kind: RecordKind, subkey: str, signer: str) -> None:
    if kind == RecordKind.PEER:
        filed_under_signer = subkey == signer
    elif kind == RecordKind.EVENT:
        filed_under_signer = subkey.startswith(signer + ":")
    else:
        filed_under_signer = split_config_subkey(subkey)[1] == signer
    if not filed_under_signer:
        raise SignatureError(f"{kind} record signed by {signer} is filed under subkey {subkey[:80]!r}")


@dataclass(frozen=True)
class OpenedRecord:
    """A verified envelope: `body` was signed by `signer` for this key and subkey."""

    kind: RecordKind
    key: str
    subkey: str
    signer: str
    body: dict[str, Any]
    envelope: dict[str, Any]  # as received: a config is re-published verbatim


class _VerifiedCache:
    """Signatures already verified, by a digest of everything they cover: readers re-read the same
    records several times a heartbeat period, and hivemind validates them again on each response."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._seen:
                self._seen.move_to_end(digest)
                return True
            return False

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._seen[digest] = None
            while len(self._seen) > self.size:
                self._seen.popitem(last=False)


_verified = _VerifiedCache()


def _unpack(data: bytes, what: str) -> Any:
    # unpackb bounds every string, list and map by the buffer's length, so the size check is enough
    if not isinstance(data, bytes) or len(data) > MAX_ENVELOPE_BYTES:
        raise SignatureError(f"{what} is not at most {MAX_ENVELOPE_BYTES} bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext)
    except Exception as e:
        raise SignatureError(f"{what} is not plain msgpack ({type(e).__name__})") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} in a record")


def open_envelope(
    raw: Any,
    *,
    key: str,
    subkey: Any,
    expiration: float,
    max_ttl: float = MAX_RECORD_TTL,
    now: float | None = None,
    swarm_key: bytes | None = None,
) -> OpenedRecord:
    """Verify an envelope read from (or offered to) the DHT under (`key`, `subkey`, `expiration`).

    Raises SignatureError unless: it is a well-formed envelope for `key`, its signature verifies
    with the public key it carries, that key's peer id is the peer the record is filed under and
    speaks for, and it does not expire more than `max_ttl` (+ clock slack) from now."""
    if not isinstance(raw, Mapping):
        raise SignatureError(f"expected a signed envelope, got {type(raw).__name__}")
    if raw.get("v") != ENVELOPE_VERSION:
        raise SignatureError(f"envelope version {str(raw.get('v'))[:16]!r} is not {ENVELOPE_VERSION}")
    if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_CHARS:
        raise SignatureError("subkey is not a short string")
    body_bytes, public_key, signature = raw.get("body"), raw.get("pk"), raw.get("sig")
    for name, value, limit in (
        ("body", body_bytes, MAX_BODY_BYTES),
        ("pk", public_key, MAX_PUBLIC_KEY_BYTES),
        ("sig", signature, MAX_SIGNATURE_BYTES),
    ):
        if not isinstance(value, bytes) or len(value) > limit:
            raise SignatureError(f"envelope field {name}: expected at most {limit} bytes")
    if raw.get("key") != key:
        raise SignatureError(f"envelope for key {str(raw.get('key'))[:80]!r} is stored under {key[:80]!r}")
    if isinstance(expiration, bool) or not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
        raise SignatureError("expiration is not a finite number")
    now = get_dht_time() if now is None else now
    if expiration > now + max_ttl + CLOCK_SLACK:
        raise SignatureError(
            f"expires {expiration - now:.0f} s from now, more than the {max_ttl:.0f} s a record may live"
        )
    kind = kind_of_key(key)
    signed = _signed_bytes(key, subkey, body_bytes, float(expiration) if _signs_expiration(kind) else None)
    if swarm_key is not None:  # a private swarm: nothing without the key's MAC gets further
        mac = raw.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, record_mac(swarm_key, signed, signature)):
            raise SignatureError("record MAC does not verify: written without this private swarm's key")
    signer = signer_of(public_key)  # type: ignore[arg-type]
    _check_subkey(kind, subkey, signer)  # before the costly part: junk under someone else's subkey
    digest = hashlib.sha256(b"%d:%b%d:%b" % (len(public_key), public_key, len(signature), signature) + signed).digest()
    if digest not in _verified:
        verify_signature(public_key, signature, signed)  # type: ignore[arg-type]
        _verified.add(digest)
    body = _unpack(body_bytes, "record body")  # type: ignore[arg-type]
    if not isinstance(body, dict):
        raise SignatureError("record body is not a map")
    check_binding(kind, subkey, body, signer)
    return OpenedRecord(kind, key, subkey, signer, body, dict(raw))


# -- inside the DHT nodes ------------------------------------------------------------------------


class SignedRecordValidator(RecordValidatorBase):
    """hivemind's hook into every DHT store and every value another DHT node returns: only
    well-formed, validly signed pipeswarm envelopes get in. A refused store is refused by the
    honest node itself, so it can neither replace nor pin an honest record there.

    Every DHT node applies the same rule, MAX_RECORD_TTL for every record: if honest nodes disagreed
    on what is valid, a record one of them accepted would make hivemind drop that node's whole
    answer at the others (it validates a returned dictionary as a whole). The swarm's own, shorter
    TTL is a reader's rule: `swarm_ttls` (filled by `learn_swarm_ttl` once the config is known) is
    where this node's readers (dht/registry.py) find it. `identity` is this node's signing key
    (None: it only reads)."""

    def __init__(self, identity: Identity | None = None, swarm_key: bytes | None = None):
        self.identity = identity
        self.swarm_key = swarm_key  # a private swarm: records must carry a MAC under it
        self.swarm_ttls: dict[str, float] = {}
        self.rejected = 0  # forged or malformed records refused so far (tests and logs)
        self._log = RateLimitedLog(logger)

    def learn_swarm_ttl(self, swarm_id: str, ttl: float) -> None:
        self.swarm_ttls[swarm_id] = min(float(ttl), MAX_RECORD_TTL)

    def validate(self, record: DHTRecord) -> bool:
        try:
            self.open(record)
            return True
        except SignatureError as e:
            self.rejected += 1
            self._log.warning("dht", str(e)[:60], f"DHT record refused: {e}")
            return False

    def open(self, record: DHTRecord) -> OpenedRecord:
        """The verified record behind a hivemind DHTRecord (key as hash, subkey and value as msgpack)."""
        if len(record.value) > MAX_ENVELOPE_BYTES or len(record.subkey) > MAX_SUBKEY_CHARS + 8:
            raise SignatureError("record too large")
        subkey = _unpack(record.subkey, "subkey")
        if subkey is None:  # hivemind's marker of a value stored without a subkey
            raise SignatureError("every pipeswarm record is stored under a subkey; refusing a plain value")
        envelope = _unpack(record.value, "value")
        key = envelope.get("key") if isinstance(envelope, dict) else None
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise SignatureError("value is not a signed envelope")
        kind_of_key(key)
        # the DHT only knows the key's hash: the envelope names the key, and must name this one
        if DHTID.generate(source=key).to_bytes() != record.key:
            raise SignatureError(f"envelope names key {key[:80]!r} but is stored under another key")
        return open_envelope(
            envelope, key=key, subkey=subkey, expiration=record.expiration_time, swarm_key=self.swarm_key
        )

    # records are signed explicitly by the registry (seal), not by hivemind on the way out
    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)


def validator_of(dht: Any) -> SignedRecordValidator | None:
    """The SignedRecordValidator a DHTNode was created with (node/p2p/network.py installs one)."""
    validator = getattr(getattr(dht, "protocol", None), "record_validator", None)
    return validator if isinstance(validator, SignedRecordValidator) else None


def identity_of(dht: Any) -> Identity | None:
    validator = validator_of(dht)
    return None if validator is None else validator.identity
