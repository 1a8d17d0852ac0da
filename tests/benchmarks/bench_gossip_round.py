"""One NoLoCo round measured live on loopback, N = 2, 4, 8 replicas, beside the link model.

Not a test: a script that prints a table and writes sync_scaling_live.json (`make results` puts it
in docs/results/, where node/simulate/report.py prints it beside the modelled sync-scaling table).

    python tests/benchmarks/bench_gossip_round.py [--replicas 2 4 8] [--rounds 5] [--hidden 384] \
        [--layers 2] [--out DIR]

For each N: a fresh swarm of N real peers of stage 1 (each its own p2pd and DHT node, one process,
tests/helpers/inprocess_swarm.py), running the project's gossip code (node/averaging/). A swarm
round: every replica moves its weights by seeded noise and counts RIPE inner steps (a stand-in for
training, as tests/swarm/test_gossip.py does), then all N call `Gossip.run_round` at once, as the
round loop would when H is reached together. A replica that finds every partner busy retries after
the round loop's random pause; it is done once it has stepped, as initiator (APPLIED) or as a
partner (its round counter moved). Whoever is left alone when everyone else has stepped takes the
lone step (n = 1), as the loop does after round_timeout. Measured: wall seconds from the start until
every replica has stepped, and each applied exchange; medians over `--rounds` swarm rounds. Then
`--rounds` solo exchanges: one replica's round while the others idle (one pair on the host).

The model beside it is node/simulate/collectives.py under a link measured on the same loopback
between two of the peers: latency = half the median round trip of a small message on an open
stream; bandwidth = 2 x payload / (median time to swap phi and Delta both ways at once - latency),
with the gossip's own chunked tensor stream. So "model" is what the transfer alone would cost; the
live round adds the handshake, the partner checks and the outer step (compute), and on one host the
N peers share the machine's cores and loopback, which a real swarm of N homes does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from node.averaging.gossip import Gossip  # noqa: E402
from node.averaging.gossip_wire import GOSSIP_CHUNKS, GOSSIP_COMPRESSION  # noqa: E402
from node.averaging.outer_replica import STEPPED, RoundStatus  # noqa: E402
from node.config import read_config  # noqa: E402
from node.p2p.tensor_stream import Session  # noqa: E402
from node.p2p.transport import Transport  # noqa: E402
from node.simulate.collectives import noloco_round_seconds, tree_allreduce_seconds  # noqa: E402
from node.simulate.links import LinkModel  # noqa: E402
from node.simulate.report import live_sync_lines  # noqa: E402
from protocol import MessageKind  # noqa: E402
from tests.helpers.inprocess_swarm import inprocess_swarm  # noqa: E402

H = 1000  # the round loop waits for H inner steps: never reached, rounds are started here
RIPE = 600  # inner steps counted per swarm round (>= H / 2: enough to answer a partner)
ROUND_DEADLINE = 120.0  # seconds one swarm round may take before the run is declared failed
PROBE_SERVICE = "bench-link"
PROBE_REPS = 7


def config_for(hidden: int, layers: int, round_timeout: float = 30.0):
    return read_config(
        None,
        swarm_id="bench-gossip-round",
        num_stages=2,
        **{
            "model.hidden_size": hidden,
            "model.intermediate_size": 2 * hidden,
            "model.layers_per_stage": layers,
            "gossip.inner_steps": H,
            "gossip.round_timeout": round_timeout,
            "heartbeat.period": 1.0,
            "heartbeat.ttl": 10.0,
        },
    )


def payload_bytes(gossip: Gossip) -> int:
    """fp32 bytes of one replica's parameters: one of phi or Delta."""
    return 4 * sum(p.numel() for p in gossip.worker.module.parameters())


async def train_a_little(gossip: Gossip, seed: int) -> None:
    def move() -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in gossip.worker.module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)

    await gossip.worker.compute(move)
    gossip.worker.inner_step += RIPE


