"""Spot-checks in a real multi-process swarm: peers that compute wrong are caught and banned.

A swarm of 2 stages on loopback: one stage-0 peer (it routes every hop to stage 1, so it runs the
routers' checks) and three replicas of block stage 1, one of them faulty. The faulty one is a test
wrapper (tests/helpers/faulty_node.py) that alters the stage's computation and nothing else. Kinds
are tried one after another in the same swarm: a faulty peer joins, the test waits until the
stage-0 peer's record lists it as banned (the catch time it prints runs from the faulty peer's
first `online` record) and until an honest stage-1 replica banned it too (the replicas' audits:
how its gossip gets refused), then ends it and the next kind joins. Afterwards training goes on
and the loss comes back to where it was before the first faulty peer joined.

The check rate is raised (0.3) so that a short test sees enough checks; catch times at the default
rate are in docs/verification.md. The default suite runs one kind (outputs replaced by zeros, a
gross fault, without waiting for the audits); all four (scaled, noise, zeros, sign-flipped
gradients), with the audits, are marked slow (`make slow`), as is a 10-minute honest run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from node.local_swarm import NodeProcess, Swarm
from node.monitor.observer import observe
from tests.helpers.faulty_node import FaultKind
from tests.helpers.swarms import make_swarm, peer_id_of

ONLINE_TIMEOUT = 150.0
CATCH_TIMEOUT = 240.0  # a faulty peer that is online and not banned by then fails the test (scale: 91 s seen)
RECOVERY_TIMEOUT = 90.0
# PIPESWARM_SPOT_CHECK_RATE measures catch times at another rate (docs/verification.md: 0.02)
CHECK_RATE = float(os.environ.get("PIPESWARM_SPOT_CHECK_RATE", "0.3"))
CONFIG = f"""
[training]
routing = "random"
microbatches_per_step = 2
[gossip]
inner_steps = 10
round_timeout = 10.0
[verification]
rate = {CHECK_RATE}
raised_rate = 0.5
audit_seconds = 2.0
"""


def online(snapshot: dict, stage: int) -> list[dict]:
    return [p for p in snapshot["stages"][stage]["peers"] if p["state"] == "online"]


def stage0(snapshot: dict) -> dict | None:
    peers = online(snapshot, 0)
    return peers[0] if peers else None


def record_of(snapshot: dict, peer_id: str) -> dict | None:
    return next((p for stage in snapshot["stages"] for p in stage["peers"] if p["peer_id"] == peer_id), None)


def banned_by(snapshot: dict, peer_id: str) -> set[str]:
    """The peers whose records list `peer_id` as banned after spot-checks."""
    return {
        p["peer_id"]
        for stage in snapshot["stages"]
        for p in stage["peers"]
        if p.get("verification") and peer_id in p["verification"]["bans"]
    }


async def poll(observer, predicate, timeout: float, what: str, logs: list[NodeProcess]) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = await observer.snapshot()
        if predicate(snapshot):
            return snapshot
        await asyncio.sleep(1.0)
    tails = "\n".join(f"--- {node.name}\n{node.log()[-1500:]}" for node in logs)
    raise AssertionError(f"{what} within {timeout:.0f} s:\n{tails}")


def mean_loss(samples: list[float]) -> float:
    return sum(samples) / len(samples)


async def join_faulty(swarm: Swarm, observer, kind: FaultKind) -> tuple[NodeProcess, dict]:
    """Start a faulty peer of `kind` on stage 1 and wait until it is online. Seen under heavy load
    (load average 14 on 2 cores): a joiner's first DHT read of stage 1 came back empty although
    both honest replicas were online, it tried to rebuild the stage and exited; that join problem
    is not what this test is about, so one such failed start is retried (and printed)."""
    for attempt in range(2):
        faulty = swarm.join(
            f"faulty-{kind}-{attempt}",
            "--stage",
            "1",
            "--threads",
            "1",
            "--quiet",
            python_prefix=["-m", "tests.helpers.faulty_node", kind.value],
        )
        deadline = time.monotonic() + ONLINE_TIMEOUT
        while time.monotonic() < deadline and faulty.process.poll() is None:
            snapshot = await observer.snapshot()
            pid = peer_id_of(faulty)
            if pid is not None and any(p["peer_id"] == pid for p in online(snapshot, 1)):
                return faulty, snapshot
            await asyncio.sleep(1.0)
        print(f"the {kind} peer did not come online (attempt {attempt + 1}):\n{faulty.log()[-1500:]}")
    raise AssertionError(f"the {kind} peer did not come online in two attempts")


async def run(swarm: Swarm, kinds: list[FaultKind], honest_seconds: float, audits: bool) -> None:
    async with observe(swarm.initial_peers, None) as observer:
        ready = await poll(
            observer,
            lambda s: stage0(s) is not None and stage0(s)["loss"] is not None and len(online(s, 1)) == 2,
            ONLINE_TIMEOUT,
            "the honest swarm did not come online",
            swarm.nodes,
        )
        router = stage0(ready)["peer_id"]  # its record may lapse for a moment under load: keep its id
        # some honest training first: the loss the swarm must come back to (and past settle_steps,
        # for the fine tolerances a 1.5x scale needs)
        await asyncio.sleep(honest_seconds)
        honest_losses = []
        for _ in range(10):
            if (entry := record_of(await observer.snapshot(), router)) is not None and len(honest_losses) < 5:
                honest_losses.append(entry["loss"])
            await asyncio.sleep(1.0)
        before = mean_loss(honest_losses)
        print(f"\nhonest swarm: stage-0 loss {before:.3f}")

        faulty_ids = set()
        for kind in kinds:
            faulty, snapshot = await join_faulty(swarm, observer, kind)
            joined = time.monotonic()
            faulty_id = peer_id_of(faulty)
            faulty_ids.add(faulty_id)
            snapshot = await poll(
                observer,
                lambda s: router in banned_by(s, faulty_id),
                CATCH_TIMEOUT,
                f"the stage-0 router did not ban the {kind} peer",
                [faulty, *swarm.nodes[:3]],
            )
            caught = audited = time.monotonic() - joined
            if audits:
                snapshot = await poll(
                    observer,
                    lambda s: len(banned_by(s, faulty_id) - {router}) >= 1,
                    CATCH_TIMEOUT,
                    f"no stage-1 replica banned the {kind} peer in an audit",
                    [faulty, *swarm.nodes[:4]],
                )
                audited = time.monotonic() - joined
            report = (record_of(snapshot, router) or {}).get("verification") or {"checks": "?", "disagreements": "?"}
            mate = f", by a stage mate after {audited:.1f} s" if audits else ""
            print(
                f"{kind}: banned by the router {caught:.1f} s after it came online{mate}; "
                f"router's checks {report['checks']}, disagreements {report['disagreements']}"
            )
            honest = [p for p in online(snapshot, 1) if p["peer_id"] != faulty_id]
            assert len(honest) == 2 and not any(banned_by(snapshot, p["peer_id"]) for p in honest), (
                "an honest replica was banned"
            )
            faulty.process.terminate()
            with contextlib.suppress(Exception):
                faulty.process.wait(timeout=30)

        last = await poll(observer, lambda s: record_of(s, router) is not None, 30.0, "no router record", [])
        steps_then = record_of(last, router)["inner_step"]
        recovered = await poll(
            observer,
            lambda s: (
                (entry := record_of(s, router)) is not None
                and entry["loss"] <= before + 0.1
                and entry["inner_step"] > steps_then
            ),
            RECOVERY_TIMEOUT,
            f"training did not go on with the loss back to {before:.3f} + 0.1",
            swarm.nodes[:4],
        )
        print(f"training goes on: loss {record_of(recovered, router)['loss']:.3f} (honest swarm before: {before:.3f})")
        # the faulty peers are ended, but a DHT read right after may still return one's last `online`
        # record (its farewell had not reached that DHT node yet): only the honest peers are checked
        honest_online = [p for p in online(recovered, 1) + online(recovered, 0) if p["peer_id"] not in faulty_ids]
        assert honest_online and not any(banned_by(recovered, p["peer_id"]) for p in honest_online), (
            "an honest peer was banned"
        )


def start(tmp_path: Path) -> Swarm:
    config = tmp_path / "swarm.toml"
    config.write_text(CONFIG)
    swarm = make_swarm(tmp_path)
    swarm.bootstrap(
        "--config", str(config), "--num-stages", "2", "--heartbeat-period", "1", "--heartbeat-ttl", "5",
        timeout=ONLINE_TIMEOUT,
    )  # fmt: skip
    swarm.join("stage0", "--stage", "0", "--threads", "1", "--quiet")
    for i in range(2):
        swarm.join(f"honest{i}", "--stage", "1", "--threads", "1", "--quiet")
    return swarm


def run_kinds(tmp_path: Path, kinds: list[FaultKind], honest_seconds: float = 20.0, audits: bool = True) -> None:
    swarm = None
    try:
        swarm = start(tmp_path)
        asyncio.run(run(swarm, kinds, honest_seconds, audits))
    finally:
        if swarm is not None:
            swarm.close()
            leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
            assert not leftovers, f"processes left behind: {leftovers}"


@pytest.mark.timeout(420)
def test_a_replica_returning_zeros_is_caught_and_banned(tmp_path):
    """The default suite's short version: a gross fault, caught even before the stage settles, so
    little honest training first; the stage mates' audits are left to the slow test."""
    run_kinds(tmp_path, [FaultKind.ZEROS], honest_seconds=5.0, audits=False)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_kind_of_faulty_replica_is_caught_and_banned(tmp_path):
    run_kinds(tmp_path, list(FaultKind))


