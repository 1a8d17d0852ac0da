"""What spot-checks cost (docs/verification.md, "Costs").

    python tests/benchmarks/bench_verification.py [--presets tiny 15m 125m] [--repeats 5]
        [--swarm --rates 0 0.02 --swarm-repeats 2 --window 60]

1. Per check, in this process, one thread, on the CPU, for each model shape: a block stage's
   training forward+backward; the replica's commitment (its first for a weight version hashes the
   version's layers, later ones reuse the digests; a stage of several layers recomputes its inner
   boundaries) and its opening of one layer; the checker's verdict (codec and digest comparisons,
   the layer's replay in fp32); the bytes of each message as the wire encodes them, next to a hop's;
   what a receipt and a retained weight version hold; a whole check's latency over an in-memory wire.
2. The relative replay error of an honest layer computed in fp64 (an exact reference: the rounding
   of an fp32 replay alone), fp32, fp16 and bf16, and of faults (every Linear output x1.01, x1.05,
   x1.5): the margins of the tolerance, per shape.
3. `--swarm`: tokens/s of a 2-stage swarm on loopback (one stage-0 peer, three stage-1 replicas)
   at each rate in turn, interleaved (0, r, 0, r, ...) so the machine's load drifts over both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from node.config import Precision, SwarmConfig, VerificationConfig  # noqa: E402
from node.model.llama import build_stage  # noqa: E402
from node.model.presets import load_config  # noqa: E402
from node.monitor.observer import observe  # noqa: E402
from node.pipeline.check_wire import CommitmentReply  # noqa: E402
from node.pipeline.layer_replay import replay_layer  # noqa: E402
from node.pipeline.verdict import boundaries_to_open, judge  # noqa: E402
from node.stage.layers import LayerLayout, stage_boundaries  # noqa: E402
from node.stage.precision import StagePrecision  # noqa: E402
from protocol import Message, MessageKind, encode_message  # noqa: E402
from tests.helpers.check_harness import Swarm as CheckSwarm  # noqa: E402
from tests.helpers.faulty_node import FaultKind, make_faulty  # noqa: E402
from tests.helpers.swarms import make_swarm  # noqa: E402


def shape_config(preset: str) -> SwarmConfig:
    """The preset's block stage at its own training shape (tiny: the default config)."""
    if preset == "tiny":
        return SwarmConfig()
    return load_config(**{"model.preset": preset})


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


class Recorder:
    """Wraps a harness transport: the encoded size of every check message it carries."""

    def __init__(self, transport) -> None:
        self.sizes: dict[MessageKind, list[int]] = {}
        inner = transport.request

        async def request(peer_id: str, service: str, message: Message, timeout: float) -> Message:
            self._count(message)
            reply = await inner(peer_id, service, message, timeout)
            self._count(reply)
            return reply

        transport.request = request

    def _count(self, message: Message) -> None:
        self.sizes.setdefault(message.kind, []).append(len(encode_message(message, "fp16")))


