"""The wire at real size: the 15m preset at its 256-token context over 100 ms RTT / 50 Mbit/s links.

Not a test: a script that prints a report (docs/benchmarks.md, "The wire at real size", holds a
recorded run). `make bench-wire` runs it alone; `make bench` runs it after the other benchmarks.

    python tests/benchmarks/bench_wire.py [--wire-codecs fp16 subspace8] [--no-wire-reference] \
        [--wire-warmup 45] [--wire-window 100] [--wire-round-wait 240] [--wire-rtt-ms 100] \
        [--wire-rate-mbit 50] [--wire-inner-steps 4] [--quick] [--json out.json]

Hop bytes   For the 15m preset's hop (8 x 256 tokens x 288) and 125m's (1 x 2048 x 576), each codec's
            training FORWARD and BACKWARD framed exactly as a peer sends them (encode_message of the
            message the pipeline builds, with peer ids, a 3-peer path and the microbatch token of
            their real lengths, plus the frame header): bytes per token per hop, and the ratio to fp16.
            Tensors only: nothing is trained for 125m here.
Link bound  Every host forwards one hop and sends one gradient per microbatch (stage 0 holds the
            embedding and the head, so the pipeline is a ring: 0 -> 1 -> 2 -> 0 and back), so each
            uplink carries FORWARD + BACKWARD bytes a token: link bound = rate / that, in tokens/s.
Compute     Each stage alone in this process before any swarm starts, one torch thread as the peers
bound       run: forward+backward of one microbatch (node/stage/inner_optimizer.py's
            time_forward_backward, best of 2) plus one AdamW step over microbatches_per_step. In the
            swarm stage 0 has a core of its own and every other process shares the rest (taskset),
            as if each peer had its own machine: on a shared machine the scheduler would give the
            bottleneck stage only its share of the cores. A microbatch passes every stage once, so
            the pipeline cannot beat tokens / max(stage 0, the slowest block-stage replica, the
            block stages' sum over the other cores). The hop codecs' own arithmetic, outer steps,
            p2pd and the delay line are not in it: the ratio shows what they cost.
Swarm       Per codec (fp16 and subspace8 unless --wire-codecs says, to stay within 15 minutes on 2
            cores: int8 sits between them, and subspace4 moves exactly subspace8's bytes, at twice the
            rank in half the bits, so its swarm would measure the same link), a fresh swarm in network namespaces (tests/helpers/netns.py):
            the bootstrap on `boot`, stage 0 on `s0`, two replicas of stage 1 on `s1a` and `s1b`,
            stage 2 on `s2`, each `node join --stage s --threads 1`. Every host is shaped before the
            bootstrap: RTT / 4 one way (a path between two hosts adds both ends: 100 ms round trip)
            and the rate up and down. Config: `--preset 15m` with the codec on every link (wire and
            slow-link compression), gossip.inner_steps = 4, so the two stage-1 replicas meet for
            NoLoCo rounds within minutes on CPU (the payload of a round does not depend on H), and
            no validation passes (stage 0's work, but not training's).
Reference   Then the default codec's swarm once more with no shaping at all (--no-wire-reference
            skips it): shaped / unshaped is what 100 ms and 50 Mbit/s cost this pipeline, apart from
            how well the pipeline keeps its stages busy on this machine.
tokens/s    As bench_wide_area.py: two `node status --json` snapshots a window apart, after every peer
            is online, stage 0 reported a loss and --wire-warmup seconds passed; ratio = tokens/s over
            min(compute bound, link bound). The swarm runs the product's heartbeat (a record every
            5 s), so the time between the two announcements read is known to within a period.
NoLoCo      Each replica logs an applied round as "outer round R -> R+1 with P, ..., sent N bytes in
round       T s" (node/averaging/round_context.py): N = the framed bytes it sent (its Delta codes and
            scales, phi residues, requests), T = from its first message to its outer step. Bytes a
            parameter = what both replicas sent in that round over the stage's parameter count. If
            no round has been applied by the end of the window, the bench waits up to --wire-round-wait.
The summary's last line, for scripts:
    wire: codec <name> <N>x fewer bytes than fp16, tokens/s <R>x of the limit, NoLoCo round <B> bytes/param in <T> s
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import torch  # noqa: E402

from node.config import SwarmConfig  # noqa: E402
from protocol import FRAME_HEADER_BYTES, Compression, Message, MessageKind, encode_message  # noqa: E402
from tests.benchmarks.bench_swarm import log, online  # noqa: E402
from tests.benchmarks.bench_transport import machine_info, script_main  # noqa: E402
from tests.benchmarks.bench_wide_area import measure, write_config  # noqa: E402

CODECS = (Compression.FP16, Compression.INT8, Compression.SUBSPACE8, Compression.SUBSPACE4)
SWARM_CODECS = (Compression.FP16, Compression.SUBSPACE8)
PRESET, HOP_SHAPE_ONLY = "15m", "125m"
PLACEMENT = {"s0": 0, "s1a": 1, "s1b": 1, "s2": 2}
HOSTS = ("boot", *PLACEMENT)
BENCH_INNER_STEPS = 4  # H for the bench's swarms: rounds within minutes at CPU speed
TARGET_RATIO = 0.8  # issue 38: stage-0 tokens/s >= 0.8 x min(compute bound, link bound)
TARGET_FEWER = 16.0  # and the default codec >= 16x fewer bytes a token a hop than fp16
TARGET_ROUND_BYTES = 2.0  # and a NoLoCo round <= 2 bytes a parameter
STATUS_TIMEOUT = 120.0
ROUND_LINE = re.compile(
    r"^(\d\d:\d\d:\d\d) .*outer round (\d+) -> \d+ with (\w+)(?:, divergence [^,]+)?, sent (\d+) bytes in ([\d.]+) s",
    re.MULTILINE,
)
PAIR_SECONDS = 5  # the two sides of one exchange log their lines this close together
# what a peer id and a microbatch token look like on the wire (their real lengths)
PEER_ID = "12D3KooW" + "A" * 44
TOKEN = "0" * 32


def preset_config(preset: str, codec: Compression | None = None) -> SwarmConfig:
    from node.model.presets import load_config

    codecs = {} if codec is None else {"training.wire_compression": codec, "training.slow_link_compression": codec}
    return load_config(None, **{"model.preset": preset, **codecs})


# ---- hop bytes and the two bounds -----------------------------------------------------------------


def hop_bytes(config: SwarmConfig) -> dict[str, float]:
    """Framed bytes a token of one training FORWARD and one BACKWARD in the config's usual codec."""
    from node.pipeline.token_anchors import hop_token_ids, token_id_dtype

    t, m = config.training, config.model
    shape = (t.microbatch_size, t.sequence_length, m.hidden_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.vocab_size, shape[:-1], generator=gen).to(token_id_dtype(m))
    path = [PEER_ID] * config.num_stages
    forward = Message(
        MessageKind.FORWARD,
        config.swarm_id,
        0,
        2**40,
        {"microbatch_id": 2**40, "origin": PEER_ID, "path": path, "order": [1, 2, 0], "hop": 2, "token": TOKEN},
        {"hidden": torch.randn(shape, generator=gen), **hop_token_ids(ids, config.training, config.model)},
    )
    backward = Message(
        MessageKind.BACKWARD,
        config.swarm_id,
        2,
        2**40,
        {"microbatch_id": 2**40, "path": path, "hop": 2, "token": TOKEN},
        {"grad": torch.randn(shape, generator=gen)},
    )
    tokens = t.microbatch_size * t.sequence_length
    return {
        kind: (FRAME_HEADER_BYTES + len(encode_message(message, t.wire_compression))) / tokens
        for kind, message in (("forward", forward), ("backward", backward))
    }