async def swarm_round(gossips: list[Gossip], rng: random.Random) -> dict:
    """Every replica steps once: the seconds that took, the seconds of each applied exchange (from
    the initiator's request to its outer step), busy retries and lone steps."""
    rounds_before = [g.outer_state.round for g in gossips]

    def stepped(i: int) -> bool:
        return gossips[i].outer_state.round > rounds_before[i]

    busy = lone = 0
    exchanges: list[float] = []  # seconds of each initiated run_round that ended APPLIED

    async def one(i: int) -> None:
        nonlocal busy, lone
        while not stepped(i):
            if gossips[i].pairwise.exchanging:  # serving a partner's request right now
                await asyncio.sleep(0.01)
                continue
            everyone_else = all(stepped(j) for j in range(len(gossips)) if j != i)
            began = time.monotonic()
            outcome = await gossips[i].run_round(alone_if_no_partner=everyone_else)
            if outcome.status == RoundStatus.APPLIED:
                exchanges.append(time.monotonic() - began)
            elif outcome.status == RoundStatus.LONE:
                lone += 1
            elif outcome.status not in STEPPED and not stepped(i):
                if outcome.status in (RoundStatus.ABORTED, RoundStatus.REJECTED):
                    raise RuntimeError(f"replica {i}: round {outcome.status.value}: {outcome.detail}")
                busy += 1
                await asyncio.sleep(rng.uniform(0.2, 1.0))  # the round loop's pause after a busy try

    def failures() -> int:
        return sum(g.rounds.outcomes[RoundStatus.ABORTED] + g.rounds.outcomes[RoundStatus.REJECTED] for g in gossips)

    failed_before = failures()
    began = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(gossips)))), ROUND_DEADLINE)
    # a last replica's failed exchange ends in its lone step (PairwiseRound.run): still a failure here
    if (failed := failures() - failed_before) > 0:
        history = [
            o for g in gossips for o in g.rounds.history if o.status in (RoundStatus.ABORTED, RoundStatus.REJECTED)
        ]
        raise RuntimeError(f"{failed} exchange(s) failed: {history[-1].detail}")
    return {"seconds": time.monotonic() - began, "exchanges": exchanges, "busy_retries": busy, "lone_steps": lone}


async def see_each_other(peers, timeout: float = 60.0) -> None:
    """Until every peer's swarm view lists all the others online: a partner missing from a view
    would make its round a lone step that says nothing about the exchange."""
    deadline = time.monotonic() + timeout
    while True:
        for peer in peers:
            await peer.me.announce_now()
        for peer in peers:
            await peer.service.view.refresh()
        seen = [len(peer.service.view.online(1, exclude=peer.me.peer_id)) for peer in peers]
        if min(seen) == len(peers) - 1:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"after {timeout:.0f} s the peers' views list {seen} others, not {len(peers) - 1}")
        await asyncio.sleep(0.5)


async def measure_link(a, b, config) -> LinkModel:
    """Loopback latency and bandwidth between two peers, with the gossip's own tensor stream."""
    tensors = [torch.randn(p.shape) for p in a.service.gossip.worker.module.parameters()] * 2  # phi and Delta
    server = Transport(b.network.p2p, config.swarm_id, 1, compression=GOSSIP_COMPRESSION)
    client = Transport(a.network.p2p, config.swarm_id, 1, compression=GOSSIP_COMPRESSION)

    async def echo(sender, reader, writer) -> None:
        session = Session(server, reader, writer, timeout=60.0, compression=GOSSIP_COMPRESSION)
        with contextlib.suppress(Exception):  # the client closes the stream when it is done
            for _ in range(PROBE_REPS):
                await session.send(await session.recv())
            for _ in range(PROBE_REPS):
                buffers = [torch.empty_like(t) for t in tensors]
                await asyncio.gather(
                    GOSSIP_CHUNKS.send(session, tensors, {"round": 0}), GOSSIP_CHUNKS.receive(session, buffers)
                )

    await server.serve_sessions(PROBE_SERVICE, echo)
    try:
        async with client.session(b.network.peer_id, PROBE_SERVICE, 30.0) as (reader, writer):
            session = Session(client, reader, writer, timeout=60.0, compression=GOSSIP_COMPRESSION)
            round_trips, swaps = [], []
            for _ in range(PROBE_REPS):
                began = time.monotonic()
                await session.send(client.message(MessageKind.PING))
                await session.recv()
                round_trips.append(time.monotonic() - began)
            for _ in range(PROBE_REPS):
                buffers = [torch.empty_like(t) for t in tensors]
                began = time.monotonic()
                await asyncio.gather(
                    GOSSIP_CHUNKS.send(session, tensors, {"round": 0}), GOSSIP_CHUNKS.receive(session, buffers)
                )
                swaps.append(time.monotonic() - began)
    finally:
        await server.close()
        await client.close()
    latency = statistics.median(round_trips) / 2
    nbytes = sum(t.numel() * 4 for t in tensors)  # phi + Delta, sent each way at once
    return LinkModel(latency_s=latency, bandwidth_bytes_per_s=nbytes / max(statistics.median(swaps) - latency, 1e-6))