def costs(preset: str, repeats: int) -> None:
    config = shape_config(preset)
    t = config.training
    layers = config.model.layers_per_stage
    swarm = CheckSwarm(config)
    replica = swarm.add("replica")
    worker, server = replica.worker, replica.server
    hidden = torch.randn(t.microbatch_size, t.sequence_length, config.model.hidden_size)
    recorder = Recorder(swarm.checker.transport)

    keys = iter(range(1 << 30))

    def train() -> None:
        key = ("bench", next(keys))
        out = worker.forward(key, hidden)
        worker.backward(key, 1e-3 * torch.randn_like(out))

    train_ms = best_ms(train, repeats)
    shape = (t.microbatch_size, t.sequence_length)
    observed = swarm.hop("replica", shape=shape)
    receipt = replica.keeper.book.get((observed.origin, observed.microbatch_id))
    assert receipt is not None and receipt.weights is not None

    async def commit(fresh_version: bool) -> Message:
        if fresh_version:
            receipt.weights.digests = None
        return await server._commit("checker", receipt, 1)

    first_ms = best_ms(lambda: asyncio.run(commit(True)), repeats)
    cached_ms = best_ms(lambda: asyncio.run(commit(False)), repeats)
    layout = LayerLayout(config.model)
    open_ms = best_ms(lambda: server.opened_layer(receipt.weights, 0), repeats)

    # the checker's verdict on one layer, from a real commitment and opening
    commitment_message = asyncio.run(commit(False))
    commitment = CommitmentReply.parse(commitment_message, layers)
    layer = layers // 2
    forward, backward = boundaries_to_open(layer, layers, observed, commitment.has_backward)
    open_meta = {
        "stage": 1,
        "commitment": commitment.commitment,
        "layer": layer,
        "forward": forward,
        "backward": backward,
    }
    opening = asyncio.run(server._open("checker", swarm.checker.transport.message(MessageKind.OPEN, open_meta)))
    checker = swarm.checker
    verdict_ms = best_ms(
        lambda: judge(
            layout, checker.tolerance, commitment, layer, opening.tensors, observed, checker.worker.transfers
        ),
        repeats,
    )
    latencies = []
    for _ in range(repeats):
        observed = swarm.hop("replica", shape=shape)
        start = time.perf_counter()
        assert swarm.check(observed) is not None
        latencies.append(time.perf_counter() - start)
    sizes = {kind: statistics.median(values) for kind, values in recorder.sizes.items()}
    peer = "12D3KooW" + "x" * 44  # a peer id's length
    meta = {
        "microbatch_id": 1 << 40,
        "origin": peer,
        "path": [peer, peer],
        "order": [1, 2],
        "hop": 2,
        "token": "0" * 16,
    }
    hop = len(encode_message(Message(MessageKind.FORWARD, "pipeswarm-demo", 1, 1, meta, {"hidden": hidden}), "fp16"))
    activation = hidden.numel() * 4
    version = layout.numel * layers * 4
    print(f"\n{preset}: block stage of {layers} layer(s), {layout.numel * layers:,} weights, "
          f"microbatch {t.microbatch_size} x {t.sequence_length} x {config.model.hidden_size}")  # fmt: skip
    print(f"  training forward+backward {train_ms:.1f} ms")
    print(f"  replica: commitment {cached_ms:.1f} ms ({first_ms:.1f} ms the first for a weight version), "
          f"opening {open_ms:.1f} ms")  # fmt: skip
    print(f"  checker: verdict on one layer {verdict_ms:.1f} ms; a whole check in process "
          f"{1000 * min(latencies):.1f} ms (best), {1000 * statistics.median(latencies):.1f} ms (median)")  # fmt: skip
    wire = ", ".join(f"{kind.value} {size / 1024:,.1f} KiB" for kind, size in sizes.items())
    total = sum(sizes.values())
    print(f"  bytes: {wire}; a check {total / 1024:,.1f} KiB = {total / hop:.1f} fp16 hops ({hop / 1024:,.1f} KiB)")
    print(f"  receipt: {4 * activation / 1024:,.1f} KiB per microbatch kept (4 activations, host); "
          f"a retained weight version {version / 2**20:,.1f} MiB (device)")  # fmt: skip


