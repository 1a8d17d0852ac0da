"""`make gpu-check`: the volunteer's real case, end to end, on one device (docs/benchmarks.md, "GPU check").

A real swarm of separate processes on loopback, each peer computing on `--device`, at a real preset
(`125m` by default): bootstrap, one peer per stage of a 4-stage pipeline, then

1. training: stage 0 drives microbatches through every stage and back;
2. a joiner's state download: a second replica of stage 1 joins the live stage;
3. a gossip round: the two stage-1 replicas complete a NoLoCo round with each other, and
   neither refuses the other's tensors (the joiner took its donor's optimizer moments);
4. a CheckFree rebuild: the only peer of stage 2 is SIGKILLed, a newcomer rebuilds stage 2 from
   its neighbours and training goes on through it;
5. an export: `node export` writes the swarm's model as a Hugging Face checkpoint.

It prints stage-0 tokens/s, GPU utilisation (nvidia-smi, sampled while training; CPU use of the
peers on a CPU), the peak memory of every peer (torch's allocator on a GPU, RSS on a CPU, from
each peer's metrics), and the hop and compute times; it exits 1 when a step fails, a peer dies or
any peer's log holds a traceback, 2 when the device cannot be used. `--device cpu --preset 15m`
runs the same path with short microbatches (the model's shapes stay the preset's) in `make test`
(tests/swarm/test_gpu_check.py). Every process it starts is ended by pid when it returns.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from node.local_swarm import NodeProcess, Swarm, peers_by_stage  # noqa: E402
from node.model.presets import load_config  # noqa: E402

NUM_STAGES = 4  # stage 0 and three block stages: 6 (15m) and 30 (125m) layers split evenly
REPLICATED_STAGE = 1  # gets a second replica: a state download, then gossip rounds between the two
KILLED_STAGE = 2  # its only peer dies: CheckFree rebuilds it from stages 1 and 3


@dataclass(frozen=True)
class CheckShape:
    """What one run trains: the preset's model; the microbatch shape and the timing of the check."""

    training: dict[str, Any]  # [training] keys written over the preset's
    inner_steps: int  # H: small, so that a gossip round comes within the run
    train_seconds: float  # the measured training window
    step_timeout: float  # for each of the steps 1-5 to show up
    threads: int | None  # torch CPU threads per peer (the CPU run shares 2 cores among 5 peers)


def shape_for(device: str) -> CheckShape:
    if device == "cpu":  # short: a 64-token microbatch through the real model shapes
        training = {"microbatch_size": 1, "sequence_length": 64, "microbatches_per_step": 1}
        return CheckShape(training | {"min_in_flight": 2, "max_in_flight": 4}, 4, 10.0, 180.0, 1)
    return CheckShape({"microbatches_per_step": 1}, 10, 60.0, 180.0, None)  # the preset's own shape


SWARM_TOML = """\
num_stages = {num_stages}
[training]
{training}
[gossip]
inner_steps = {inner_steps}
[heartbeat]
period = 1.0
ttl = 4.0
[recovery]
lost_grace = 2.0
rebalance_wait = 3600.0
[validation]
interval = 3600.0
"""


@dataclass
class Report:
    """The figures and the failures of one run."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def figure(self, what: str, value: str) -> None:
        self.rows.append((what, value))
        print(f"  {what}: {value}", flush=True)

    def fail(self, why: str) -> None:
        self.failures.append(why)
        print(f"  FAILED: {why}", flush=True)


class Run:
    def __init__(self, swarm: Swarm, device: str, preset: str, shape: CheckShape, report: Report):
        self.swarm, self.device, self.preset, self.shape, self.report = swarm, device, preset, shape, report
        self.peers: dict[str, NodeProcess] = {}
        self.killed: set[str] = set()  # peers the check ended itself

    def join(self, name: str, stage: int) -> NodeProcess:
        flags = ["--stage", str(stage), "--device", self.device, "--quiet", "--join-jitter", "0"]
        flags += ["--metrics-port", "0", "--name", name]
        if self.shape.threads:
            flags += ["--threads", str(self.shape.threads)]
        node = self.swarm.join(name, *flags)
        self.peers[name] = node
        return node

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        """`predicate()` once truthy, or a failure (and None) after the step timeout or a peer's death."""
        deadline = time.monotonic() + (timeout or self.shape.step_timeout)
        while time.monotonic() < deadline:
            dead = [n.name for n in self.peers.values() if n.process.poll() is not None and n.name not in self.killed]
            if dead:
                self.report.fail(f"{what}: {', '.join(dead)} exited")
                return None
            value = predicate()
            if value:
                return value
            time.sleep(1.0)
        self.report.fail(f"{what}: not within {timeout or self.shape.step_timeout:.0f} s")
        return None

    def snapshot(self) -> dict:
        return self.swarm.observe()

    def stage0_microbatches(self) -> int:
        stage0 = [p for p in self.snapshot()["stages"][0]["peers"] if p["state"] == "online"]
        return sum(p["microbatches"] for p in stage0)


