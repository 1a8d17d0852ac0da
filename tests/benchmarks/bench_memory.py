"""One peer's memory per stage: node/model/memory.py's estimate against a measured peak, and the
tables of docs/model.md ("Presets", "Memory per peer") written from the code.

    python tests/benchmarks/bench_memory.py                  # measure every case, then rewrite the tables
    python tests/benchmarks/bench_memory.py --estimate-only  # rewrite the tables from the code and the
                                                              # recorded measurements (seconds, no torch work)
    python tests/benchmarks/bench_memory.py --device cuda    # on a GPU: torch.cuda.max_memory_allocated
    python tests/benchmarks/bench_memory.py --case 125m:1 --in-flight 4 --rounds 4   # one case, JSON on stdout

A case is a preset and a stage (`15m:0`, `125m:1`, ...), run in a fresh process (`--case`) so that
its peak is its own. That process runs a real StageWorker of the stage at the preset's training shape
(microbatch_size x sequence_length tokens a microbatch) with `max_stored` = the window, as
build_service gives it, plus the state a serving peer holds beside it: the OuterReplica (phi,
momentum), and on stage 1 the CheckFree+ edge copy of stage 0's embedding. It then trains:

  1. fill the window: F forwards (stage 0: F embeddings and F losses, so that every microbatch's
     head gradients are alive at once, the worst case the estimate counts);
  2. `rounds` times: the oldest microbatch's backward, a new forward (optimizer steps when the
     worker's step size says so, stashed weight copies as it makes them);
  3. a NoLoCo round's copies at a full window: capture theta and Delta, a partner's phi and Delta
     (fresh fp32 tensors, as the wire delivers them), one more backward and forward while they are
     alive, the outer step and its apply;
  4. the remaining backwards.

Measured: on CPU the peak resident set (getrusage's ru_maxrss) minus the resident set of the same
process after importing torch and this project, before anything was built; on CUDA
torch.cuda.max_memory_allocated (the allocator's peak, without its cache or the CUDA context).
Wire buffers and the asyncio side of a peer are not part of it. The results are recorded in
docs/model-memory.json, which --estimate-only and tests/unit/test_memory_tables.py read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from node.model.memory_tables import MeasuredCase, generated_tables, replace_generated  # noqa: E402

MODEL_DOC = REPO / "docs" / "model.md"
MEASUREMENTS_PATH = REPO / "docs" / "model-memory.json"  # the records --estimate-only and the test read


@dataclass(frozen=True)
class Case:
    """A stage of a preset, trained at `in_flight` microbatches in flight for `rounds` rounds, in
    `precision` (None: what training.precision resolves to on the device)."""

    preset: str
    stage: int
    in_flight: int
    rounds: int
    precision: str | None = None


# the real per-microbatch shape of each preset (2048 tokens); 125m's window is cut to 4 (its floor,
# min_in_flight) on CPU because its stages need GBs and minutes per microbatch on two cores: the
# estimate is compared at the window actually run. bf16 on a CPU is slow (no bf16 matmul units
# here) but checks the half-precision model where no GPU is at hand
CPU_CASES = (
    Case("15m", 0, 16, 8),
    Case("15m", 1, 16, 8),
    Case("125m", 0, 4, 4),
    Case("125m", 1, 4, 4),
    Case("15m", 1, 4, 2, "bf16"),
)
GPU_CASES = (Case("15m", 0, 16, 8), Case("15m", 1, 16, 8), Case("125m", 0, 16, 8), Case("125m", 1, 16, 8))


def resident_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def warm_up_the_runtime(torch, device: str) -> None:
    """What any peer's process holds before its stage exists: torch's lazily imported optimizer and
    autograd code (the first AdamW alone costs ~70 MiB of resident Python and native code) and the
    kernels' first allocations. Part of the baseline, as the idle process is: no estimate counts it."""
    weight = torch.nn.Parameter(torch.randn(8, 8, device=device))
    optimizer = torch.optim.AdamW([weight])
    (weight @ weight).sum().backward()
    optimizer.step()
    del weight, optimizer