def hop_table(preset: str, rate_mbit: float) -> list[dict]:
    rows = []
    for codec in CODECS:
        config = preset_config(preset, codec)
        per_token = hop_bytes(config)
        rows.append(
            {
                "preset": preset,
                "codec": str(codec),
                "tokens_per_hop": config.training.microbatch_size * config.training.sequence_length,
                "width": config.model.hidden_size,
                **{f"{kind}_bytes_per_token": value for kind, value in per_token.items()},
                # an unshaped link (rate 0 here) binds nothing
                "link_bound_tokens_per_s": rate_mbit * 1e6 / 8 / (per_token["forward"] + per_token["backward"])
                if rate_mbit
                else math.inf,
            }
        )
    fp16 = rows[0]
    for row in rows:
        row["fewer_than_fp16"] = (fp16["forward_bytes_per_token"] + fp16["backward_bytes_per_token"]) / (
            row["forward_bytes_per_token"] + row["backward_bytes_per_token"]
        )
    return rows


def compute_bound(config: SwarmConfig, replicas: dict[int, int]) -> dict:
    """Seconds each stage takes for one microbatch alone here (one thread), and the pipeline's bound."""
    from node.model.llama import build_stage
    from node.runtime.device import DeviceTransfers
    from node.stage.inner_optimizer import ADAM_BETAS, ADAM_EPS, time_forward_backward

    t = config.training
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seconds = []
    try:
        for stage in range(config.num_stages):
            module = build_stage(config.model, stage, config.seed)
            params = [p for p in module.parameters() if p.requires_grad]
            fwd_bwd = time_forward_backward(
                module,
                config.model,
                stage,
                DeviceTransfers("cpu"),
                torch.float32,
                t.microbatch_size,
                t.sequence_length,
                2,
            )
            optimizer = torch.optim.AdamW(params, lr=1e-4, betas=ADAM_BETAS, eps=ADAM_EPS)
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            steps = []
            for _ in range(3):  # the first builds Adam's moments
                t0 = time.perf_counter()
                optimizer.step()
                steps.append(time.perf_counter() - t0)
            seconds.append(fwd_bwd + min(steps[1:]) / t.microbatches_per_step)
            del module, optimizer, params
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    tokens = t.microbatch_size * t.sequence_length
    block_stages = [(s / replicas.get(stage, 1), s) for stage, s in enumerate(seconds) if stage > 0]
    if cores >= 2:  # stage 0 alone on its core, the block stages sharing the rest (cpu_sets)
        limits = {
            "stage 0 on its core": seconds[0],
            "the slowest block-stage replica": max(per_replica for per_replica, _ in block_stages),
            f"the block stages sharing {cores - 1} cores": sum(s for _, s in block_stages) / (cores - 1),
        }
    else:
        limits = {"one core for every stage": sum(seconds)}
    limited_by = max(limits, key=limits.__getitem__)
    return {
        "stage_seconds": seconds,
        "replicas": replicas,
        "cores": cores,
        "tokens_per_microbatch": tokens,
        "tokens_per_s": tokens / limits[limited_by],
        "limited_by": limited_by,
    }