def metrics_of(node: NodeProcess) -> dict[str, float]:
    """The peer's Prometheus series (name{labels} -> value), scraped at the port its log names."""
    found = re.search(r"Prometheus metrics on (http://\S+/metrics)", node.log())
    if found is None:
        return {}
    try:
        with urllib.request.urlopen(found.group(1), timeout=10) as reply:  # a loopback address it printed
            text = reply.read().decode()
    except OSError:
        return {}
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                series[name] = float(value)
            except ValueError:
                continue
    return series


def histogram_mean(series: dict[str, float], name: str, label: str) -> tuple[float, int] | None:
    """(mean seconds, count) of one histogram's series with `label` (e.g. 'pass="forward"')."""
    total = series.get(f"{name}_sum{{{label}}}")
    count = series.get(f"{name}_count{{{label}}}")
    if total is None or not count:
        return None
    return total / count, int(count)


PARTNER_CHECK = re.compile(
    r"partner \S+: distance (?P<distance>\S+), cosine (?P<cosine>\S+), .*"
    r"Delta ratio (?P<delta_ratio>\S+), Delta cosine (?P<delta_cosine>\S+), distance limit (?P<limit>\S+)"
)


def describe_partner_checks(logs: list[str]) -> str:
    """What the replicas measured of each other in their gossip rounds (the plausibility check's
    inputs, node/averaging/plausibility.py): honest figures at this preset, against its bounds."""
    checks = [m.groupdict() for log in logs for m in PARTNER_CHECK.finditer(log)]
    if not checks:
        return "none logged"

    def spread(key: str) -> str:
        values = sorted(float(c[key]) for c in checks)
        return f"{values[0]:.3g} / {values[len(values) // 2]:.3g} / {values[-1]:.3g}"

    return (
        f"{len(checks)}; min / median / max: distance {spread('distance')} (limit {spread('limit')}), "
        f"cosine {spread('cosine')}, Delta cosine {spread('delta_cosine')}, Delta ratio {spread('delta_ratio')}"
    )


