"""What spot-checks cost (docs/verification.md, "Costs").

    python tests/benchmarks/bench_verification.py [--rates 0 0.02] [--repeats 2] [--window 60]

1. In this process: CPU time of one check's answer (a block stage's forward plus the backward to its
   input) against one training forward+backward of the same stage, on the default model. A check
   asks two replicas (three on a disagreement), so at rate r the extra compute on a block stage is
   about 2 r x that ratio.
2. Multi-process: a 2-stage swarm on loopback (one stage-0 peer, three stage-1 replicas, random
   routing) at each rate in turn, repeated and interleaved (0, r, 0, r, ...) so the machine's load
   drifts over both alike; tokens/s from the stage-0 peer's optimizer steps over `--window` s after
   `--warmup` s. Prints every run with the load average beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from node.config import SwarmConfig  # noqa: E402
from node.monitor.observer import observe  # noqa: E402
from node.pipeline.spot_check import probe_direction  # noqa: E402
from node.pipeline.stage_worker import StageWorker  # noqa: E402
from node.pipeline.verifier import answer_check  # noqa: E402
from tests.helpers.swarms import make_swarm  # noqa: E402


def compute_ratio(reps: int = 30) -> tuple[float, float]:
    """(ms per training forward+backward, ms per check answer) of a block stage, best of `reps`."""
    torch.set_num_threads(1)
    config = SwarmConfig()
    t = config.training
    worker = StageWorker(config, 1)
    train, check = [], []
    for i in range(reps):
        hidden = torch.randn(t.microbatch_size, t.sequence_length, config.model.hidden_size)
        start = time.perf_counter()
        out = worker.forward(i, hidden)
        worker.backward(i, torch.randn_like(out))
        train.append(time.perf_counter() - start)
        probe = probe_direction(hidden.shape, torch.Generator().manual_seed(i))
        start = time.perf_counter()
        answer_check(worker, hidden, probe)
        check.append(time.perf_counter() - start)
    return 1000 * min(train), 1000 * min(check)


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
            return asyncio.run(_measure(swarm, warmup, window, tokens_per_microbatch)), os.getloadavg().__repr__()
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
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.02])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=60.0)
    args = parser.parse_args(argv)

    train_ms, check_ms = compute_ratio()
    print(
        f"block stage, default model, 1 thread: training forward+backward {train_ms:.2f} ms, check answer {check_ms:.2f} ms"
    )
    for rate in args.rates:
        print(
            f"  rate {rate}: ~{100 * 2 * rate * check_ms / train_ms:.1f} % extra block-stage compute (2 answers per check)"
        )
    results: dict[float, list[float]] = {rate: [] for rate in args.rates}
    for repeat in range(args.repeats):
        for rate in args.rates:
            tokens, load = swarm_tokens_per_second(rate, args.warmup, args.window)
            results[rate].append(tokens)
            print(f"run {repeat + 1}, rate {rate}: {tokens:,.0f} tokens/s (load average {load})", flush=True)
    base = sum(results[args.rates[0]]) / len(results[args.rates[0]])
    for rate, values in results.items():
        mean = sum(values) / len(values)
        print(f"rate {rate}: mean {mean:,.0f} tokens/s = {mean / base:.3f}x rate {args.rates[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
