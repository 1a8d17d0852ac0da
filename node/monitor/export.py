"""`node export`: collect every stage's current weights from live peers and write a Hugging Face
checkpoint (node/model/hf.py).

The exporter is a client-mode peer like the observer: it reads the swarm's signed config, picks an
online peer of each stage and downloads that stage's weights and outer state (part "weights": no
optimizer moments) over the same "state" session a joiner uses (node/recovery/state_transfer.py:
sizes checked against the config's shapes before anything is allocated, a checksum over the
payload, another donor when one fails). Nothing is unpickled.

Which weights: with gossip on, a peer's state carries NoLoCo's outer weights phi (the replicas'
slowly averaged consensus, docs/gossip.md) beside its own inner weights theta; phi is what the
swarm has agreed on, so it is exported. Without gossip, or before the stage's first outer round
(when phi is still the initial weights), theta is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dht.records import PeerState, short_peer_id
from dht.registry import SwarmRegistry, swarm_key_of
from node.config import SwarmConfig
from node.model.hf import stage_shapes
from node.p2p.dialer import PeerDialer
from node.p2p.network import start_network
from node.p2p.transport import Transport, TransportError
from node.recovery.state_transfer import download_from_any
from node.runtime.byte_progress import ByteProgress
from node.server.daemon import check_compatible, find_swarm
from protocol.stage_state import StageState, StatePart

OUTER_WEIGHTS_PREFIX = "phi."  # node/averaging/outer_replica.py: export_outer's names for phi
NO_STAGE = -1  # the exporter serves no stage (protocol/messages.py allows -1 as sender_stage)


class WeightsKind(StrEnum):
    """Which of a peer's weights were exported for a stage."""

    OUTER = "outer"  # NoLoCo's phi
    INNER = "inner"  # the peer's own current weights


class ExportRefused(RuntimeError):
    """The swarm cannot be exported now (a stage without a live peer, every donor failed)."""


@dataclass
class Collected:
    config: SwarmConfig
    stages: dict[int, dict[str, Any]] = field(default_factory=dict)  # stage -> name -> tensor
    provenance: list[dict[str, Any]] = field(default_factory=list)


def weights_of(state: StageState) -> tuple[dict[str, Any], WeightsKind]:
    """The weights to export from a downloaded state: phi when the state holds a complete one that
    an outer round has made (before the first round phi is still the initial weights)."""
    if state.outer_round < 1:
        return dict(state.weights), WeightsKind.INNER
    outer = {
        name[len(OUTER_WEIGHTS_PREFIX) :]: tensor
        for name, tensor in state.outer.items()
        if name.startswith(OUTER_WEIGHTS_PREFIX)
    }
    if outer and set(outer) == set(state.weights):
        return outer, WeightsKind.OUTER
    return dict(state.weights), WeightsKind.INNER


async def collect_stages(
    initial_peers: Sequence[str],
    swarm_id: str | None = None,
    founder: str | None = None,
    swarm_key: bytes | None = None,
    find_timeout: float = 20.0,
    timeout: float = 60.0,
    attempts: int = 3,
    progress: ByteProgress | None = None,
) -> Collected:
    """Download every stage's state from one of its online peers (up to `attempts` donors each).
    Raises ExportRefused when a stage has no online peer or none of its donors delivers, and
    JoinRefused / NetworkError as `node status` does when the swarm cannot be read. `progress`
    shows each stage's download in bytes."""
    network = await start_network(initial_peers=initial_peers, client_mode=True, swarm_key=swarm_key)
    transport: Transport | None = None
    try:
        record = await find_swarm(network, swarm_id, find_timeout, founder)
        config = check_compatible(record)
        peers = await SwarmRegistry(network.dht, config.swarm_id).all_peers(config.num_stages)
        online = {
            stage: [p for p in peers.get(stage, []) if p.state == PeerState.ONLINE]
            for stage in range(config.num_stages)
        }
        missing = [stage for stage, found in online.items() if not found]
        if missing:
            raise ExportRefused(
                f"stage{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of swarm {config.swarm_id} "
                "has no live peer: its weights exist nowhere to export"
            )
        addresses = {p.peer_id: p.addrs for found in online.values() for p in found}
        transport = Transport(
            network.p2p,
            config.swarm_id,
            NO_STAGE,
            swarm_key=swarm_key_of(network.dht),
            dialer=PeerDialer(network.p2p, lambda peer_id: addresses.get(peer_id, ())),
        )
        collected = Collected(config)
        rng = random.Random()
        for stage, candidates in online.items():
            try:
                state = await download_from_any(
                    transport,
                    candidates,
                    stage,
                    StatePart.WEIGHTS,
                    rng,
                    attempts,
                    timeout=timeout,
                    expect=stage_shapes(config.model, stage),
                    progress=progress,
                )
            except TransportError as e:
                raise ExportRefused(str(e)) from None
            weights, kind = weights_of(state)
            collected.stages[stage] = weights
            collected.provenance.append(
                {
                    "stage": stage,
                    "peer": state.donor,
                    "weights": str(kind),
                    "inner_step": state.inner_step,
                    "outer_round": state.outer_round,
                }
            )
        return collected
    finally:
        if transport is not None:
            await transport.close()
        await network.shutdown()


def describe(collected: Collected) -> str:
    """One line per stage: where its weights came from."""
    return "\n".join(
        f"  stage {p['stage']}: {p['weights']} weights of {short_peer_id(p['peer'] or '?')} "
        f"(inner step {p['inner_step']}, outer round {p['outer_round']})"
        for p in collected.provenance
    )


__all__ = ["Collected", "ExportRefused", "WeightsKind", "collect_stages", "describe", "weights_of"]
