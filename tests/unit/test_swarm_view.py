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
