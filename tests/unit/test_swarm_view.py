"""The swarm view forgets a peer only when its record expires, not when one DHT read misses it."""

from __future__ import annotations

from dht.records import PeerRecord
from dht.swarm_view import merge_reads


def record(peer_id: str, stage: int, expires: float, state: str = "online") -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=stage, state=state, expires=expires)


def test_a_missed_but_unexpired_record_is_kept():
    previous = {0: [record("a", 0, 110.0)], 1: [record("b", 1, 110.0), record("c", 1, 110.0)]}
    fresh = {0: [record("a", 0, 115.0)], 1: [record("c", 1, 115.0)]}  # this read missed b
    merged = merge_reads(previous, fresh, now=105.0)
    assert [r.peer_id for r in merged[1]] == ["b", "c"]
    assert merged[0][0].expires == 115.0  # the fresh record wins over the old one


def test_an_expired_record_is_dropped_and_a_newer_state_replaces_the_old():
    previous = {0: [record("a", 0, 100.0), record("b", 0, 120.0)]}
    fresh = {0: [record("b", 0, 121.0, state="leaving")]}
    merged = merge_reads(previous, fresh, now=105.0)
    assert [(r.peer_id, r.state) for r in merged[0]] == [("b", "leaving")]


def test_a_peer_that_moved_is_only_at_the_stage_of_its_newest_record():
    def at(stage: int, updated: float) -> PeerRecord:
        return PeerRecord(peer_id="m", stage=stage, state="online", expires=200.0, updated=updated)

    previous = {1: [], 2: [at(2, 90.0), record("s", 2, 110.0)]}
    fresh = {1: [at(1, 100.0)], 2: [record("s", 2, 115.0)]}  # the read missed m's `leaving` at stage 2
    merged = merge_reads(previous, fresh, now=105.0)
    assert [r.peer_id for r in merged[1]] == ["m"]
    assert [r.peer_id for r in merged[2]] == ["s"]
    # the same when one read returns both of its entries
    merged = merge_reads({}, {1: [at(1, 100.0)], 2: [at(2, 90.0)]}, now=105.0)
    assert ([r.peer_id for r in merged[1]], merged[2]) == (["m"], [])