def measure_case(case: Case, device: str) -> dict:
    """Train one stage as the module docstring says; the measured peak and what it ran."""
    import torch

    from node.averaging.gossip_codec import PhiDither
    from node.averaging.outer_replica import OuterReplica
    from node.model.presets import load_config
    from node.recovery.edge_copies import edge_copies_for
    from node.stage.access import live_parameters
    from node.stage.stage_worker import StageWorker
    from protocol.stage_state import PART_KEYS, StageState

    cuda = device.startswith("cuda")
    warm_up_the_runtime(torch, device)

    def in_use() -> int:
        """What the device holds now: the allocator's live bytes on CUDA, the resident set on CPU."""
        return torch.cuda.memory_allocated(device) if cuda else resident_bytes()

    baseline = in_use()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    preset, stage, in_flight, rounds = case.preset, case.stage, case.in_flight, case.rounds
    config = load_config(**{"model.preset": preset, "training.precision": case.precision})
    m, t = config.model, config.training
    started = time.monotonic()
    worker = StageWorker(config, stage, device=device, max_stored=in_flight)
    replica = OuterReplica(live_parameters(worker), config.gossip)
    edge_copies = edge_copies_for(config.recovery, config.num_stages, stage)
    if edge_copies is not None:  # copies of stage 0's parts, kept on the stage's device (node/recovery/edge_copies.py)
        shapes = {"embed_tokens.weight": (m.vocab_size, m.hidden_size), "norm.weight": (m.hidden_size,)}
        shapes["lm_head.weight"] = (m.vocab_size, m.hidden_size)
        for part in edge_copies.parts:
            weights = {name: torch.randn(shapes[name], device=device) for name in PART_KEYS[part]}
            edge_copies.update(part, StageState(stage=0, weights=weights))
    gen = torch.Generator().manual_seed(stage)
    batch, seq = t.microbatch_size, t.sequence_length
    phases: dict[str, int] = {"built": in_use()}

    def tokens() -> torch.Tensor:
        return torch.randint(0, m.vocab_size, (batch, seq), generator=gen)

    def hidden() -> torch.Tensor:
        return torch.randn(batch, seq, m.hidden_size, generator=gen)

    def start(key: int) -> None:
        if stage == 0:
            worker.embed(key, tokens())
            worker.head_loss_backward(key, hidden(), tokens())
        else:
            worker.forward(key, hidden())

    def finish(key: int) -> None:
        if stage == 0:
            worker.embed_backward(key, hidden() * 1e-3)
        else:
            worker.backward(key, hidden() * 1e-3)

    keys = list(range(in_flight))
    for key in keys:
        start(key)
    phases["window full"] = in_use()
    next_key = in_flight
    for _ in range(rounds):
        finish(keys.pop(0))
        start(next_key)
        keys.append(next_key)
        next_key += 1
    phases["steady"] = in_use()
    round_start = replica.capture_start(worker.inner_step, PhiDither(0))  # theta, Delta, the encoded wire
    # the partner's tensors as a round receives them: host buffers, decoded onto the device
    buffers = replica.host_buffers(True)
    for buffer, sent in zip(buffers, round_start.wire):
        buffer.copy_(sent)
    partner_phi, partner_delta, _edge_share = replica.receive(buffers, round_start)
    finish(keys.pop(0))  # training goes on during a round
    start(next_key)
    keys.append(next_key)
    new_state = replica.pairwise_step(round_start, [partner_phi], [partner_delta])
    phases["gossip round"] = in_use()
    replica.apply(round_start, new_state)
    del round_start, buffers, partner_phi, partner_delta, new_state
    for key in keys:
        finish(key)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.monotonic() - started
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = peak_resident_bytes()
    stats = {
        "steps": worker.inner_step,
        "stashes_made": worker.stashes.made,
        "evicted": worker.evicted,
    }
    worker.close()
    return {
        "preset": preset,
        "num_stages": config.num_stages,
        "stage": stage,
        "device": device,
        "precision": worker.precision.precision.value,
        "in_flight": in_flight,
        "rounds": rounds,
        "microbatch_size": batch,
        "sequence_length": seq,
        "measured_bytes": peak - baseline,
        "baseline_bytes": baseline,
        "phases_bytes": {name: value - baseline for name, value in phases.items()},
        # CUDA: what the caching allocator reserved at its peak, beyond the live bytes measured
        "reserved_bytes": torch.cuda.max_memory_reserved(device) - baseline if cuda else None,
        "seconds": round(seconds, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
        **stats,
    }


def run_case(case: Case, device: str, threads: int) -> dict:
    """`measure_case` in a fresh process, so that its peak is not another case's."""
    command = [sys.executable, str(Path(__file__).resolve()), "--case", f"{case.preset}:{case.stage}"]
    command += ["--in-flight", str(case.in_flight), "--rounds", str(case.rounds)]
    command += ["--device", device, "--threads", str(threads)]
    if case.precision is not None:
        command += ["--precision", case.precision]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_records(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []


def measured_cases(path: Path = MEASUREMENTS_PATH) -> list[MeasuredCase]:
    return [MeasuredCase.from_record(record) for record in load_records(path)]


def rewrite_tables(doc: Path, cases: list[MeasuredCase]) -> None:
    doc.write_text(replace_generated(doc.read_text(encoding="utf-8"), generated_tables(cases)), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--estimate-only", action="store_true", help="rewrite the tables without measuring")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of a measuring process")
    parser.add_argument("--case", metavar="PRESET:STAGE", help="measure this one case here, print its JSON")
    parser.add_argument("--in-flight", type=int, help="with --case: the window")
    parser.add_argument("--rounds", type=int, default=4, help="with --case: backward+forward rounds")
    parser.add_argument("--precision", help="with --case: fp32, bf16 or fp16 (default: the device's auto)")
    parser.add_argument("--out", type=Path, default=MEASUREMENTS_PATH, help="where the measurements go")
    parser.add_argument("--doc", type=Path, default=MODEL_DOC, help="the page whose tables are rewritten")
    args = parser.parse_args(argv)
    if args.case is not None:
        import torch

        torch.set_num_threads(args.threads)
        preset, stage = args.case.split(":")
        if args.in_flight is None:
            parser.error("--case needs --in-flight")
        case = Case(preset, int(stage), args.in_flight, args.rounds, args.precision)
        print(json.dumps(measure_case(case, args.device)), flush=True)
        return 0
    if not args.estimate_only:
        kind = args.device.split(":")[0]
        records = []
        for case in GPU_CASES if kind == "cuda" else CPU_CASES:
            print(f"measuring {case} on {args.device} ...", flush=True)
            record = run_case(case, args.device, args.threads)
            print(f"  {record['measured_bytes'] / 2**20:,.0f} MiB in {record['seconds']} s", flush=True)
            records.append(record)
        # a CPU run keeps the recorded GPU cases and the other way round
        kept = [record for record in load_records(args.out) if record["device"].split(":")[0] != kind]
        args.out.write_text(json.dumps(kept + records, indent=1) + "\n", encoding="utf-8")
    rewrite_tables(args.doc, measured_cases(args.out))
    print(f"rewrote the generated tables of {os.path.relpath(args.doc, REPO)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
