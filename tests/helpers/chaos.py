"""A chaos driver: a training swarm on loopback whose peers are SIGKILLed at random and replaced.

Stage 0 + `block_stages` block stages, `peers_per_stage` peers each, every process its own p2pd.
Every `kill_every` seconds (jittered) the driver kills, with `kill -9` on the peer and its p2pd (a
machine gone): usually one random block-stage peer, sometimes (`whole_stage_chance`) every peer of
one block stage, but never while another stage is without an online peer (two lost stages may be
beyond CheckFree's reach, which stops training by design); after `replace_after` seconds it starts
as many replacements with `--stage auto`, which claim the stage that needs help most. Stage 0's peers are never killed: they hold the data
and the head in this design, and the swarm's progress is measured from them.

`ChaosRun.observe()` is called every `observe_every` seconds and records, from the swarm's own
records: stage-0 steps, stage-0 loss, which stages have an online peer; the report says per minute
how many stage-0 steps were made, how long each stage was without an online peer (a recovery time),
and the loss at the start and at the end.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

from node.local_swarm import NodeProcess, Swarm, wait_for
from tests.helpers.swarms import SHORT_JOIN_JITTER, join_peer

CHAOS_TOML = """
num_stages = {num_stages}
[training]
microbatch_size = 4
microbatches_per_step = 2
sequence_length = 32
warmup_steps = 5
hop_timeout = 5.0
[gossip]
inner_steps = 10
[heartbeat]
period = 1.0
ttl = 4.0
[recovery]
checkfree_plus = true
lost_grace = 2.0
rebalance_wait = 3.0
edge_copy_interval = 5
"""
STATUS_COUNTS = re.compile(r"done (\d+) retried (\d+) dropped (\d+)")


@dataclass
class Sample:
    at: float
    stage0_steps: dict[str, int]  # each online stage-0 peer's inner step, by peer id
    loss: float | None
    empty_stages: set[int]


@dataclass
class ChaosRun:
    swarm: Swarm
    block_stages: int = 3
    peers_per_stage: int = 2
    kill_every: float = 20.0
    whole_stage_chance: float = 0.25
    replace_after: float = 3.0
    observe_every: float = 2.0
    rng: random.Random = field(default_factory=lambda: random.Random(1234))
    peers: dict[int, list[NodeProcess]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    killed: int = 0
    started: int = 0
    kills: list[tuple[float, int, int]] = field(default_factory=list)  # (time, stage, peers killed)

    @property
    def num_stages(self) -> int:
        return self.block_stages + 1

    def start(self) -> None:
        toml = self.swarm.workdir / "chaos.toml"
        toml.write_text(CHAOS_TOML.format(num_stages=self.num_stages))
        self.swarm.bootstrap("--config", str(toml))
        for stage in range(self.num_stages):
            self.peers[stage] = [self._join(stage) for _ in range(self.peers_per_stage)]
        wait_for(
            lambda: all(
                any(p["state"] == "online" and p["inner_step"] > 0 for p in s["peers"])
                for s in self.swarm.observe()["stages"]
            ),
            240,
            "the chaos swarm never trained on every stage",
        )

    def _join(self, stage: int | str) -> NodeProcess:
        self.started += 1
        return join_peer(self.swarm, f"peer{self.started}", stage, *SHORT_JOIN_JITTER)

    def kill(self, victims: list[NodeProcess]) -> None:
        for node in victims:
            node.kill_hard()
        self.killed += len(victims)

    def strike(self) -> None:
        """Kill one peer, or a whole stage; replacements join with --stage auto after a while."""
        stage = self.rng.randrange(1, self.num_stages)
        alive = [n for n in self.peers[stage] if n.process.poll() is None]
        if not alive:
            return
        whole = self.rng.random() < self.whole_stage_chance
        if whole and self.samples and self.samples[-1].empty_stages:
            # another stage is still without a peer: losing a second whole stage now may leave a lost
            # stage with no neighbour to rebuild it from, which by design stops training
            # (docs/reliability.md; test_swarm_recovery checks that case), so one peer dies instead
            whole = False
        victims = alive if whole else [self.rng.choice(alive)]
        self.kill(victims)
        self.kills.append((time.monotonic(), stage, len(victims)))
        self.peers[stage] = [n for n in self.peers[stage] if n not in victims]
        time.sleep(self.replace_after)
        for _ in victims:  # --stage auto: the newcomer goes where help is needed, not necessarily here
            newcomer = self._join("auto")
            self.peers.setdefault(stage, []).append(newcomer)

    def observe(self) -> None:
        snapshot = self.swarm.observe()
        online = {s["stage"]: [p for p in s["peers"] if p["state"] == "online"] for s in snapshot["stages"]}
        losses = [p["loss"] for p in online.get(0, []) if p["loss"] is not None]
        self.samples.append(
            Sample(
                at=time.monotonic(),
                stage0_steps={p["peer_id"]: p["inner_step"] for p in online.get(0, [])},
                loss=sum(losses) / len(losses) if losses else None,
                empty_stages={stage for stage in range(self.num_stages) if not online.get(stage)},
            )
        )

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        next_kill = time.monotonic() + self.kill_every * self.rng.uniform(0.5, 1.0)
        while time.monotonic() < deadline:
            if time.monotonic() >= next_kill:
                self.strike()
                next_kill = time.monotonic() + self.kill_every * self.rng.uniform(0.5, 1.5)
            self.observe()
            time.sleep(self.observe_every)

    # -- the report ----------------------------------------------------------------------------
    def steps_per_window(self, window: float) -> list[int]:
        """Stage-0 steps made in each complete `window` seconds of the run: per stage-0 peer, the growth of
        its inner step since the last sample that showed it online. Per peer, because a swarm
        total drops when a stage-0 peer moves to a lost stage (the rebalancer may take one) or its
        record is briefly missing from a snapshot, and that drop would hide the other peers' steps."""
        if not self.samples:
            return []
        start, windows = self.samples[0].at, {}
        last_seen = dict(self.samples[0].stage0_steps)
        for sample in self.samples[1:]:
            index = int((sample.at - start) // window)
            made = sum(max(0, steps - last_seen.get(peer, steps)) for peer, steps in sample.stage0_steps.items())
            last_seen.update(sample.stage0_steps)
            windows[index] = windows.get(index, 0) + made
        complete = int((self.samples[-1].at - start) // window)  # a last partial window is not reported
        return [windows.get(i, 0) for i in range(complete)]

    def outages(self) -> list[float]:
        """How long each block stage went without an online peer, per outage (seconds)."""
        outages, since = [], {}
        for sample in self.samples:
            for stage in range(1, self.num_stages):
                if stage in sample.empty_stages:
                    since.setdefault(stage, sample.at)
                elif stage in since:
                    outages.append(sample.at - since.pop(stage))
        end = self.samples[-1].at if self.samples else 0.0
        outages.extend(end - at for at in since.values())  # still out at the end: counted to the end
        return outages

    def microbatches(self) -> dict[str, int]:
        """Stage 0's own counts, from the last status line of each stage-0 peer's log
        (node/server/progress.py): microbatches completed, attempts lost to a dead or failed hop
        (each run again elsewhere), and microbatches dropped after every retry failed."""
        totals = {"done": 0, "retried": 0, "dropped": 0}
        for node in self.peers.get(0, []):
            lines = STATUS_COUNTS.findall(node.log())
            if lines:
                for key, value in zip(totals, lines[-1]):
                    totals[key] += int(value)
        return totals

    def losses(self) -> tuple[float | None, float | None]:
        known = [s.loss for s in self.samples if s.loss is not None]
        return (known[0], known[-1]) if known else (None, None)
