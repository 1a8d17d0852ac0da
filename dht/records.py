"""What peers publish in the DHT, and the strict reading of what strangers published.

Three record kinds live under a swarm's keys:
- the swarm config record (written by the swarm's founder, the bootstrapper, and re-published
  verbatim by every peer): the config dict, its hash and the protocol version;
- one peer record per peer, stored under its stage's key with the peer id as subkey, re-announced
  by the heartbeat with an expiration of now + TTL, so a dead peer disappears on its own;
- swarm events (rebuilds, bans, lost stages), one subkey per event.

Each is stored inside an envelope signed by the peer that wrote it (dht/signing.py); this module
is the records' content. Anything read from the DHT was written by someone we do not trust:
`PeerRecord.from_wire` and `ConfigRecord.from_wire` check every field and raise `RecordError`;
readers log and skip.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from protocol.plain import plain_dict


class PeerState(StrEnum):
    """Where a peer is in its life; only `ONLINE` peers are routed to. A StrEnum so that records
    stay plain msgpack strings on the wire."""

    JOINING = "joining"  # claimed a stage, still loading its state
    ONLINE = "online"  # serving its stage
    LEAVING = "leaving"  # shutting down (written once on SIGTERM)
    REBUILDING = "rebuilding"  # rebuilding a lost stage from its neighbours


class Reachability(StrEnum):
    """How other peers can reach a peer, read from the multiaddrs it announces (`reachability_of`)."""

    PUBLIC = "public"  # dialed directly (a public host, or a port forwarded with --announce)
    RELAYED = "relay"  # holds relay reservations (`/p2p-circuit` addresses): behind a NAT
    UNKNOWN = "unknown"  # announced no address


CIRCUIT = "/p2p-circuit"


class LinkPath(StrEnum):
    """How a peer's last direct link to a peer behind a NAT went (node/p2p/traversal.py)."""

    PUNCHED = "punched"  # a hole-punched connection between the two
    RELAYED = "relayed"  # carried by a relay
    FAILED = "failed"  # neither worked


def reachability_of(addrs: list[str]) -> Reachability:
    """p2pd takes relay reservations only once it believes it cannot be dialed (AutoNAT, or
    `--reachability private`), and then still lists its LAN addresses: so any relay address means
    "reach me through a relay", whatever else is listed."""
    if any(CIRCUIT in addr for addr in addrs):
        return Reachability.RELAYED
    return Reachability.PUBLIC if addrs else Reachability.UNKNOWN


class EventKind(StrEnum):
    """What a `SwarmEvent` reports. Events are displayed, never acted upon."""

    LOST = "lost"
    REBUILD = "rebuild"
    UNRECOVERABLE = "unrecoverable"
    BAN = "ban"
    GOSSIP_FAILURE = "gossip_failure"
    VERIFICATION = "verification"  # a spot-check strike or ban, with its evidence (node/pipeline/verifier.py)


def short_peer_id(peer_id: Any, n: int = 8) -> str:
    """The last `n` characters of a peer id: enough to tell peers apart in logs and tables."""
    if peer_id is None:
        return "-"
    return str(peer_id)[-n:]


MAX_ID_CHARS = 128
MAX_NAME_CHARS = 64
MAX_FINGERPRINT = 16
MAX_PATHS = 16  # peers whose last link path a record lists
MAX_RELAYS = 4  # relays a peer behind a NAT announces it is registered with
MAX_ADDRS = 16  # a peer's announced multiaddrs (listen, --announce and relay addresses)
MAX_ADDR_CHARS = 256


class RecordError(ValueError):
    """A DHT record is malformed: wrong type, missing field, out of range."""


SWARMS_KEY = "pipeswarm/swarms"  # one subkey per swarm id, holding that swarm's config record


def stage_key(swarm_id: str, stage: int) -> str:
    return f"pipeswarm/{swarm_id}/stage/{stage}"


def events_key(swarm_id: str) -> str:
    return f"pipeswarm/{swarm_id}/events"


def _check_str(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{name}: expected str, got {type(value).__name__}")
    if len(value) > limit:
        raise RecordError(f"{name}: longer than {limit} characters")
    return value


def _check_int(value: Any, name: str, low: int = 0, high: int = 2**62) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{name}: expected int, got {type(value).__name__}")
    if not low <= value <= high:
        raise RecordError(f"{name}: {value} outside [{low}, {high}]")
    return value


def _check_float(value: Any, name: str, optional: bool = False, low: float = -math.inf) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < low:
        raise RecordError(f"{name}: {value} is not a finite number >= {low}")
    return value


def _check_floats(value: Any, name: str, limit: int) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) > limit:
        raise RecordError(f"{name}: expected a list of at most {limit} numbers")
    return [_check_float(item, name) for item in value]  # type: ignore[misc]


