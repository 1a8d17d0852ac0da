"""A snapshot of the swarm read from the DHT: the data behind `node status` and the dashboard."""

from __future__ import annotations

import functools
import time
from enum import StrEnum
from typing import Any

from dht.records import ConfigRecord, PeerRecord, PeerState
from dht.registry import SwarmRegistry
from node import __version__
from node.config import SwarmConfig, synthetic_source
from node.model.data import open_source
from node.model.memory import estimate_stage_memory, format_bytes
from node.model.parameters import count_parameters
from node.model.presets import preset_of
from node.recovery.checkfree import unrecoverable
from node.recovery.lost_stages import lost_stages_from_events


@functools.lru_cache(maxsize=8)
def stage_requirements(config: SwarmConfig) -> tuple[dict[str, int], ...]:
    """Per stage: its parameters and the memory one of its peers needs, by part (node/model/memory.py)."""
    return tuple(estimate_stage_memory(config, stage).to_dict() for stage in range(config.num_stages))


@functools.lru_cache(maxsize=8)
def loss_floor(config: SwarmConfig) -> float | None:
    """The best mean loss on the swarm's embedded source, when it trains on one (nats/token): the
    chain's floor over training.sequence_length targets (node/model/synthetic.py)."""
    if synthetic_source(config.data.source) is None or config.data.tokenizer_hash:  # prepared data: unknown
        return None
    return open_source(config, None, 0).loss_floor


class StageStatus(StrEnum):
    """How well a stage is served. A StrEnum so that snapshots stay plain JSON strings."""

    OK = "ok"  # two or more peers serve it
    SINGLE = "single"  # one peer: losing it loses the stage
    EMPTY = "empty"  # no peer serves it: the pipeline is cut here
    REBUILDING = "rebuilding"  # a peer is rebuilding it from its neighbours
    LOST = "lost"  # the peers declared it lost (no live peer for over recovery.lost_grace)
    UNRECOVERABLE = "unrecoverable"  # lost together with stages it cannot be rebuilt without


def stage_status(peers: list[PeerRecord], lost: bool = False, unrecoverable: bool = False) -> StageStatus:
    """The status of one stage from its peers; `lost` and `unrecoverable` come from the swarm's
    events (node/recovery/lost_stages.py) because a lost stage has no peer left to say so."""
    if lost:
        return StageStatus.UNRECOVERABLE if unrecoverable else StageStatus.LOST
    serving = [peer for peer in peers if peer.state in (PeerState.ONLINE, PeerState.JOINING, PeerState.REBUILDING)]
    if any(peer.state == PeerState.REBUILDING for peer in serving):
        return StageStatus.REBUILDING
    if not serving:
        return StageStatus.EMPTY
    return StageStatus.SINGLE if len(serving) == 1 else StageStatus.OK


def accusations(records: list[PeerRecord]) -> dict[str, dict[str, float]]:
    """Per accused peer, from the spot-check reports in every record (node/pipeline/verifier.py):
    the strikes other peers hold against it (summed) and how many of them banned it."""
    found: dict[str, dict[str, float]] = {}
    for record in records:
        report = record.verification
        if report is None:
            continue
        for peer_id, strikes in report.strikes.items():
            found.setdefault(peer_id, {"strikes": 0.0, "banned_by": 0})["strikes"] += strikes
        for peer_id in report.bans:
            found.setdefault(peer_id, {"strikes": 0.0, "banned_by": 0})["banned_by"] += 1
    return found


def peer_view(peer: PeerRecord, accused: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """One peer as it appears in a snapshot: its wire record, when that record expires, and the
    strikes and spot-check bans other peers report against it."""
    against = (accused or {}).get(peer.peer_id, {"strikes": 0.0, "banned_by": 0})
    return {**peer.to_wire(), "expires": peer.expires, "strikes": against["strikes"], "banned_by": against["banned_by"]}


async def collect_snapshot(registry: SwarmRegistry, record: ConfigRecord, config: SwarmConfig) -> dict[str, Any]:
    """Everything the DHT says about the swarm now, as plain JSON-able data."""
    peers_by_stage = await registry.all_peers(config.num_stages)
    events = await registry.fetch_events()
    recovery = config.recovery
    lost = lost_stages_from_events(peers_by_stage, events, config.num_stages)
    unrecoverable_reason = (
        unrecoverable(lost, config.num_stages, recovery.strategy, recovery.checkfree_plus) if lost else None
    )
    requirements = stage_requirements(config)
    accused = accusations([peer for peers in peers_by_stage.values() for peer in peers])
    stages = []
    for stage in range(config.num_stages):
        peers = peers_by_stage.get(stage, [])
        memory = requirements[stage]
        stages.append(
            {
                "stage": stage,
                "status": stage_status(peers, stage in lost, unrecoverable_reason is not None).value,
                "throughput": sum(peer.throughput for peer in peers if peer.state != PeerState.LEAVING),
                "parameters": memory["parameters"],
                # bytes one peer of this stage needs, by part and in total
                "memory": {name: value for name, value in memory.items() if name not in ("stage", "parameters")},
                "peers": [peer_view(peer, accused) for peer in peers],
            }
        )
    return {
        "time": time.time(),
        "swarm_id": config.swarm_id,
        "num_stages": config.num_stages,
        "protocol_version": record.protocol_version,
        "config_hash": record.config_hash,
        "software_version": __version__,
        "model_parameters": count_parameters(config.model, config.num_stages),
        "model_preset": preset_of(config.model, config.num_stages),  # None: a shape of no preset
        "loss_floor": loss_floor(config),
        "stages": stages,
        "lost_stages": sorted(lost),
        "unrecoverable": unrecoverable_reason,  # why the swarm cannot recover now, or None
        "events": [event.to_wire() for event in events],
    }


def format_table(snapshot: dict[str, Any]) -> str:
    """The human form of `node status`: one line per peer under its stage."""
    preset = snapshot.get("model_preset")
    model = f"model {snapshot['model_parameters']:,} params" + (f" (preset {preset})" if preset else "")
    lines = [
        f"swarm {snapshot['swarm_id']}: {snapshot['num_stages']} stages, {model}, config {snapshot['config_hash']}"
    ]
    if snapshot.get("unrecoverable"):
        lines.append(f"UNRECOVERABLE: {snapshot['unrecoverable']}")
    for stage in snapshot["stages"]:
        lines.append(
            f"stage {stage['stage']}: {stage['status']}, {len(stage['peers'])} peer(s), "
            f"throughput {stage['throughput']:.2f}, {stage['parameters']:,} params, "
            f"{format_bytes(stage['memory']['total'])} per peer"
        )
        for peer in stage["peers"]:
            loss = "-" if peer["loss"] is None else f"{peer['loss']:.3f}"
            # held-out loss, and the inner step it was measured at (stage 0, node/pipeline/validation.py)
            val = "" if peer.get("val_loss") is None else f"val {peer['val_loss']:.3f} @{peer['val_step']} "
            suspicion = ""
            if peer.get("strikes") or peer.get("banned_by"):
                suspicion = f" strikes {peer['strikes']:.1f}, banned by {peer['banned_by']}"
            lines.append(
                f"  {peer['peer_id'][-12:]}  {peer['state']:<10} step {peer['inner_step']:<6} "
                f"round {peer['outer_round']:<4} loss {loss:<7} {val}v{peer['version']} {peer['name']}{suspicion}"
            )
    return "\n".join(lines)
