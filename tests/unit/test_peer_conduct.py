"""Stream admission and bans for bad input (node/p2p/peer_conduct.py), on a fake clock."""

from __future__ import annotations

from node.p2p.bans import BanList
from node.p2p.peer_conduct import ConductLimits, PeerConduct
from tests.helpers.clock import FakeClock


def conduct(**limits: float) -> tuple[PeerConduct, FakeClock, BanList]:
    clock = FakeClock()
    limits = {"total_streams": 8, **limits}
    bans = BanList(clock=clock)
    c = PeerConduct(ConductLimits(**limits), ban_until=lambda p: clock.now + 100, bans=bans, clock=clock)
    return c, clock, bans


def test_streams_per_peer_and_in_total_are_capped_and_released():
    c, _, _ = conduct(streams_per_peer=2)
    assert c.admit("a") is None and c.admit("a") is None
    assert c.admit("a") == "too many streams from this peer"
    for peer in "bcdefg":
        assert c.admit(peer) is None
    assert c.open_streams() == 8 and c.admit("h") == "too many open streams"
    c.release("a")
    assert c.admit("h") is None and c.refused == 2


def test_peers_that_are_not_members_share_a_quarter_of_the_slots_and_members_keep_the_rest():
    members = {"member1", "member2"}
    clock = FakeClock()
    c = PeerConduct(
        ConductLimits(total_streams=16, streams_per_peer=8), clock=clock, is_member=lambda peer: peer in members
    )
    assert c.strangers_cap == 4
    for stranger in ("s1", "s2"):
        assert c.admit(stranger) is None and c.admit(stranger) is None  # a stranger hoards its 4
    assert c.admit("s3") == "too many open streams from peers that are not members"
    assert c.strangers_streams() == 4 and c.open_streams() == 4
    for member in sorted(members):
        for _ in range(6):
            assert c.admit(member) is None  # 12 streams: the members' three quarters are free
    assert c.open_streams() == 16 and c.admit("member1") == "too many open streams"
    assert c.release("s1") is True and c.strangers_streams() == 3
    assert c.admit("s3") is None and c.strangers_streams() == 4
    members.add("s2")  # s2 became a member since: its streams go back as what they were admitted as
    assert c.release("s2") and c.release("s2") and c.strangers_streams() == 2
    assert c.release("s2") is False and c.strangers_streams() == 2


def test_without_a_membership_rule_every_peer_uses_the_whole_limit():
    c, _, _ = conduct(streams_per_peer=8)
    for peer in ("a", "b"):
        for _ in range(4):
            assert c.admit(peer) is None
    assert c.open_streams() == 8 and c.strangers_streams() == 0


def test_a_release_without_its_admit_changes_no_count():
    c, _, _ = conduct(streams_per_peer=2, total_streams=3)
    assert c.admit("a") is None and c.admit("a") is None and c.admit("b") is None
    assert (c.open_streams(), c.open_streams("a"), c.open_streams("b")) == (3, 2, 1)
    for _ in range(5):
        assert c.release("stranger") is False  # never admitted: it cannot free a slot of the others
    assert (c.open_streams(), c.open_streams("a"), c.open_streams("b"), c.open_streams("stranger")) == (3, 2, 1, 0)
    assert c.admit("c") == "too many open streams"
    assert c.release("b") is True and c.release("b") is False  # its one slot, once
    assert (c.open_streams(), c.open_streams("a"), c.open_streams("b")) == (2, 2, 0)
    assert c.admit("a") == "too many streams from this peer"
    assert c.admit("c") is None and c.admit("b") == "too many open streams"
    assert c.release("a") is True and c.release("a") is True and c.release("a") is False
    assert c.release("c") is True
    assert (c.open_streams(), c.open_streams("a"), c.open_streams("c")) == (0, 0, 0)
    assert c.release("a") is False and c.open_streams() == 0
    assert c.admit("b") is None and c.open_streams() == 1  # the slots freed are usable again


def test_request_rate_is_a_token_bucket():
    c, clock, _ = conduct(requests_per_second=10, request_burst=5, streams_per_peer=100, total_streams=100)
    results = []
    for _ in range(7):
        results.append(c.admit("a"))
        c.release("a")
    assert results[:5] == [None] * 5 and results[5:] == ["request rate exceeded"] * 2
    clock.now += 0.2  # two tokens back
    assert c.admit("a") is None


def test_repeated_bad_input_bans_until_the_record_expires_and_strikes_decay():
    c, clock, bans = conduct(strikes_to_ban=3, strike_window=60)
    assert not c.strike("a", "bad frame") and not c.strike("a", "bad frame")
    clock.now += 61  # the first two strikes are forgotten
    assert not c.strike("a", "bad frame") and not c.strike("a", "bad frame")
    assert c.strike("a", "bad frame")
    assert c.is_banned("a") and bans.active()["a"][0] == clock.now + 100
    assert c.admit("a") == "banned for bad input" and c.admit("b") is None
    clock.now += 101
    assert not c.is_banned("a") and c.admit("a") is None


def test_a_ban_lasts_at_least_the_minimum_even_for_an_expiring_record():
    clock = FakeClock()
    c = PeerConduct(ConductLimits(strikes_to_ban=1, min_ban_seconds=30), ban_until=lambda p: 0.0, clock=clock)
    assert c.strike("a", "x")
    clock.now += 29
    assert c.is_banned("a")
    clock.now += 2
    assert not c.is_banned("a")
