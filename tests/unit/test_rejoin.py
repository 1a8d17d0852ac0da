"""Re-entering the DHT after a partition: which peers to ping, and when."""

from __future__ import annotations

from node.p2p.rejoin import RejoinBook

BOOT = "QmVB964ah4GajudGjs7qNM3NNgVHCFZqgMtcW1f71V9qcE"
PEER = "QmQtybqGwVfhBkh9bc8KMnLaCnRKQ2RrFEqPmWxz2KTe2Y"
OTHER = "QmZe32DJMsHSsNQKxDjd48pwNGN37kRCFECGXwKVrMkwRc"
ME = "QmY7r7F7drDKYutGioTnTdjWfr4WjxabGevKVqCy6KWopb"
BOOT_ADDR = f"/ip4/10.77.1.2/tcp/4001/p2p/{BOOT}"


def ids(candidates: list[tuple[str, list[str]]]) -> list[str]:
    return [peer_id for peer_id, _ in candidates]


def test_every_known_peer_outside_the_table_is_a_way_back_initial_peers_first():
    book = RejoinBook(initial_peers=[BOOT_ADDR])
    book.remember(PEER, [f"/ip4/10.77.3.2/tcp/5/p2p/{PEER}"], now=0.0)
    book.remember(ME, ["/ip4/10.77.9.9/tcp/5"], now=0.0)
    connected = {OTHER: ["/ip4/10.77.4.2/tcp/6"]}
    candidates = book.candidates(100.0, connected, lambda peer_id: False, me=ME)
    assert ids(candidates) == [BOOT, OTHER, PEER]  # never this peer itself
    assert dict(candidates)[BOOT] == [BOOT_ADDR]
    assert dict(candidates)[PEER] == [f"/ip4/10.77.3.2/tcp/5/p2p/{PEER}"]  # kept after its record expired
    # peers still in the routing table need no ping: with the whole swarm there, nothing to do
    assert book.candidates(100.0, connected, lambda peer_id: peer_id != PEER, me=ME) == [candidates[2]]
    assert book.candidates(100.0, connected, lambda peer_id: True, me=ME) == []
    assert ids(book.candidates(100.0, connected, lambda peer_id: False, me=ME, limit=2)) == [BOOT, OTHER]


def test_a_silent_peer_is_retried_after_a_doubling_bounded_delay():
    book = RejoinBook(initial_peers=[BOOT_ADDR], base_delay=20.0, max_delay=60.0)
    book.remember(PEER, ["/ip4/10.77.3.2/tcp/5"], now=0.0)

    def tried(now: float, isolated: bool = False) -> bool:
        return PEER in ids(book.candidates(now, {}, lambda peer_id: False, me=ME, isolated=isolated))

    book.failed(PEER, now=0.0)
    assert not tried(19.0) and tried(20.0)
    book.failed(PEER, now=20.0)
    assert not tried(59.0) and tried(60.0)
    book.failed(PEER, now=60.0)  # 80 s would be next: capped at 60
    assert not tried(119.0) and tried(120.0)
    assert tried(119.0, isolated=True)  # with an empty routing table, everyone is worth a ping
    book.answered(PEER)
    book.failed(PEER, now=120.0)  # an answer resets the delay
    assert tried(140.0)


def test_initial_peers_are_tried_every_round():
    # after a heal, the peers cut off together must not find only each other (an island that sees
    # the other side's stage lost) while the initial peer waits out a delay earned during the cut
    book = RejoinBook(initial_peers=[BOOT_ADDR])
    for at in range(5):
        book.failed(BOOT, now=float(at))
    assert ids(book.candidates(5.0, {}, lambda peer_id: False, me=ME)) == [BOOT]


def test_remembered_peers_are_bounded_and_forgotten():
    book = RejoinBook(max_known=2, forget_after=100.0)
    for at, peer_id in enumerate((PEER, OTHER, BOOT)):
        book.remember(peer_id, ["/ip4/10.0.0.1/tcp/1"], now=float(at))
    assert ids(book.candidates(10.0, {}, lambda peer_id: False, me=ME)) == [BOOT, OTHER]  # newest first
    book.remember(OTHER, ["/ip4/10.0.0.1/tcp/1"], now=50.0)
    assert ids(book.candidates(120.0, {}, lambda peer_id: False, me=ME)) == [OTHER]