def format_bytes(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


class Utilisation:
    """GPU utilisation from nvidia-smi (or, on a CPU, the peers' CPU use), sampled while training."""

    def __init__(self, device: str, peers: list[NodeProcess]):
        self.device, self.samples = device, []
        self.smi = shutil.which("nvidia-smi") if device.startswith("cuda") else None
        self.processes: list[psutil.Process] = []
        self.started = time.monotonic()
        if not self.smi:
            for node in peers:  # a Process's first cpu_percent call starts its window, the next reads it
                for pid in node.refresh_family():
                    try:
                        process = psutil.Process(pid)
                        process.cpu_percent(None)
                        self.processes.append(process)
                    except psutil.NoSuchProcess:
                        pass

    def sample(self) -> None:
        if self.smi:
            out = subprocess.run(
                [self.smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            values = [float(v) for v in out.stdout.split() if v.replace(".", "", 1).isdigit()]
            if values:
                self.samples.append(max(values))

    def describe(self) -> str:
        if self.smi:
            if not self.samples:
                return "nvidia-smi gave no reading"
            return f"{sum(self.samples) / len(self.samples):.0f} % mean, {max(self.samples):.0f} % max (nvidia-smi)"
        if self.device.startswith("cuda"):
            return "not measured (no nvidia-smi)"
        total = 0.0
        for process in self.processes:
            try:
                total += process.cpu_percent(None)
            except psutil.NoSuchProcess:
                pass
        seconds = time.monotonic() - self.started
        return f"CPU: the peers and their p2pd used {total:.0f} % of one core over {seconds:.0f} s ({psutil.cpu_count()} cores)"


def check(device: str, preset: str, workdir: Path) -> Report:
    report = Report()
    shape = shape_for(device)
    toml = workdir / "gpu-check.toml"
    training = "".join(f"{key} = {value}\n" for key, value in shape.training.items())
    toml.write_text(SWARM_TOML.format(num_stages=NUM_STAGES, training=training.rstrip(), inner_steps=shape.inner_steps))
    swarm = Swarm(workdir)
    run = Run(swarm, device, preset, shape, report)
    started = time.monotonic()
    try:
        swarm.bootstrap("--config", str(toml), "--preset", preset)
        for stage in range(NUM_STAGES):
            run.join(f"stage{stage}", stage)
        online = run.wait(
            "every stage online",
            lambda: all(len(peers_by_stage(run.snapshot())[s]) >= 1 for s in range(NUM_STAGES)),
            timeout=max(300.0, shape.step_timeout),
        )
        if not online:
            return report
        snapshot = run.snapshot()
        training = load_config(toml, **{"model.preset": preset}).training  # as the bootstrap resolved it
        mbs, seq = training.microbatch_size, training.sequence_length
        report.figure("model", f"{preset}, {snapshot.get('model_parameters', 0):,} parameters in {NUM_STAGES} stages")
        report.figure("up after", f"{time.monotonic() - started:.0f} s")

        # 1. training, measured over a window (joiner and gossip steps come after it)
        if not run.wait("stage 0 trains", lambda: run.stage0_microbatches() >= 2):
            return report
        utilisation = Utilisation(device, list(run.peers.values()))
        first, t0 = run.stage0_microbatches(), time.monotonic()
        # the window, stretched (up to the step timeout) until a microbatch completes in it: on a
        # busy host a 10 s window can fall between two completions, and a rate needs one
        while time.monotonic() - t0 < shape.train_seconds or (
            run.stage0_microbatches() == first and time.monotonic() - t0 < shape.step_timeout
        ):
            utilisation.sample()
            time.sleep(2.0)
        done, seconds = run.stage0_microbatches() - first, time.monotonic() - t0
        tokens = done * mbs * seq
        report.figure(
            "stage-0 tokens/s", f"{tokens / seconds:.0f} ({done} microbatches of {mbs} x {seq} in {seconds:.0f} s)"
        )
        report.figure("utilisation", utilisation.describe())
        if done <= 0:
            report.fail("no microbatch completed in the training window")

        # 2. a joiner downloads the live stage
        joiner = run.join(f"stage{REPLICATED_STAGE}b", REPLICATED_STAGE)
        if run.wait("a joiner's state download", lambda: "joined live stage" in joiner.log()):
            report.figure("state download", re.search(r"joined live stage .*", joiner.log()).group(0))

        # 3. a gossip round between the two replicas
        replicas = [run.peers[f"stage{REPLICATED_STAGE}"], joiner]
        partnered = re.compile(r"outer round \d+ -> \d+ with (?!alone)[^\s,]+")
        found = run.wait(
            "a gossip round between two replicas", lambda: any(partnered.search(n.log()) for n in replicas)
        )
        if found:
            line = next(partnered.search(n.log()).group(0) for n in replicas if partnered.search(n.log()))
            report.figure("gossip", line)

        # 4. the only peer of a stage dies; a newcomer rebuilds the stage by CheckFree
        victim = run.peers[f"stage{KILLED_STAGE}"]
        run.killed.add(victim.name)
        victim.kill_hard()
        time.sleep(5.0)  # its record's TTL (4 s): the newcomer finds the stage lost, not a dead donor
        newcomer = run.join(f"stage{KILLED_STAGE}b", KILLED_STAGE)
        rebuilt = re.compile(r"rebuilt stage \d+ by \S+ .*")
        if run.wait("a CheckFree rebuild", lambda: rebuilt.search(newcomer.log())):
            report.figure("rebuild", rebuilt.search(newcomer.log()).group(0))
            before = run.stage0_microbatches()
            run.wait("training through the rebuilt stage", lambda: run.stage0_microbatches() > before + 1)

        # 5. export
        out = workdir / "export"
        exported = subprocess.run(
            [sys.executable, "-m", "node", "export", "--initial-peers", *swarm.initial_peers, "--out", str(out)],
            capture_output=True,
            text=True,
            env=swarm.env,
            cwd=workdir,
            timeout=shape.step_timeout,
        )
        if exported.returncode != 0:
            report.fail(f"node export exited {exported.returncode}: {(exported.stderr or exported.stdout)[-500:]}")
        else:
            files = sorted(p.name for p in out.iterdir())
            size = sum(p.stat().st_size for p in out.iterdir())
            report.figure("export", f"{', '.join(files)} ({format_bytes(size)})")

        # the stage-1 replicas' gossip over the whole run, once the other steps are done
        report.figure("partner checks", describe_partner_checks([n.log() for n in replicas]))
        banned = [m.group(0) for n in replicas if (m := re.search(r"rejected gossip from .*", n.log()))]
        if banned:  # both replicas are honest: the joiner must train like its donor (docs/recovery.md)
            report.fail(f"a replica refused its honest stage mate: {banned[0]}")

        # figures every peer measured
        for name, node in sorted(run.peers.items()):
            if name in run.killed:
                continue
            series = metrics_of(node)
            device_peak = series.get("pipeswarm_peak_device_memory_bytes")
            rss = series.get("pipeswarm_peak_rss_bytes")
            memory = f"{format_bytes(device_peak)} on the GPU" if device_peak else ""
            memory += f"{', ' if memory else ''}RSS {format_bytes(rss)}" if rss else ""
            times = []
            for kind in ("forward", "backward", "head"):
                mean = histogram_mean(series, "pipeswarm_compute_seconds", f'pass="{kind}"')
                if mean:
                    times.append(f"{kind} {mean[0] * 1e3:.1f} ms (n {mean[1]})")
            for service in ("forward", "backward"):
                mean = histogram_mean(series, "pipeswarm_hop_seconds", f'service="{service}"')
                if mean:
                    times.append(f"{service} hop {mean[0] * 1e3:.1f} ms (n {mean[1]})")
            # its training position: backward passes per inner step follow the window it holds
            # (node/stage/inner_optimizer.py, step_size), and replicas of one stage can differ
            position = ", ".join(
                f"{what} {series[key]:.0f}"
                for what, key in (("inner step", "pipeswarm_inner_step"), ("stored", "pipeswarm_stored_activations"))
                if key in series
            )
            report.figure(
                f"peer {name}", f"peak {memory or 'not reported'}; {', '.join(times) or 'no timings'}; {position}"
            )
        return report
    finally:
        swarm.close()
        for node in swarm.nodes:
            log = node.log()
            if "Traceback" in log:
                report.fail(f"{node.name}'s log holds a traceback:\n{log[log.index('Traceback') :][:1500]}")
        report.figure("whole check", f"{time.monotonic() - started:.0f} s")


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the check here (None: it can)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: torch {torch.__version__} sees no CUDA device"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--preset", default="125m", help="the model preset (docs/model.md)")
    parser.add_argument("--workdir", help="where peer logs go (default: a temporary directory, kept on failure)")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pipeswarm-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {args.preset} on {args.device}, logs in {workdir}", flush=True)
    if args.device != "cpu":  # the device paths' unit tests, on the device (the CPU runs them in make test)
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_device_paths.py"],
            cwd=ROOT,
            env={**Swarm(workdir).env, "PIPESWARM_TEST_DEVICE": args.device},
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(f"  device-path tests on {args.device}: {tests.stdout.strip().splitlines()[-1:]}", flush=True)
        failed = tests.returncode != 0
    else:
        failed = False
    report = check(args.device, args.preset, workdir)
    if failed:
        report.fail(f"tests/unit/test_device_paths.py failed on {args.device}:\n{tests.stdout[-3000:]}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rows": report.rows, "failures": report.failures}, indent=1))
    print("gpu-check:", "passed" if not report.failures else f"{len(report.failures)} failure(s)", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
