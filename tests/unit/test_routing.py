"""node/pipeline/routing.py: SWARM's load-aware randomized next-stage choice, on fake clocks."""

import random
from collections import Counter

import pytest

from dht.records import PeerRecord
from node.config import ConfigError, RoutingMode, SwarmConfig
from node.pipeline.routing import BanList, Router, StageRouter
from tests.helpers.clock import FakeClock


def rec(peer_id, throughput=1.0, stage=1, state="online", expires=0.0):
    return PeerRecord(peer_id=peer_id, stage=stage, state=state, throughput=throughput, expires=expires)


def make(records, seed=0, clock=None):
    clock = clock or FakeClock()
    router = StageRouter(random.Random(seed), clock=clock)
    router.update_peers(records)
    return router, clock


def run(router, clock, n, dt, **kwargs):
    counts = Counter()
    for _ in range(n):
        counts[router.choose(**kwargs)] += 1
        clock.advance(dt)
    return counts


def test_faster_peer_gets_its_throughput_share():
    # arrivals (10/s) above the stage's capacity (1 + 3 = 4/s): the stage is busy, shares ~ 1:3
    router, clock = make([rec("slow", 1.0), rec("fast", 3.0)])
    counts = run(router, clock, 400, dt=0.1)
    assert counts["fast"] / 400 == pytest.approx(0.75, abs=0.02)
    # and at exactly the stage's capacity
    router, clock = make([rec("slow", 1.0), rec("fast", 3.0)])
    counts = run(router, clock, 400, dt=0.25)
    assert counts["fast"] / 400 == pytest.approx(0.75, abs=0.03)


def test_idle_stage_sends_to_the_peer_that_finishes_first():
    # load decays with real time: nobody is busy, so the faster peer (earliest completion) wins
    router, clock = make([rec("slow", 1.0), rec("fast", 3.0)])
    counts = run(router, clock, 50, dt=10.0)
    assert counts == Counter({"fast": 50})
    assert all(load == 0.0 for _, load, _ in router.loads())


def test_equal_peers_split_evenly_with_random_tie_breaks():
    router, clock = make([rec("a"), rec("b")])
    counts = run(router, clock, 200, dt=0.1)
    assert abs(counts["a"] - counts["b"]) <= 2
    firsts = {make([rec("a"), rec("b")], seed=seed)[0].choose() for seed in range(20)}
    assert firsts == {"a", "b"}
    # idle equal peers: every choice is a tie, drawn at random
    router, clock = make([rec("a"), rec("b"), rec("c")], seed=3)
    counts = run(router, clock, 300, dt=100.0)
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 60


def test_banned_peer_skipped_until_ban_expires_then_chosen_again():
    dht_time = FakeClock(5000.0)
    bans = BanList(clock=dht_time, min_seconds=10.0)
    router, clock = make([rec("a"), rec("b"), rec("c")])
    bans.ban("b", until=dht_time() + 30.0, reason="bad reply")
    assert bans.is_banned("b") and list(bans.active()) == ["b"]
    assert bans.active()["b"] == (5030.0, "bad reply")
    for _ in range(60):
        assert router.choose(bans=bans) != "b"
        clock.advance(0.2)
        dht_time.advance(0.49)
    assert bans.is_banned("b")
    dht_time.advance(1.0)  # past 5030
    assert not bans.is_banned("b") and bans.active() == {}
    counts = run(router, clock, 90, dt=0.2, bans=bans)
    # back at the current minimum: its fair third, neither flooded nor starved
    assert counts["b"] == pytest.approx(30, abs=3)


def test_ban_lasts_at_least_the_minimum_and_keeps_the_longer_ban():
    dht_time = FakeClock(100.0)
    bans = BanList(clock=dht_time, min_seconds=10.0)
    bans.ban("x", until=50.0, reason="record already expired")
    assert bans.active()["x"][0] == 110.0
    bans.ban("x", until=300.0, reason="second error")
    bans.ban("x", until=0.0, reason="third error")
    assert bans.active()["x"] == (300.0, "third error")
    assert bans.is_banned("x", now=299.0) and not bans.is_banned("x", now=300.0)