def cpu_sets(cores: int) -> dict[str, str]:
    """The cores each host's processes may use: stage 0 one of its own and everyone else the others,
    as if each peer had its own machine (on a shared machine, the scheduler would give the bottleneck
    stage only its share of the cores: a bound no pipeline could reach). No pinning on one core."""
    if cores < 2:
        return {}
    others = f"1-{cores - 1}" if cores > 2 else "1"
    return {host: "0" if stage == 0 else others for host, stage in PLACEMENT.items()} | {"boot": others}


# ---- the swarm ------------------------------------------------------------------------------------


def stage_parameters(config: SwarmConfig, stage: int) -> int:
    from node.model.llama import build_stage

    return sum(p.numel() for p in build_stage(config.model, stage, config.seed).parameters())


def _clock_seconds(stamp: str) -> int:
    hours, minutes, seconds = map(int, stamp.split(":"))
    return 3600 * hours + 60 * minutes + seconds


def rounds_of(logs: dict[str, str], parameters: int) -> list[dict]:
    """The applied NoLoCo rounds the stage-1 replicas logged, each side's bytes and seconds, and the
    round's bytes a parameter: both sides' bytes when both logged it (the two lines of one exchange,
    from two hosts within PAIR_SECONDS: their round counters may differ), else twice the one side's."""
    sides = sorted(
        (
            {"host": host, "round": int(r), "sent_bytes": int(sent), "seconds": float(secs), "at": _clock_seconds(at)}
            for host, text in logs.items()
            for at, r, _partner, sent, secs in ROUND_LINE.findall(text)
        ),
        key=lambda side: side["at"],
    )
    rounds: list[dict] = []
    while sides:
        first = sides.pop(0)
        other = next((s for s in sides if s["host"] != first["host"] and s["at"] - first["at"] <= PAIR_SECONDS), None)
        if other is not None:
            sides.remove(other)
        logged = [first] if other is None else [first, other]
        total = sum(s["sent_bytes"] for s in logged) if other is not None else 2 * first["sent_bytes"]
        rounds.append(
            {
                "round": first["round"],
                "sides": logged,
                "bytes_per_parameter": total / parameters,
                "seconds": max(s["seconds"] for s in logged),
            }
        )
    return rounds