def tolerance_margins(preset: str) -> None:
    config = shape_config(preset)
    t = config.training
    torch.manual_seed(0)
    layout = LayerLayout(config.model)
    batch, seq = min(t.microbatch_size, 2), min(t.sequence_length, 512)
    results = []
    for label, precision, scale in (
        ("fp64", None, None),  # an exact reference: what any fp32 implementation's rounding adds
        ("fp32", Precision.FP32, None),
        ("fp16", Precision.FP16, None),
        ("bf16", Precision.BF16, None),
        ("x1.01", Precision.FP32, 1.01),
        ("x1.05", Precision.FP32, 1.05),
        ("x1.5", Precision.FP32, 1.5),
    ):
        stage = build_stage(dataclasses.replace(config.model, layers_per_stage=1), 1, config.seed)
        if scale is not None:
            make_faulty(stage, FaultKind.SCALE, scale=scale)
        hidden = torch.randn(batch, seq, config.model.hidden_size)
        grad = 1e-3 * torch.randn_like(hidden)
        if precision is None:  # the claim computed in fp64 and rounded to fp32, as a wire would carry it
            stage, hidden, grad = stage.double(), hidden.double(), grad.double()
        named = {name: p.detach() for name, p in stage.named_parameters()}
        computed = StagePrecision(precision or Precision.FP32, "cpu")
        forward, back = stage_boundaries(stage, layout, named, hidden, grad, computed)
        forward, back = [t.float() for t in forward], [t.float() for t in back]
        replayed = {name: weight.float() for name, weight in layout.of_stage(named, 0).items()}
        errors = replay_layer(layout, replayed, forward[0], forward[1], back[1], back[0])
        results.append(f"{label} {errors[0]:.1e}/{errors[1]:.1e}")
    print(f"  replay error (output/input gradient), one layer at {batch} x {seq}: " + ", ".join(results))


def swarm_tokens_per_second(rate: float, warmup: float, window: float) -> tuple[float, str]:
    config = SwarmConfig()
    t = config.training
    tokens_per_microbatch = t.microbatch_size * t.sequence_length
    with tempfile.TemporaryDirectory(prefix="bench-verification-") as tmp:
        workdir = Path(tmp)
        (workdir / "swarm.toml").write_text(f'[training]\nrouting = "random"\n[verification]\nrate = {rate}\n')
        swarm = make_swarm(workdir)
        try:
            swarm.bootstrap("--config", str(workdir / "swarm.toml"), "--num-stages", "2", timeout=120.0)
            swarm.join("stage0", "--stage", "0", "--threads", "1", "--quiet")
            for i in range(3):
                swarm.join(f"replica{i}", "--stage", "1", "--threads", "1", "--quiet")
            return asyncio.run(_measure(swarm, warmup, window, tokens_per_microbatch)), repr(os.getloadavg())
        finally:
            swarm.close()


async def _measure(swarm, warmup: float, window: float, tokens_per_microbatch: int) -> float:
    async with observe(swarm.initial_peers, None) as observer:
        deadline = time.monotonic() + 180.0
        while time.monotonic() < deadline:
            snapshot = await observer.snapshot()
            if sum(p["state"] == "online" for s in snapshot["stages"] for p in s["peers"]) == 4:
                break
            await asyncio.sleep(1.0)
        else:
            raise RuntimeError("the swarm did not come online")
        await asyncio.sleep(warmup)

        async def stage0_microbatches() -> tuple[float, int]:
            for _ in range(30):
                peers = [p for p in (await observer.snapshot())["stages"][0]["peers"] if p["state"] == "online"]
                if peers:
                    return time.monotonic(), peers[0]["microbatches"]
                await asyncio.sleep(1.0)
            raise RuntimeError("no stage-0 record")

        t0, done0 = await stage0_microbatches()
        await asyncio.sleep(window)
        t1, done1 = await stage0_microbatches()
        return (done1 - done0) * tokens_per_microbatch / (t1 - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "15m", "125m"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--swarm", action="store_true", help="also measure a live swarm's tokens/s per rate")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.02])
    parser.add_argument("--swarm-repeats", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=60.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"defaults: {VerificationConfig()}")
    for preset in args.presets:
        costs(preset, args.repeats)
        tolerance_margins(preset)
    if not args.swarm:
        return 0
    results: dict[float, list[float]] = {rate: [] for rate in args.rates}
    for repeat in range(args.swarm_repeats):
        for rate in args.rates:
            tokens, load = swarm_tokens_per_second(rate, args.warmup, args.window)
            results[rate].append(tokens)
            print(f"run {repeat + 1}, rate {rate}: {tokens:,.0f} tokens/s (load average {load})", flush=True)
    base = statistics.mean(results[args.rates[0]])
    for rate, values in results.items():
        print(f"rate {rate}: mean {statistics.mean(values):,.0f} tokens/s = {statistics.mean(values) / base:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