HONEST_SECONDS = float(os.environ.get("PIPESWARM_HONEST_SECONDS", "600"))


async def watch_honest(swarm: Swarm, seconds: float) -> dict:
    """Poll an honest swarm for `seconds`; the last snapshot, and the worst seen on the way."""
    async with observe(swarm.initial_peers, None) as observer:
        await poll(
            observer,
            lambda s: len(online(s, 0)) == 2 and len(online(s, 1)) == 3,
            ONLINE_TIMEOUT,
            "the honest swarm did not come online",
            swarm.nodes,
        )
        end, worst, snapshot = time.monotonic() + seconds, {"strikes": 0.0, "banned_by": 0}, {}
        while time.monotonic() < end:
            await asyncio.sleep(5.0)
            snapshot = await observer.snapshot()
            for stage in snapshot["stages"]:
                for peer in stage["peers"]:
                    worst["strikes"] = max(worst["strikes"], peer["strikes"])
                    worst["banned_by"] = max(worst["banned_by"], peer["banned_by"])
        return {"last": snapshot, "worst": worst}


@pytest.mark.slow
@pytest.mark.timeout(HONEST_SECONDS + 400)
def test_an_honest_swarm_checked_at_a_raised_rate_bans_nobody(tmp_path):
    """2 stage-0 peers and 3 stage-1 replicas for 10 minutes (PIPESWARM_HONEST_SECONDS), every
    hop checked with probability 0.2 and every replica auditing a mate every 5 s."""
    config = tmp_path / "swarm.toml"
    config.write_text(
        CONFIG.replace(f"rate = {CHECK_RATE}", "rate = 0.2").replace("audit_seconds = 2.0", "audit_seconds = 5.0")
    )
    swarm = make_swarm(tmp_path)
    try:
        swarm.bootstrap(
            "--config", str(config), "--num-stages", "2", "--heartbeat-period", "1", "--heartbeat-ttl", "5",
            timeout=ONLINE_TIMEOUT,
        )  # fmt: skip
        for i in range(5):
            swarm.join(f"peer{i}", "--stage", str(0 if i < 2 else 1), "--threads", "1", "--quiet")
        seen = asyncio.run(watch_honest(swarm, HONEST_SECONDS))
    finally:
        swarm.close()
        leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
        assert not leftovers, f"processes left behind: {leftovers}"
    reports = [p["verification"] for s in seen["last"]["stages"] for p in s["peers"] if p.get("verification")]
    checks = sum(r["checks"] for r in reports)
    largest = max(reports, key=lambda r: r["largest_agreeing"])
    print(
        f"\nhonest run of {HONEST_SECONDS:.0f} s: {checks} checks compared, "
        f"{sum(r['disagreements'] for r in reports)} disagreements, {sum(r['served'] for r in reports)} answers served; "
        f"largest agreeing distance {largest['largest_agreeing']:.3f} (tolerance then {largest['tolerance']:.3f}), "
        f"largest agreeing gradient measure {max(r['largest_gradient'] for r in reports):.3f}; "
        f"most strikes against a peer {seen['worst']['strikes']:.2f}, most bans of a peer {seen['worst']['banned_by']}"
    )
    assert checks >= 50, "too few checks to say anything"
    assert seen["worst"]["banned_by"] == 0, "an honest peer was banned"