def swarm_run(codec: Compression, args: argparse.Namespace, workdir: Path, parameters: int) -> dict:
    from node.local_swarm import wait_for
    from tests.helpers.netns import TestBed
    from tests.helpers.swarms import make_swarm, peer_id_of

    table = {
        "model": {"preset": PRESET},
        "training": {
            "wire_compression": str(codec),
            "slow_link_compression": str(codec),
            # a fixed window tells what the pipeline can carry from what the window's control finds
            **(
                {"min_in_flight": args.wire_in_flight, "max_in_flight": args.wire_in_flight}
                if args.wire_in_flight
                else {}
            ),
        },
        "gossip": {"inner_steps": args.wire_inner_steps},
        "validation": {"interval": 0},  # held-out passes are stage 0's work but not training's
    }
    config_path = write_config(workdir / "swarm.toml", table)
    config = preset_config(PRESET, codec)
    t = config.training
    tokens_per_mb = t.microbatch_size * t.sequence_length
    pinned = cpu_sets(os.cpu_count() or 1)

    def launcher(host: str) -> list[str]:
        return bed.launcher(host) + (["taskset", "-c", pinned[host]] if host in pinned else [])

    with TestBed(offload=True) as bed:
        for host in HOSTS:
            bed.add_public_host(host)
            if args.wire_rtt_ms or args.wire_rate_mbit:  # both 0: the same swarm unshaped, for reference
                bed.shape(host, delay_ms=args.wire_rtt_ms / 4, rate_mbit=args.wire_rate_mbit or None)
        swarm = make_swarm(workdir)
        try:
            t0 = time.monotonic()
            swarm.bootstrap(
                "--config",
                str(config_path),
                host=bed.address("boot"),
                launcher=launcher("boot"),
                timeout=120,
            )
            peers = {
                host: swarm.join(
                    host,
                    *("--stage", str(stage), "--threads", "1", "--quiet", "--join-jitter", "0"),
                    host=bed.address(host),
                    launcher=launcher(host),
                )
                for host, stage in PLACEMENT.items()
            }
            wait_for(
                lambda: all(map(peer_id_of, peers.values())),
                300,
                lambda: "peers never joined:\n" + "\n".join(f"--- {n}\n{p.log()[-1500:]}" for n, p in peers.items()),
                interval=2.0,
            )
            wait_for(
                lambda: any(
                    p["loss"] is not None
                    for p in online(swarm.status(launcher=bed.launcher("boot"), timeout=STATUS_TIMEOUT), 0)
                ),
                300,
                "stage 0 never reported a loss",
                interval=3.0,
            )
            startup = time.monotonic() - t0
            log(f"  {codec}: 4 peers training after {startup:.0f} s; warm-up {args.wire_warmup:.0f} s")
            time.sleep(args.wire_warmup)
            window = measure(swarm, bed, args.wire_window, tokens_per_mb)
            log(f"  {codec}: {window['tokens_per_s']:.0f} tokens/s over {window['seconds']:.0f} s")
            replicas = ("s1a", "s1b")
            deadline = time.monotonic() + args.wire_round_wait
            while time.monotonic() < deadline and not any(ROUND_LINE.search(peers[h].log()) for h in replicas):
                time.sleep(5.0)
            rounds = rounds_of({h: peers[h].log() for h in replicas}, parameters)
            swarm.refresh_families()
            crashed = [n.name for n in swarm.nodes if n.process.poll() is not None]
            tracebacks = [n.name for n in swarm.nodes if "Traceback" in n.log()]
            netem = bed.delay_line_pid() is None
        finally:
            swarm.close()
            leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
            if leftovers:
                log(f"  WARNING: processes left behind: {leftovers}")
    return {
        "codec": str(codec),
        "startup_seconds": startup,
        "window": window,
        "tokens_per_s": window["tokens_per_s"],
        "rounds": rounds,
        "crashed": crashed,
        "tracebacks": tracebacks,
        "netem": netem,
        "cpu_sets": pinned,
    }


