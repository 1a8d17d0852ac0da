"""The floor of a three-process pipeline on this machine: what any peer-per-process swarm pays.

Not a test: a script that prints a report (docs/benchmarks.md holds recorded runs).

    python tests/benchmarks/bench_floor.py [--floor-seconds 30] [--floor-warmup 10] [--floor-windows 16] \
        [--floor-single-seconds 20] [--json out.json]

The swarm benchmark (bench_swarm.py) compares a 3 x 1 swarm's CPU per microbatch with one process
chaining the same StageWorkers. Part of the difference is the product's own work per hop (codec,
validation, encryption, routing, posted-hop bookkeeping, the DHT) and part is what splitting the
model into three processes costs on two cores whatever carries the tensors. This script measures
the second part alone: the same three StageWorkers in three processes, each with an event loop
(uvloop) and its stage's compute thread (node/runtime/compute_thread.py, as a peer has), passing fp32
activations and gradients over plain loopback TCP as raw bytes behind a 13-byte header. No encoding,
no checks beyond the workers' own, no encryption, no routing, no DHT, no metering: a floor, not a
design (a stranger's bytes go straight into a tensor here).

Per microbatch, as in the swarm: stage 0 embeds and sends to stage 1, stage 1 to stage 2, stage 2
back to stage 0 (head and loss), then the gradient goes 0 -> 2 -> 1 -> 0 (embedding backward). Stage 0
keeps `--floor-windows` microbatches in flight (each value is one run). CPU is the user+system time of the
three processes over the window, per completed microbatch, beside the single process measured
before and after.

A microbatch a worker's checks reject (node/stage/admission.py: a gradient gate, say, seeing a
norm spike the training itself made) is dropped, as the product's origin drops and retries one:
the rejecting stage tells stage 0 with an ABORT frame, and stage 0 starts another. The report
counts them. A stage that fails otherwise stops its run, which the report marks FAILED with the
reason; the other runs go on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.benchmarks.bench_swarm import (  # noqa: E402
    format_thread_split,
    log,
    loop_and_other_threads,
    single_process,
    thread_split,
)

# kind (1 byte), microbatch id (8), payload bytes (4)
HEADER = struct.Struct("<BQI")
FORWARD, BACKWARD, ABORT = 1, 2, 3  # ABORT: a stage rejected the microbatch (no payload)
NUM_STAGES = 3


# ---- one stage's process -------------------------------------------------------------------------


class _Frames(asyncio.Protocol):
    """Splits a connection's bytes into frames and hands each to `on_frame` (kind, id, payload)."""

    def __init__(self, on_frame) -> None:
        self.on_frame = on_frame
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            kind, microbatch, size = HEADER.unpack_from(self.buffer)
            end = HEADER.size + size
            if len(self.buffer) < end:
                return
            payload = bytearray(self.buffer[HEADER.size : end])
            del self.buffer[:end]
            self.on_frame(kind, microbatch, payload)


class _Sink(asyncio.Protocol):
    """The sending side of a connection: nothing comes back on it."""


class _Sealer:
    """The per-message work the product cannot skip, without its framework around it: each hop a
    protocol Message (the FORWARD / BACKWARD meta a pipeline hop carries, fp16 on the wire) encoded
    and validated, then sealed with AES-256-GCM; on receipt opened and fully validated."""

    PEER_IDS = tuple(f"Qm{stage}" + "x" * 42 for stage in range(NUM_STAGES))  # as long as a peer id

    def __init__(self, stage: int) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.stage = stage
        self.aes = AESGCM(bytes(32))
        self.sent: dict[int, int] = {}  # nonce counters, per link and direction
        self.received: dict[int, int] = {}
        self.request_ids = iter(range(1, 1 << 62))

    def seal(self, peer: int, kind: int, microbatch: int, tensor: torch.Tensor) -> bytes:
        from protocol import Message, MessageKind, seal_message

        ids = self.PEER_IDS
        if kind == FORWARD:
            hop = 1 + (self.stage % NUM_STAGES)  # stage 0 sends hop 1, stage 1 hop 2, stage 2 hop 3
            meta = {"microbatch_id": microbatch, "origin": ids[0], "path": list(ids[:hop]), "order": [1, 2], "hop": hop}
            message_kind, tensors = MessageKind.FORWARD, {"hidden": tensor}
        else:
            meta = {"microbatch_id": microbatch, "path": list(ids), "hop": (self.stage - 1) % NUM_STAGES}
            message_kind, tensors = MessageKind.BACKWARD, {"grad": tensor}
        meta.update(token="t" * 32, purpose="train")
        message = Message(message_kind, "floor", self.stage, next(self.request_ids), meta, tensors)
        counter = self.sent.get(peer, 0)
        self.sent[peer] = counter + 1
        return self.aes.encrypt(counter.to_bytes(12, "big"), seal_message(message, "fp16"), None)

    def open(self, source: int, payload: bytearray) -> torch.Tensor:
        from protocol import open_message

        counter = self.received.get(source, 0)
        self.received[source] = counter + 1
        message = open_message(
            self.aes.decrypt(counter.to_bytes(12, "big"), bytes(payload), None), expected_swarm="floor"
        )
        (tensor,) = message.tensors.values()
        return tensor