def _check_addrs(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ADDRS:
        raise RecordError(f"addrs: expected a list of at most {MAX_ADDRS} multiaddrs")
    return [_check_str(addr, "addrs", MAX_ADDR_CHARS) for addr in value]


def _check_ids(value: Any, name: str, limit: int) -> list[str]:
    if not isinstance(value, (list, tuple)) or len(value) > limit:
        raise RecordError(f"{name}: expected a list of at most {limit} peer ids")
    return [_check_str(item, name, MAX_ID_CHARS) for item in value]


def _check_paths(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or len(value) > MAX_PATHS:
        raise RecordError(f"paths: expected a map of at most {MAX_PATHS} peers")
    paths = {}
    for peer, path in value.items():
        try:
            paths[_check_str(peer, "paths", MAX_ID_CHARS)] = LinkPath(_check_str(path, "paths", 16)).value
        except ValueError:
            raise RecordError(f"paths: unknown path {str(path)[:16]!r}") from None
    return paths


def _check_reachability(value: Any) -> Reachability:
    try:
        return Reachability(_check_str(value, "reachability", 16))
    except ValueError:
        raise RecordError(f"reachability: unknown value {value!r}") from None


def _check_state(value: Any) -> PeerState:
    try:
        return PeerState(_check_str(value, "state", 16))
    except ValueError:
        raise RecordError(f"state: {value!r} is not one of {[state.value for state in PeerState]}") from None


MAX_REPORTED_PEERS = 16  # strikes and bans one record may list


@dataclass
class VerificationReport:
    """What a peer's spot-checks found (node/pipeline/verifier.py): published in its record so that
    `node status` and the dashboard can show who holds strikes and bans against whom."""

    checks: int = 0  # checks it decided: a layer of a replica's microbatch replayed
    failed: int = 0  # of those, checks that found evidence (each one a strike)
    unanswered: int = 0  # checks a replica left unanswered (no strike)
    served: int = 0  # checks it answered for others
    largest_error: float = 0.0  # the largest replay error of an output among the checks that passed
    largest_gradient_error: float = 0.0  # the same for an input gradient
    tolerance: float = 0.0  # the tolerance largest_error was held to
    check_seconds: float = 0.0  # mean time from a check's request to its verdict
    strikes: dict[str, float] = field(default_factory=dict)  # peer -> decayed strikes it holds against it
    bans: list[str] = field(default_factory=list)  # peers it banned after spot-checks

    @classmethod
    def from_wire(cls, raw: Any) -> VerificationReport:
        if not isinstance(raw, Mapping):
            raise RecordError(f"verification: expected a map, got {type(raw).__name__}")
        strikes, bans = raw.get("strikes", {}), raw.get("bans", [])
        if not isinstance(strikes, Mapping) or len(strikes) > MAX_REPORTED_PEERS:
            raise RecordError(f"verification.strikes: expected a map of at most {MAX_REPORTED_PEERS} peers")
        if not isinstance(bans, list) or len(bans) > MAX_REPORTED_PEERS:
            raise RecordError(f"verification.bans: expected a list of at most {MAX_REPORTED_PEERS} peers")
        counts = {name: _check_int(raw.get(name, 0), f"verification.{name}") for name in _REPORT_COUNTS}
        measures = {
            name: _check_float(raw.get(name, 0.0), f"verification.{name}", low=0.0)  # type: ignore[arg-type]
            for name in _REPORT_MEASURES
        }
        return cls(
            **counts,
            **measures,
            strikes={
                _check_str(peer, "verification.strikes", MAX_ID_CHARS): _check_float(score, "strike", low=0.0)  # type: ignore[misc]
                for peer, score in strikes.items()
            },
            bans=[_check_str(peer, "verification.bans", MAX_ID_CHARS) for peer in bans],
        )


_REPORT_COUNTS = ("checks", "failed", "unanswered", "served")
_REPORT_MEASURES = ("largest_error", "largest_gradient_error", "tolerance", "check_seconds")


@dataclass
class PeerRecord:
    """One peer's self-description, re-announced every heartbeat period."""

    peer_id: str
    stage: int
    state: PeerState = PeerState.JOINING
    throughput: float = 0.0
    inner_step: int = 0
    # backward passes this peer completed at its stage: a step takes microbatches_per_step of them or
    # more (node/stage/stage_worker.py, step_size), so steps alone do not count microbatches
    microbatches: int = 0
    outer_round: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    # stage 0: mean loss on held-out data (node/pipeline/validation.py), and this peer's inner step when measured
    val_loss: float | None = None
    val_step: int | None = None
    version: str = ""
    name: str = ""
    last_partner: str | None = None
    divergence: float | None = None
    # a seeded random projection of the stage's weights (node.averaging.gossip.WeightFingerprint): replicas
    # of a stage can be compared without exchanging weights
    fingerprint: list[float] | None = None
    # where others dial this peer (node/p2p/dialer.py) and what kind of address that is
    addrs: list[str] = field(default_factory=list)
    reachability: Reachability = Reachability.UNKNOWN
    # the TCP port of this peer's direct links (node/p2p/direct.py), on the hosts of `addrs`; None: none
    direct_port: int | None = None
    # a peer behind a NAT: the relays it holds a registration with (node/p2p/relay.py), through which
    # other peers punch a hole to its direct-link port or have their link relayed
    relays: list[str] = field(default_factory=list)
    # a relay (`--relay-budget`): the bytes it still carries between peers behind NATs; 0: not a relay
    relay_budget: int = 0
    # how this peer's last direct link to each of the peers behind NATs it reached went (LinkPath values)
    paths: dict[str, str] = field(default_factory=dict)
    verification: VerificationReport | None = None
    updated: float = 0.0
    # filled in by the reader from the DHT entry, never sent
    expires: float = field(default=0.0, compare=False)

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self, dict_factory=plain_dict)
        del wire["expires"]
        return wire

    @classmethod
    def from_wire(cls, raw: Any, *, subkey: Any = None, stage: int | None = None, expires: float = 0.0) -> PeerRecord:
        """Validate a record read from the DHT. `subkey` and `stage` are where it was stored: a
        record must describe the peer and stage it is filed under, or someone is impersonating."""
        if not isinstance(raw, Mapping):
            raise RecordError(f"peer record: expected a map, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)} - {"expires"}
        missing = {"peer_id", "stage", "state"} - set(raw)
        if missing:
            raise RecordError(f"peer record: missing {sorted(missing)}")
        values = {key: raw[key] for key in raw if key in known}  # newer peers may add fields: ignore them
        record = cls(
            peer_id=_check_str(values["peer_id"], "peer_id", MAX_ID_CHARS),
            stage=_check_int(values["stage"], "stage", 0, 1024),
            state=_check_state(values["state"]),
            throughput=_check_float(values.get("throughput", 0.0), "throughput", low=0.0),  # type: ignore[arg-type]
            inner_step=_check_int(values.get("inner_step", 0), "inner_step"),
            microbatches=_check_int(values.get("microbatches", 0), "microbatches"),
            outer_round=_check_int(values.get("outer_round", 0), "outer_round"),
            loss=_check_float(values.get("loss"), "loss", optional=True),
            grad_norm=_check_float(values.get("grad_norm"), "grad_norm", optional=True, low=0.0),
            val_loss=_check_float(values.get("val_loss"), "val_loss", optional=True, low=0.0),  # cross-entropy >= 0
            val_step=None if values.get("val_step") is None else _check_int(values["val_step"], "val_step"),
            version=_check_str(values.get("version", ""), "version", 32),
            name=_check_str(values.get("name", ""), "name", MAX_NAME_CHARS),
            last_partner=None
            if values.get("last_partner") is None
            else _check_str(values["last_partner"], "last_partner", MAX_ID_CHARS),
            divergence=_check_float(values.get("divergence"), "divergence", optional=True, low=0.0),
            fingerprint=_check_floats(values.get("fingerprint"), "fingerprint", MAX_FINGERPRINT),
            addrs=_check_addrs(values.get("addrs", [])),
            reachability=_check_reachability(values.get("reachability", Reachability.UNKNOWN)),
            direct_port=None
            if values.get("direct_port") is None
            else _check_int(values["direct_port"], "direct_port", 1, 65535),
            relays=_check_ids(values.get("relays", []), "relays", MAX_RELAYS),
            relay_budget=_check_int(values.get("relay_budget", 0), "relay_budget"),
            paths=_check_paths(values.get("paths", {})),
            verification=None
            if values.get("verification") is None
            else VerificationReport.from_wire(values["verification"]),
            updated=_check_float(values.get("updated", 0.0), "updated", low=0.0),  # type: ignore[arg-type]
            expires=expires,
        )
        if subkey is not None and subkey != record.peer_id:
            raise RecordError(f"record for {record.peer_id!r} filed under subkey {subkey!r}")
        if stage is not None and stage != record.stage:
            raise RecordError(f"record claims stage {record.stage} but is filed under stage {stage}")
        return record

    @property
    def serving(self) -> bool:
        """Whether others may route work to this peer."""
        return self.state == PeerState.ONLINE


@dataclass(frozen=True)
class ConfigRecord:
    """The swarm config as published by its founder (the bootstrapper)."""

    protocol_version: int
    config_hash: str
    config: dict[str, Any]
    software_version: str
    # filled in by the reader from the DHT entry, never sent: who signed this config, and the signed
    # envelope itself, which other peers re-publish verbatim (dht/signing.py)
    founder: str = field(default="", compare=False)
    envelope: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self, dict_factory=plain_dict)
        del wire["founder"], wire["envelope"]
        return wire

    @classmethod
    def from_wire(cls, raw: Any, *, founder: str = "", envelope: dict[str, Any] | None = None) -> ConfigRecord:
        if not isinstance(raw, Mapping):
            raise RecordError(f"config record: expected a map, got {type(raw).__name__}")
        missing = {"protocol_version", "config_hash", "config"} - set(raw)
        if missing:
            raise RecordError(f"config record: missing {sorted(missing)}")
        if not isinstance(raw["config"], Mapping):
            raise RecordError("config record: config is not a map")
        return cls(
            protocol_version=_check_int(raw["protocol_version"], "protocol_version"),
            config_hash=_check_str(raw["config_hash"], "config_hash", 64),
            config=dict(raw["config"]),
            software_version=_check_str(raw.get("software_version", ""), "software_version", 32),
            founder=founder,
            envelope=envelope,
        )


def _check_event_kind(value: Any) -> EventKind:
    try:
        return EventKind(_check_str(value, "kind", 32))
    except ValueError:
        raise RecordError(f"event kind {value!r} is not one of {[kind.value for kind in EventKind]}") from None


@dataclass(frozen=True)
class SwarmEvent:
    """Something peers want the dashboard to list: a rebuild, a ban, a failed gossip round.

    `peer_id` is the peer the event is about (a banned peer, a rebuilt stage's new owner);
    `reporter` is the peer that published it and signed it, filled in by the registry."""

    time: float
    kind: EventKind
    peer_id: str
    stage: int | None
    detail: str
    reporter: str = ""

    def to_wire(self) -> dict[str, Any]:
        return asdict(self, dict_factory=plain_dict)

    @classmethod
    def from_wire(cls, raw: Any) -> SwarmEvent:
        if not isinstance(raw, Mapping):
            raise RecordError(f"event: expected a map, got {type(raw).__name__}")
        stage = raw.get("stage")
        return cls(
            time=_check_float(raw.get("time"), "time", low=0.0),  # type: ignore[arg-type]
            kind=_check_event_kind(raw.get("kind")),
            peer_id=_check_str(raw.get("peer_id", ""), "peer_id", MAX_ID_CHARS),
            stage=None if stage is None else _check_int(stage, "stage", 0, 1024),
            detail=_check_str(raw.get("detail", ""), "detail", 512),
            reporter=_check_str(raw.get("reporter", ""), "reporter", MAX_ID_CHARS),
        )


def one_stage_per_peer(peers_by_stage: dict[int, list[PeerRecord]]) -> dict[int, list[PeerRecord]]:
    """Each peer at the stage of its newest record only. A peer that moved wrote `leaving` over its
    old stage's entry, but a DHT read can still return the old `online` entry (a replica that missed
    the overwrite) until it expires; the newer announcement says where the peer is now."""
    newest: dict[str, PeerRecord] = {}
    for records in peers_by_stage.values():
        for record in records:
            held = newest.get(record.peer_id)
            if held is None or (record.updated, record.expires) > (held.updated, held.expires):
                newest[record.peer_id] = record
    return {
        stage: [record for record in records if newest[record.peer_id] is record]
        for stage, records in peers_by_stage.items()
    }