# ---- report ---------------------------------------------------------------------------------------


def _fmt_round(rounds: list[dict]) -> str:
    if not rounds:
        return "none applied"
    r = rounds[0]
    return f"{r['bytes_per_parameter']:.2f} bytes/param in {r['seconds']:.1f} s"


def summary_line(result: dict) -> str:
    """The one line scripts read: the default codec's figures (the 15m preset's own codec); the round
    is the slowest applied one and its bytes the most any round moved."""
    default = result["default_codec"]
    hop = next(r for r in result["hops"][PRESET] if r["codec"] == default)
    run = next((r for r in result["runs"] if r["codec"] == default), None)
    ratio = f"{run['ratio']:.2f}x" if run and run.get("ratio") is not None else "(not measured)"
    rounds = [r for run_ in result["runs"] for r in run_["rounds"]]
    noloco = "(none applied)"
    if rounds:
        most = max(r["bytes_per_parameter"] for r in rounds)
        noloco = f"{most:.2f} bytes/param in {max(r['seconds'] for r in rounds):.1f} s"
    return (
        f"wire: codec {default} {hop['fewer_than_fp16']:.1f}x fewer bytes than fp16, "
        f"tokens/s {ratio} of the limit, NoLoCo round {noloco}"
    )


def format_report(result: dict) -> str:
    lines = [
        f"## The wire at real size: {PRESET} over {result['rtt_ms']:g} ms RTT / {result['rate_mbit']:g} Mbit/s",
        "",
    ]
    lines.append(
        "| preset | codec | FORWARD bytes/token | BACKWARD bytes/token | fewer than fp16 | link bound (tokens/s) |"
    )
    lines.append("|---|---|---|---|---|---|")
    for preset, rows in result["hops"].items():
        for r in rows:
            lines.append(
                f"| {preset} ({r['tokens_per_hop']} tokens x {r['width']} a hop) | {r['codec']} "
                f"| {r['forward_bytes_per_token']:.1f} | {r['backward_bytes_per_token']:.1f} "
                f"| {r['fewer_than_fp16']:.1f}x | {r['link_bound_tokens_per_s']:,.0f} |"
            )
    lines.append("")
    bound = result.get("compute")
    if bound:
        stages = ", ".join(f"{s:.2f}" for s in bound["stage_seconds"])
        lines.append(
            f"Compute bound of {PRESET} here: stages take {stages} s a microbatch alone (1 thread, AdamW share "
            f"included), stage 1 has {bound['replicas'][1]} replicas, {bound['cores']} cores: "
            f"{bound['tokens_per_s']:.0f} tokens/s ({bound['limited_by']})."
        )
        lines.append("")
    if result.get("skipped"):
        lines.append(f"Swarm part skipped: {result['skipped']}.")
    else:
        lines.append(
            "| codec | stage-0 tokens/s | compute bound | link bound | ratio to the smaller | target | NoLoCo round "
            "| swarm / machine CPU cores | startup |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in result["runs"]:
            invalid = r["crashed"] or r["tracebacks"]
            met = r["ratio"] is not None and r["ratio"] >= TARGET_RATIO
            verdict = "INVALID" if invalid else ("met" if met else "NOT met")
            w = r["window"]
            lines.append(
                f"| {r['codec']} | {r['tokens_per_s']:.0f} in {w['seconds']:.0f} s | {bound['tokens_per_s']:.0f} "
                f"| {r['link_bound_tokens_per_s']:,.0f} | {r['ratio']:.2f}x | {verdict} | {_fmt_round(r['rounds'])} "
                f"| {w['swarm_cpu_cores']:.2f} / {w['machine_cpu_cores']:.2f} | {r['startup_seconds']:.0f} s |"
            )
        reference = result.get("reference")
        if reference is not None:
            default = next((r for r in result["runs"] if r["codec"] == reference["codec"]), None)
            w = reference["window"]
            lines.append(
                f"| {reference['codec']}, unshaped links | {reference['tokens_per_s']:.0f} in {w['seconds']:.0f} s "
                f"| {bound['tokens_per_s']:.0f} | - | {reference['ratio']:.2f}x | - | {_fmt_round(reference['rounds'])} "
                f"| {w['swarm_cpu_cores']:.2f} / {w['machine_cpu_cores']:.2f} | {reference['startup_seconds']:.0f} s |"
            )
            if default is not None and reference["tokens_per_s"]:
                lines += [
                    "",
                    f"What the shaped links cost the default codec: {default['tokens_per_s']:.0f} against "
                    f"{reference['tokens_per_s']:.0f} tokens/s unshaped, "
                    f"{default['tokens_per_s'] / reference['tokens_per_s']:.2f}x.",
                ]
        lines.append("")
        for r in result["runs"]:
            described = "; ".join(
                f"round {x['round']}: "
                + ", ".join(f"{s['host']} sent {s['sent_bytes']:,} B in {s['seconds']:.2f} s" for s in x["sides"])
                for x in r["rounds"]
            )
            lines.append(
                f"- {r['codec']}: stage-0 loss at the end {[round(x, 3) for x in r['window']['loss_end'] if x]}; "
                f"delay by {'netem' if r['netem'] else 'the userspace delay line'}; cores by host {r['cpu_sets']}; "
                f"NoLoCo rounds of a "
                f"{result['stage_parameters']:,}-parameter stage: {described or 'none'}"
                + (f"; EXITED: {r['crashed']}" if r["crashed"] else "")
                + (f"; Traceback in the logs of {r['tracebacks']}" if r["tracebacks"] else "")
            )
        lines.append("")
    lines.append(summary_line(result))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wire-codecs", nargs="+", choices=[str(c) for c in CODECS], default=[str(c) for c in SWARM_CODECS],
        help="codecs whose swarms run, in order (the hop table always has all)",
    )  # fmt: skip
    parser.add_argument("--wire-warmup", type=float, default=45.0, help="seconds after the first loss, not measured")
    parser.add_argument("--wire-window", type=float, default=100.0, help="the measured window (s)")
    parser.add_argument(
        "--wire-round-wait",
        type=float,
        default=240.0,
        help="how long to wait after the window for a first NoLoCo round",
    )
    parser.add_argument("--wire-rtt-ms", type=float, default=100.0, help="round trip of a path between two hosts")
    parser.add_argument(
        "--wire-rate-mbit",
        type=float,
        default=50.0,
        help="rate of every host's link, up and down (0 and 0 ms: unshaped)",
    )
    parser.add_argument(
        "--no-wire-reference",
        dest="wire_reference",
        action="store_false",
        help="skip the default codec's swarm on unshaped links (what the wire itself costs)",
    )
    parser.add_argument(
        "--wire-inner-steps", type=int, default=BENCH_INNER_STEPS, help="gossip.inner_steps (H) of the swarms"
    )
    parser.add_argument("--wire-workdir", help="where swarm logs go (default: a temporary directory)")
    parser.add_argument(
        "--wire-in-flight",
        type=int,
        default=0,
        help="a fixed in-flight window for stage 0 (min = max in flight); 0: the swarm's adaptive window",
    )


