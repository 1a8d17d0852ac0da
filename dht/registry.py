"""Who is where: typed, signed reads and writes of the swarm's DHT records.

All methods are coroutines on the node's single event loop. Writes are sealed with this node's
libp2p identity (dht/signing.py); reads verify every envelope (signature, signer = the peer the
record describes, expiration within the swarm's TTL) and every record's fields (dht/records.py),
and drop what fails with a log line, so a hostile or buggy peer can at worst hide itself, never
impersonate another, pin another's record, or crash a reader.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from dht.identity_keys import Identity, SignatureError
from dht.rate_limited_log import RateLimitedLog
from dht.records import (
    SWARMS_KEY,
    ConfigRecord,
    PeerRecord,
    RecordError,
    SwarmEvent,
    events_key,
    one_stage_per_peer,
    short_peer_id,
    stage_key,
)
from dht.signing import (
    MAX_RECORD_TTL,
    config_subkey,
    identity_of,
    open_envelope,
    seal,
    split_config_subkey,
    validator_of,
)


def swarm_key_of(dht: DHTNode) -> bytes | None:
    validator = validator_of(dht)
    return None if validator is None else validator.swarm_key


logger = logging.getLogger(__name__)
# the swarm view re-reads every record several times a period: one line per record and reason a minute
_dropped = RateLimitedLog(logger)

MAX_EVENTS = 200
EVENT_TTL = 300.0  # events live this long; readers ignore one that claims to live longer


async def list_swarm_configs(dht: DHTNode) -> list[ConfigRecord]:
    """Every validly signed swarm config in this DHT, whoever signed it (`record.founder`): a joiner
    picks the one signed by the founder it expects."""
    found = await dht.get(SWARMS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    configs = []
    for subkey, entry in found.value.items():
        where = str(subkey)[:100]
        try:
            opened = open_envelope(
                getattr(entry, "value", None),
                key=SWARMS_KEY,
                subkey=subkey,
                expiration=getattr(entry, "expiration_time", None),
                now=now,
                swarm_key=swarm_key_of(dht),
            )  # type: ignore[arg-type]
            record = ConfigRecord.from_wire(opened.body, founder=opened.signer, envelope=opened.envelope)
            swarm_id, _ = split_config_subkey(subkey)
        except (SignatureError, RecordError) as e:
            _dropped.warning("config", f"{where} {str(e)[:40]}", f"ignoring swarm config {where!r}: {e}")
            continue
        if record.config.get("swarm_id") != swarm_id:
            _dropped.warning(
                "config", f"{where} swarm", f"ignoring config record filed under {where!r} for another swarm"
            )
            continue
        configs.append(record)
    return configs


class SwarmRegistry:
    """The DHT view of one swarm. Holds no state but the DHT node and the swarm id; the signing key
    and the swarm's TTL come from the DHT node's SignedRecordValidator (node/p2p/network.py)."""

    def __init__(self, dht: DHTNode, swarm_id: str):
        self.dht = dht
        self.swarm_id = swarm_id

    @property
    def identity(self) -> Identity:
        identity = identity_of(self.dht)
        if identity is None:
            raise RuntimeError("this DHT node has no signing identity (start it with node.p2p.network.start_network)")
        return identity

    @property
    def swarm_key(self) -> bytes | None:
        """This node's private-swarm key (None: an open swarm); see node/p2p/swarm_key.py."""
        return swarm_key_of(self.dht)

    def peer_ttl(self) -> float:
        """The longest a peer record of this swarm may live ahead: its heartbeat TTL once known."""
        validator = validator_of(self.dht)
        return MAX_RECORD_TTL if validator is None else validator.swarm_ttls.get(self.swarm_id, MAX_RECORD_TTL)

    async def _store(self, key: str, subkey: str, envelope: dict[str, Any], expiration: float) -> bool:
        return await self.dht.store(key, envelope, expiration, subkey=subkey)

    async def publish_config(self, record: ConfigRecord, ttl: float) -> bool:
        """Publish the swarm config until now + `ttl`: the founder's signed envelope verbatim when
        `record` was read from the DHT, else sealed by this peer as the swarm's founder."""
        if ttl > MAX_RECORD_TTL:
            raise ValueError(f"a config lives at most {MAX_RECORD_TTL:.0f} s, not {ttl}")
        expiration = get_dht_time() + ttl
        if record.envelope is not None and record.founder:
            envelope, founder = record.envelope, record.founder
        else:
            founder = self.identity.peer_id
            envelope = seal(
                self.identity,
                SWARMS_KEY,
                config_subkey(self.swarm_id, founder),
                record.to_wire(),
                expiration,
                self.swarm_key,
            )
        return await self._store(SWARMS_KEY, config_subkey(self.swarm_id, founder), envelope, expiration)

    async def announce(self, record: PeerRecord, expiration_time: float) -> bool:
        identity = self.identity
        if record.peer_id != identity.peer_id:
            raise ValueError(f"this node ({identity.peer_id}) cannot announce a record of {record.peer_id}")
        record.updated = get_dht_time()
        key = stage_key(self.swarm_id, record.stage)
        return await self._store(
            key,
            record.peer_id,
            seal(identity, key, record.peer_id, record.to_wire(), expiration_time, self.swarm_key),
            expiration_time,
        )

    async def all_peers(self, num_stages: int) -> dict[int, list[PeerRecord]]:
        keys = [stage_key(self.swarm_id, stage) for stage in range(num_stages)]
        found = await self.dht.get_many(keys, sufficient_expiration_time=float("inf"))
        return one_stage_per_peer({stage: self._parse_stage(stage, found.get(key)) for stage, key in enumerate(keys)})

    async def publish_event(self, event: SwarmEvent, ttl: float = EVENT_TTL) -> bool:
        if ttl > EVENT_TTL:
            raise ValueError(f"an event lives at most {EVENT_TTL:.0f} s, not {ttl}")
        identity = self.identity
        event = SwarmEvent(event.time, event.kind, event.peer_id, event.stage, event.detail, reporter=identity.peer_id)
        key, subkey = events_key(self.swarm_id), f"{identity.peer_id}:{event.time:.6f}"
        expiration = get_dht_time() + ttl
        return await self._store(
            key, subkey, seal(identity, key, subkey, event.to_wire(), expiration, self.swarm_key), expiration
        )

    async def fetch_events(self) -> list[SwarmEvent]:
        key = events_key(self.swarm_id)
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        events = []
        for subkey, entry in found.value.items():
            try:
                opened = open_envelope(
                    getattr(entry, "value", None),
                    key=key,
                    subkey=subkey,
                    max_ttl=EVENT_TTL,
                    expiration=getattr(entry, "expiration_time", None),
                    now=now,
                    swarm_key=self.swarm_key,
                )  # type: ignore[arg-type]
                events.append(SwarmEvent.from_wire(opened.body))
            except (SignatureError, RecordError) as e:
                where = str(subkey)[:100]
                _dropped.warning("event", f"{where} {str(e)[:40]}", f"ignoring event {where!r}: {e}")
        events.sort(key=lambda event: event.time)
        return events[-MAX_EVENTS:]

    def _parse_stage(self, stage: int, found: Any) -> list[PeerRecord]:
        if found is None:
            return []
        if not isinstance(found.value, dict):
            _dropped.warning("stage", str(stage), f"ignoring stage {stage} entry: not a dictionary of peer records")
            return []
        key, ttl, now = stage_key(self.swarm_id, stage), self.peer_ttl(), get_dht_time()
        records = []
        for subkey, entry in found.value.items():
            expiration = getattr(entry, "expiration_time", None)
            if not isinstance(expiration, (int, float)) or expiration < now:
                continue
            try:
                opened = open_envelope(
                    entry.value,
                    key=key,
                    subkey=subkey,
                    expiration=expiration,
                    max_ttl=ttl,
                    now=now,
                    swarm_key=self.swarm_key,
                )
                records.append(PeerRecord.from_wire(opened.body, subkey=subkey, stage=stage, expires=float(expiration)))
            except (SignatureError, RecordError) as e:
                where = short_peer_id(subkey, 64)
                _dropped.warning(
                    "peer",
                    f"{stage}/{where} {str(e)[:40]}",
                    f"ignoring peer record in stage {stage} from {where!r}: {e}",
                )
        records.sort(key=lambda record: record.peer_id)
        return records