async def run_stage(stage: int, ports: list[int], window: int, sealed: bool) -> None:
    from node.config import SwarmConfig
    from node.model.data import open_source
    from node.stage.admission import RejectedInput
    from node.stage.stage_worker import StageWorker

    torch.set_num_threads(1)
    config = SwarmConfig()
    t, hidden_size = config.training, config.model.hidden_size
    shape = (t.microbatch_size, t.sequence_length, hidden_size)
    worker = StageWorker(config, stage)
    loop = asyncio.get_running_loop()
    completed = rejected = 0
    stop = asyncio.Event()
    targets: dict[int, torch.Tensor] = {}
    source = open_source(config, None, stream_id=1) if stage == 0 else None
    next_id = iter(range(1 << 62))
    sealer = _Sealer(stage) if sealed else None

    def send(peer: int, kind: int, microbatch: int, tensor: torch.Tensor) -> None:
        if stop.is_set():  # shutting down: the links may be closed
            return
        if sealer is not None:
            data = memoryview(sealer.seal(peer, kind, microbatch, tensor))
        else:
            data = memoryview(tensor.detach().contiguous().numpy()).cast("B")
        links[peer].writelines((HEADER.pack(kind, microbatch, data.nbytes), data))

    def when_done(future, microbatch: int, then) -> None:
        """Run `then(result)` on the loop once the compute thread finished `future`."""

        def settled(done) -> None:
            if done.cancelled() or stop.is_set() or loop.is_closed():  # shutting down
                return
            error = done.exception()
            if isinstance(error, RejectedInput):
                loop.call_soon_threadsafe(reject, microbatch, error)
            elif error is not None:  # a floor that fails must say so, not stall quietly
                log(f"stage {stage}: {error!r}")
                loop.call_soon_threadsafe(stop.set)
            else:
                loop.call_soon_threadsafe(then, done.result())

        future.add_done_callback(settled)

    def reject(microbatch: int, error: RejectedInput | None) -> None:
        """Drop a microbatch a stage's checks refused; stage 0 starts another in its place."""
        if error is not None:
            log(f"stage {stage}: microbatch {microbatch} rejected: {error}")
        worker.drop(("floor", microbatch))
        if stage != 0:
            links[0].write(HEADER.pack(ABORT, microbatch, 0))
            return
        nonlocal rejected
        rejected += 1
        targets.pop(microbatch, None)
        start_microbatch()

    def start_microbatch() -> None:
        tokens, target = source.next_batch(t.microbatch_size, t.sequence_length)
        microbatch = next(next_id)
        targets[microbatch] = target
        key = ("floor", microbatch)
        when_done(
            worker.executor.submit(worker.embed, key, tokens), microbatch, lambda h: send(1, FORWARD, microbatch, h)
        )

    def finished(_: None) -> None:
        if stop.is_set():
            return
        nonlocal completed
        completed += 1
        start_microbatch()

    def on_frame(kind: int, microbatch: int, payload: bytearray) -> None:
        if stop.is_set():
            return
        if kind == ABORT:  # only stage 0 is sent these
            reject(microbatch, None)
            return
        if sealer is not None:  # forwards come from the stage before, gradients from the one after
            tensor = sealer.open((stage - 1) % NUM_STAGES if kind == FORWARD else (stage + 1) % NUM_STAGES, payload)
        else:
            tensor = torch.frombuffer(payload, dtype=torch.float32).view(shape)
        key = ("floor", microbatch)
        if stage == 0 and kind == FORWARD:  # the head: loss, then the gradient back to the last stage
            future = worker.executor.submit(worker.head_loss_backward, key, tensor, targets.pop(microbatch))
            when_done(future, microbatch, lambda result: send(backward_to, BACKWARD, microbatch, result[1]))
        elif stage == 0:
            when_done(worker.executor.submit(worker.embed_backward, key, tensor), microbatch, finished)
        elif kind == FORWARD:
            future = worker.executor.submit(worker.forward, key, tensor)
            when_done(future, microbatch, lambda h: send(forward_to, FORWARD, microbatch, h))
        else:
            future = worker.executor.submit(worker.backward, key, tensor)
            when_done(future, microbatch, lambda g: send(backward_to, BACKWARD, microbatch, g))

    server = await loop.create_server(lambda: _Frames(on_frame), "127.0.0.1", ports[stage])
    print("LISTENING", flush=True)
    # who this stage sends to: the next stage forward, the previous one backward
    forward_to, backward_to = (stage + 1) % NUM_STAGES, (stage - 1) % NUM_STAGES
    links = {}
    for peer in {forward_to, backward_to}:
        for _ in range(200):  # the peer may not listen yet: bounded retries
            try:
                transport, _ = await loop.create_connection(_Sink, "127.0.0.1", ports[peer])
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"stage {stage} could not reach stage {peer}")
        links[peer] = transport

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if stage == 0:
        loop.add_signal_handler(
            signal.SIGUSR1, lambda: print(f"COUNT {completed} {rejected} {time.monotonic()}", flush=True)
        )
        await asyncio.sleep(1.0)  # every stage is connected by then (each retried above until it was)
        for _ in range(window):
            start_microbatch()
    await stop.wait()
    server.close()
    for transport in links.values():
        transport.close()
    worker.close()
    await asyncio.sleep(0.1)  # results the compute thread posted meanwhile land while `stop` is set