def apply_quick(args: argparse.Namespace) -> None:
    """A smoke run's timings: the default codec's swarm alone (no unshaped reference), a short warm-up
    and window."""
    args.wire_codecs, args.wire_warmup, args.wire_window, args.wire_round_wait = ["subspace8"], 10.0, 30.0, 120.0
    args.wire_reference = False


def _standalone_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="smoke timings: subspace8 only, 10 s warm-up, 30 s window")


def run(args: argparse.Namespace) -> dict:
    from tests.helpers.netns import namespaces_supported

    if getattr(args, "quick", False):
        apply_quick(args)
    config = preset_config(PRESET)
    result: dict = {
        "machine_before": machine_info(),
        "rtt_ms": args.wire_rtt_ms,
        "rate_mbit": args.wire_rate_mbit,
        "default_codec": str(config.training.wire_compression),
        "hops": {preset: hop_table(preset, args.wire_rate_mbit) for preset in (PRESET, HOP_SHAPE_ONLY)},
        "runs": [],
    }
    replicas = {stage: list(PLACEMENT.values()).count(stage) for stage in range(config.num_stages)}
    result["compute"] = compute_bound(config, replicas)
    result["stage_parameters"] = parameters = stage_parameters(config, 1)
    ok, why = namespaces_supported()
    if not ok:
        result.update(skipped=why, machine_after=machine_info())
        return result
    workdir = Path(args.wire_workdir or tempfile.mkdtemp(prefix="pipeswarm-bench-wire-"))
    link_bounds = {r["codec"]: r["link_bound_tokens_per_s"] for r in result["hops"][PRESET]}
    for name in args.wire_codecs:
        log(f"wire benchmark: {PRESET} swarm, codec {name} ... (logs in {workdir / name})")
        run_dir = workdir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        run_ = swarm_run(Compression(name), args, run_dir, parameters)
        run_["link_bound_tokens_per_s"] = link_bounds[name]
        limit = min(result["compute"]["tokens_per_s"], link_bounds[name])
        run_["ratio"] = run_["tokens_per_s"] / limit if limit else None
        result["runs"].append(run_)
    if args.wire_reference:  # the default codec's swarm again on unshaped links: what the wire itself costs
        default = result["default_codec"]
        log(f"wire benchmark: {PRESET} swarm, codec {default}, unshaped ... (logs in {workdir / 'unshaped'})")
        (workdir / "unshaped").mkdir(parents=True, exist_ok=True)
        unshaped = argparse.Namespace(**{**vars(args), "wire_rtt_ms": 0.0, "wire_rate_mbit": 0.0})
        reference = swarm_run(Compression(default), unshaped, workdir / "unshaped", parameters)
        reference["ratio"] = reference["tokens_per_s"] / result["compute"]["tokens_per_s"]
        result["reference"] = reference
    result["machine_after"] = machine_info()
    return result


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, _standalone_arguments, run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