def test_new_peer_enters_at_current_minimum():
    router, clock = make([rec("a"), rec("b")])
    run(router, clock, 200, dt=0.2)  # 5 tasks/s into 2/s of capacity: large backlogs
    backlog = min(load for _, load, _ in router.loads())
    assert backlog > 50.0
    router.update_peers([rec("a"), rec("b"), rec("new")])
    assert dict((p, load) for p, load, _ in router.loads())["new"] == pytest.approx(backlog)
    first = run(router, clock, 30, dt=0.2)
    assert 7 <= first["new"] <= 13  # not flooded (entering idle would take all 30)
    later = run(router, clock, 300, dt=0.2)
    assert later["new"] / 300 == pytest.approx(1 / 3, abs=0.03)  # not starved


def test_new_peer_without_announced_throughput_uses_stage_median_then_its_announcement():
    router, _ = make([rec("a", 2.0), rec("b", 4.0), rec("c", 6.0)])
    router.update_peers([rec("a", 2.0), rec("b", 4.0), rec("c", 6.0), rec("d", 0.0)])
    assert router.throughput("d") == pytest.approx(4.0)
    router.update_peers([rec("a", 2.0), rec("b", 4.0), rec("c", 6.0), rec("d", 0.0)])
    assert router.throughput("d") == pytest.approx(4.0)  # still no announcement: the guess stays
    router.update_peers([rec("a", 2.0), rec("b", 4.0), rec("c", 6.0), rec("d", 2.0)])
    assert router.throughput("d") == pytest.approx(2.0)  # its own measurement, once announced
    empty, _ = make([rec("z", 0.0)])
    assert empty.throughput("z") == pytest.approx(1.0)


def test_vanished_and_non_online_peers_are_removed():
    router, clock = make([rec("a"), rec("b"), rec("c", state="joining")])
    assert [p for p, _, _ in router.loads()] == ["a", "b"]
    router.update_peers([rec("a"), rec("b", state="leaving")])
    assert [p for p, _, _ in router.loads()] == ["a"]
    assert set(run(router, clock, 20, dt=0.1)) == {"a"}
    router.release("b", 1.0)  # a late failure report about a vanished peer: ignored
    assert "b" not in router
    router.update_peers([])
    assert router.choose() is None


def test_exclude_retries_elsewhere():
    router, _ = make([rec("a", 1.0), rec("b", 5.0), rec("c", 2.0)])
    assert router.choose() == "b"
    assert router.choose(exclude={"b"}) == "c"
    assert router.choose(exclude=["b", "c"]) == "a"
    assert router.choose(exclude={"a", "b", "c"}) is None


def test_every_refresh_follows_the_latest_announcement():
    router, _ = make([rec("a", 2.0)])
    assert router.throughput("a") == pytest.approx(2.0)
    router.update_peers([rec("a", 100.0), rec("b", 3.0)])
    router.update_peers([rec("a", 50.0), rec("b", 6.0)])
    assert router.throughput("a") == pytest.approx(50.0)
    assert router.throughput("b") == pytest.approx(6.0)
    router.update_peers([rec("a", float("nan")), rec("b", -1.0)])  # unusable numbers change nothing
    assert (router.throughput("a"), router.throughput("b")) == (pytest.approx(50.0), pytest.approx(6.0))


def test_announced_slowdown_shifts_traffic():
    router, clock = make([rec("a", 1.0), rec("b", 1.0)])
    router.update_peers([rec("a", 1.0), rec("b", 0.25)])  # b measured itself 4x slower
    counts = run(router, clock, 500, dt=0.05)
    assert counts["a"] / 500 == pytest.approx(0.8, abs=0.03)