# ---- the driver ------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def pipeline_run(window: int, warmup: float, seconds: float, sealed: bool = False) -> dict:
    """One run of the three processes with `window` microbatches in flight (`sealed`: each hop a
    validated protocol message in fp16, AES-GCM sealed)."""
    import psutil

    ports = free_ports(NUM_STAGES)
    command = [sys.executable, __file__, "--role"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    processes = [
        subprocess.Popen(
            [
                *command,
                str(stage),
                "--ports",
                *map(str, ports),
                "--window",
                str(window),
                *(["--sealed"] if sealed else []),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for stage in range(NUM_STAGES)
    ]
    try:
        for p in processes:
            if p.stdout.readline().strip() != "LISTENING":
                raise RuntimeError("a stage process did not start")

        def count() -> tuple[int, int, float]:
            if processes[0].poll() is None:
                processes[0].send_signal(signal.SIGUSR1)
            line = processes[0].stdout.readline().split()
            if len(line) != 4:  # the stage exited: its reason is on stderr, above the report
                stopped = [stage for stage, p in enumerate(processes) if p.poll() is not None]
                raise RuntimeError(f"stage 0 gave no count; stage(s) {stopped} exited")
            _, done, rejected, at = line
            return int(done), int(rejected), float(at)

        def cpu() -> float:
            return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in processes)

        def threads() -> dict[str, tuple[float, float]]:
            return {f"stage {stage}": loop_and_other_threads(p.pid) for stage, p in enumerate(processes)}

        time.sleep(warmup)
        threads0, cpu0, (done0, rejected0, t0) = threads(), cpu(), count()
        time.sleep(seconds)
        threads1, cpu1, (done1, rejected1, t1) = threads(), cpu(), count()
        crashed = [p.pid for p in processes if p.poll() is not None]
        if crashed or done1 <= done0:
            raise RuntimeError(f"the pipeline stalled or a stage exited: {crashed}")
        microbatches = done1 - done0
        config_tokens = _tokens_per_microbatch()
        return {
            "window": window,
            "sealed": sealed,
            "microbatches": microbatches,
            "rejected": rejected1 - rejected0,
            "rejected_before": rejected0,
            "seconds": t1 - t0,
            "microbatches_per_s": microbatches / (t1 - t0),
            "tokens_per_s": microbatches * config_tokens / (t1 - t0),
            "cpu_ms_per_microbatch": 1e3 * (cpu1 - cpu0) / microbatches,
            "cpu_cores_used": (cpu1 - cpu0) / (t1 - t0),
            "threads_ms_per_microbatch": thread_split(threads0, threads1, microbatches),
        }
    finally:
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _tokens_per_microbatch() -> int:
    from node.config import SwarmConfig

    t = SwarmConfig().training
    return t.microbatch_size * t.sequence_length


def run(args: argparse.Namespace) -> dict:
    log(f"floor: single process, 1 thread, {args.floor_single_seconds:.0f} s")
    before = single_process(args.floor_single_seconds, 1)
    runs = []
    for window in args.floor_windows:
        for sealed in (False, True):
            log(
                f"floor: three processes on loopback TCP, {'sealed' if sealed else 'raw'}, {window} in flight: "
                f"{args.floor_warmup:.0f} s warm-up, {args.floor_seconds:.0f} s"
            )
            try:
                runs.append(pipeline_run(window, args.floor_warmup, args.floor_seconds, sealed))
            except RuntimeError as e:  # the report says so; the other runs (and bench_all's) go on
                log(f"floor: this run FAILED: {e}")
                runs.append({"window": window, "sealed": sealed, "failed": str(e)})
    log(f"floor: single process again, {args.floor_single_seconds:.0f} s")
    after = single_process(args.floor_single_seconds, 1)
    return {"single": [before, after], "pipeline": runs}


def format_report(result: dict) -> str:
    singles = result["single"]
    cpu = sum(s["cpu_ms_per_microbatch"] for s in singles) / len(singles)
    tokens = sum(s["tokens_per_s"] for s in singles) / len(singles)
    single_tokens = " / ".join(f"{s['tokens_per_s']:,.0f}" for s in singles)
    single_cpu = " / ".join(f"{s['cpu_ms_per_microbatch']:.1f}" for s in singles)
    lines = [
        "## The floor of a three-process pipeline (bench_floor.py: the same workers on loopback TCP, no "
        "framework; raw fp32 hops, or sealed: a validated protocol message in fp16 under AES-GCM)",
        "",
        f"single process, 1 thread: {single_tokens} tokens/s, {single_cpu} ms CPU per microbatch",
        "",
        "| hops | in flight | tokens/s (vs single) | CPU ms per microbatch (vs single) | cores used |",
        "|---|---|---|---|---|",
    ]
    for r in result["pipeline"]:
        if "failed" in r:
            lines.append(f"| {'sealed' if r['sealed'] else 'raw fp32'} | {r['window']} | FAILED: {r['failed']} | | |")
            continue
        lines.append(
            f"| {'sealed' if r['sealed'] else 'raw fp32'} | {r['window']} | {r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / tokens:.2f}x) "
            f"| {r['cpu_ms_per_microbatch']:.1f} ({r['cpu_ms_per_microbatch'] / cpu:.2f}x) | {r['cpu_cores_used']:.2f} |"
        )
    lines.append("")
    for r in result["pipeline"]:
        if "failed" in r:
            continue
        lines.append(
            f"- {'sealed' if r['sealed'] else 'raw fp32'}, {r['window']} in flight: CPU ms per microbatch, event loop "
            f"/ other threads (the compute thread): {format_thread_split(r['threads_ms_per_microbatch'])}"
        )
        if r["rejected"] or r["rejected_before"]:
            lines.append(
                f"  - microbatches a worker's checks rejected (dropped, others started): {r['rejected_before']} "
                f"before the window, {r['rejected']} in it"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--floor-seconds", type=float, default=30.0, help="measured window per run")
    parser.add_argument("--floor-warmup", type=float, default=10.0, help="seconds of training before it")
    parser.add_argument(
        "--floor-windows", type=int, nargs="+", default=[16], help="microbatches in flight, one run each"
    )
    parser.add_argument("--floor-single-seconds", type=float, default=20.0, help="each single-process measurement")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs=NUM_STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--sealed", action="store_true", help=argparse.SUPPRESS)
    add_arguments(parser)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.role is not None:
        import uvloop

        uvloop.run(run_stage(args.role, args.ports, args.window, args.sealed))
        return 0
    result = run(args)
    print(format_report(result))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