async def solo_exchange(gossips: list[Gossip], r: int, seed: int) -> float:
    """One exchange with a random partner while every other replica is idle: the cost of one NoLoCo
    round for one replica, without the other pairs sharing the host."""
    deadline = time.monotonic() + ROUND_DEADLINE
    while any(g.pairwise.exchanging for g in gossips):  # the last responders of the swarm round finishing
        if time.monotonic() > deadline:
            raise RuntimeError("replicas still exchanging long after the swarm round")
        await asyncio.sleep(0.05)
    # only the pair trains: the others' counters stay below H, so no round loop starts one meanwhile
    initiator, partner = random.Random(seed * 1000 + r).sample(gossips, 2)
    for i, gossip in enumerate((initiator, partner)):
        await train_a_little(gossip, seed * 1000 + 500 + r * 16 + i)
    began = time.monotonic()
    outcome = await initiator.run_round(partner=partner.me.peer_id)
    if outcome.status != RoundStatus.APPLIED:
        raise RuntimeError(f"a solo exchange ended {outcome.status.value}: {outcome.detail}")
    return time.monotonic() - began


async def measure(n: int, rounds: int, config, seed: int) -> dict:
    rng = random.Random(seed)
    async with inprocess_swarm(config, [1] * n) as peers:
        gossips = [peer.service.gossip for peer in peers]
        await see_each_other(peers)
        link = await measure_link(peers[0], peers[1], config)
        results = []
        for r in range(rounds):
            await see_each_other(peers)
            for i, gossip in enumerate(gossips):
                await train_a_little(gossip, seed * 1000 + r * 16 + i)
            results.append(await swarm_round(gossips, rng))
            print(f"  N={n} round {r + 1}/{rounds}: {results[-1]['seconds']:.2f} s", flush=True)
        solos = [await solo_exchange(gossips, r, seed) for r in range(rounds)]
    nbytes = payload_bytes(gossips[0])
    seconds = [r["seconds"] for r in results]
    exchanges = [x for r in results for x in r["exchanges"]]
    return {
        "replicas": n,
        "rounds": rounds,
        "live_seconds_median": statistics.median(seconds),
        "live_seconds_min": min(seconds),
        "live_seconds_max": max(seconds),
        "exchange_seconds_median": statistics.median(exchanges),
        "exchanges": len(exchanges),
        "solo_exchange_seconds_median": statistics.median(solos),
        "busy_retries": sum(r["busy_retries"] for r in results),
        "lone_steps": sum(r["lone_steps"] for r in results),
        "payload_bytes": nbytes,
        "link": f"{link.latency_s * 1000:.2f} ms one way, {link.bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s",
        "link_latency_ms": link.latency_s * 1000,
        "link_mbit": link.bandwidth_bytes_per_s * 8 / 1e6,
        "model_noloco_seconds": noloco_round_seconds(n, nbytes, link),
        "model_tree_seconds": tree_allreduce_seconds(n, nbytes, link),
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    config = config_for(args.hidden, args.layers)
    rows: list[dict] = []
    loadavg = os.getloadavg()  # before the peers start: what else the machine was doing
    for n in args.replicas:
        if n < 2:
            raise SystemExit(f"need at least 2 replicas, got {n}")
        print(f"N={n}: starting {n} peers", flush=True)
        rows.append(asyncio.run(measure(n, args.rounds, config, args.seed)))
    return {
        "experiment": "sync-scaling-live",
        "hidden": args.hidden,
        "layers": args.layers,
        "payload_bytes": rows[0]["payload_bytes"] if rows else 0,
        "cpus": os.cpu_count(),
        "loadavg": loadavg,
        "rows": rows,
    }


def format_report(result: dict) -> str:
    """The table and reading docs/results.md shows (node/simulate/report.py renders both)."""
    return "\n".join(live_sync_lines(result))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8], help="swarm sizes N to measure")
    parser.add_argument("--rounds", type=int, default=5, help="swarm rounds per N (the median is reported)")
    parser.add_argument("--hidden", type=int, default=384, help="model width of the stage that gossips")
    parser.add_argument("--layers", type=int, default=2, help="layers of the stage that gossips")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", help="directory to write sync_scaling_live.json into")
    args = parser.parse_args(argv)
    result = run(args)
    print(format_report(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sync_scaling_live.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