def test_charge_and_release():
    router, clock = make([rec("a", 2.0)])
    assert router.choose(task_size=3.0) == "a"
    assert router.loads() == [("a", pytest.approx(1.5), pytest.approx(2.0))]
    router.release("a", 3.0)
    assert router.loads()[0][1] == 0.0
    router.choose(task_size=2.0)
    clock.advance(0.4)
    assert router.loads()[0][1] == pytest.approx(0.6)


def test_no_candidate_returns_none():
    bans = BanList(clock=FakeClock(0.0))
    assert StageRouter(random.Random(0), clock=FakeClock()).choose() is None
    router, _ = make([rec("a")])
    bans.ban("a", until=100.0, reason="x")
    assert router.choose(bans=bans) is None


def test_router_refresh_filters_and_shares_bans():
    dht_time = FakeClock(500.0)
    clock = FakeClock()
    router = Router(random.Random(1), num_stages=3, clock=clock, dht_clock=dht_time)
    router.refresh(
        {
            1: [
                rec("p1", stage=1),
                rec("j1", stage=1, state="joining"),
                rec("x2", stage=2),
                rec("old", stage=1, expires=400.0),
                rec("live", stage=1, expires=600.0),
            ],
            2: [rec("p2", stage=2)],
            7: [rec("ignored", stage=7)],
        }
    )
    assert [p for p, _, _ in router.for_stage(1).loads()] == ["live", "p1"]
    assert router.choose(2) == "p2"
    router.ban("p2", until=dht_time() + 20.0, reason="error")
    assert router.choose(2) is None and router.for_stage(2).choose() == "p2"
    router.refresh({1: []})  # a stage not listed keeps its peers
    assert router.for_stage(1).choose() is None and "p2" in router.for_stage(2)
    assert router.for_stage(0).choose() is None
    with pytest.raises(ValueError):
        router.for_stage(3)


# ------------------------------------------------------------------ training.routing = "random" (NoLoCo)


def chi_square(counts: Counter, peers: list[str], draws: int) -> float:
    expected = draws / len(peers)
    return sum((counts[p] - expected) ** 2 / expected for p in peers)


# chi-square critical values at p = 0.001 by degrees of freedom: a fair draw exceeds them 1 time in 1000
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47}


def test_config_accepts_the_routing_modes_and_defaults_to_load_aware():
    assert SwarmConfig().training.routing is RoutingMode.LOAD_AWARE
    assert SwarmConfig().replace(training={"routing": "random"}).training.routing is RoutingMode.RANDOM
    assert SwarmConfig().replace(training={"routing": "shuffled"}).training.routing is RoutingMode.SHUFFLED
    with pytest.raises(ConfigError, match="load_aware, random, shuffled"):
        SwarmConfig().replace(training={"routing": "round_robin"})


def test_random_routing_is_uniform_whatever_the_speeds_and_loads():
    peers = ["a", "b", "c", "d", "e"]
    draws = 5000
    # throughputs 1..5 and a busy stage: load-aware would send 5x more to "e" than to "a"
    for seed in range(3):
        clock = FakeClock()
        router = StageRouter(random.Random(seed), clock=clock, mode=RoutingMode.RANDOM)
        router.update_peers([rec(p, float(i + 1)) for i, p in enumerate(peers)])
        counts = run(router, clock, draws, dt=0.01)
        assert set(counts) == set(peers)
        assert chi_square(counts, peers, draws) < CHI2_999[len(peers) - 1]
    # and an idle stage, where load-aware always picks the fastest
    clock = FakeClock()
    router = StageRouter(random.Random(7), clock=clock, mode=RoutingMode.RANDOM)
    router.update_peers([rec("slow", 1.0), rec("fast", 3.0)])
    counts = run(router, clock, 2000, dt=100.0)
    assert chi_square(counts, ["slow", "fast"], 2000) < 10.83  # df = 1


def test_random_routing_never_picks_banned_or_excluded_peers():
    dht_time = FakeClock(5000.0)
    bans = BanList(clock=dht_time, min_seconds=10.0)
    bans.ban("banned", until=dht_time() + 60.0, reason="errored")
    clock = FakeClock()
    router = StageRouter(random.Random(11), clock=clock, mode=RoutingMode.RANDOM)
    router.update_peers([rec(p) for p in ("a", "b", "c", "d", "banned", "skipped")])
    draws = 3000
    counts = run(router, clock, draws, dt=0.01, exclude={"skipped"}, bans=bans)
    assert set(counts) == {"a", "b", "c", "d"}
    assert chi_square(counts, ["a", "b", "c", "d"], draws) < CHI2_999[3]
    # not live: a joining peer is not routable in random mode either
    router.update_peers([rec("a"), rec("j", state="joining")])
    assert {router.choose() for _ in range(50)} == {"a"}
    # everything excluded or banned: nothing to choose
    assert router.choose(exclude={"a"}) is None


def test_random_routing_still_charges_and_releases_loads():
    router = StageRouter(random.Random(0), clock=FakeClock(), mode=RoutingMode.RANDOM)
    router.update_peers([rec("a", 2.0)])
    assert router.choose(task_size=3.0) == "a"
    assert router.loads() == [("a", pytest.approx(1.5), pytest.approx(2.0))]
    router.release("a", 3.0)
    assert router.loads()[0][1] == 0.0


def test_shuffled_routing_deals_every_peer_once_per_round_in_random_order():
    peers = ["a", "b", "c", "d"]
    clock = FakeClock()
    router = StageRouter(random.Random(3), clock=clock, mode=RoutingMode.SHUFFLED)
    # speeds 1..4: load-aware would favour "d"; the deck ignores speed and load
    router.update_peers([rec(p, float(i + 1)) for i, p in enumerate(peers)])
    rounds = [tuple(router.choose() for _ in peers) for _ in range(300)]
    assert all(sorted(dealt) == peers for dealt in rounds)  # equal shares, exactly, every round
    # the order is random: every one of the 4! permutations shows up, none far more often than fair
    orders = Counter(rounds)
    assert len(orders) == 24
    assert chi_square(orders, list(orders), len(rounds)) < 49.73  # df = 23, p = 0.001


def test_shuffled_routing_skips_peers_that_left_were_banned_or_are_excluded():
    dht_time = FakeClock(5000.0)
    bans = BanList(clock=dht_time, min_seconds=10.0)
    clock = FakeClock()
    router = StageRouter(random.Random(4), clock=clock, mode=RoutingMode.SHUFFLED)
    router.update_peers([rec(p) for p in ("a", "b", "c")])
    first = router.choose()
    rest = {p for p in ("a", "b", "c") if p != first}
    gone, kept = sorted(rest)
    router.update_peers([rec(first), rec(kept)])  # `gone` left with its card still in the deck
    assert router.choose() == kept  # the deck's last card, `gone` skipped
    assert gone not in {router.choose() for _ in range(6)}
    bans.ban(first, until=dht_time() + 60.0, reason="errored")
    assert {router.choose(bans=bans) for _ in range(10)} == {kept}
    assert router.choose(exclude={kept}, bans=bans) is None


def test_router_builds_every_stage_in_its_mode_and_load_aware_is_the_default():
    assert all(Router(random.Random(0), 4).for_stage(s).mode is RoutingMode.LOAD_AWARE for s in range(4))
    assert all(
        Router(random.Random(0), 4, mode=RoutingMode.RANDOM).for_stage(s).mode is RoutingMode.RANDOM for s in range(4)
    )
    # an explicit load_aware draws exactly what the default does (same seed, same clock)
    sequences = []
    for mode in ({}, {"mode": RoutingMode.LOAD_AWARE}):
        clock = FakeClock()
        router = StageRouter(random.Random(5), clock=clock, **mode)
        router.update_peers([rec("a", 1.0), rec("b", 2.0), rec("c", 2.0)])
        picks = []
        for _ in range(200):
            picks.append(router.choose())
            clock.advance(0.2)
        sequences.append(picks)
    assert sequences[0] == sequences[1]
    assert Counter(sequences[0])["a"] < Counter(sequences[0])["b"]  # still load-aware: slower gets less
