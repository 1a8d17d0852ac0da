"""SWARM's rule for a routed hop (docs/algorithms.md, "SWARM routing"): a peer that errors is banned
until its record expires; a peer that times out is only skipped, the hop retried on another peer."""

from __future__ import annotations

import asyncio
import gc
import random
from types import SimpleNamespace

import pytest
import torch

from dht.records import PeerRecord, PeerState
from node.p2p.transport import Transport, TransportError, timed_out
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.routing import Router
from protocol import MessageKind
from tests.helpers.known_peers import KnownPeers
from tests.helpers.posted import PostingTransport, forward_header, outcome, pending

# valid base58 peer ids (Transport parses them before opening a stream)
PEER_IDS = ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z")


def timeout_error(peer_id: str) -> TransportError:
    try:
        raise TransportError(f"forward to {peer_id} timed out after 0.1 s") from TimeoutError()
    except TransportError as e:
        return e


def refused_error(peer_id: str) -> TransportError:
    try:
        raise TransportError(f"cannot open forward stream to {peer_id}") from ConnectionRefusedError()
    except TransportError as e:
        return e


class ScriptedTransport(PostingTransport):
    """Each peer's send fails with what `failures` says (an exception to raise), or the hop is taken,
    or settles later with what the test does to the outcome `later` holds for that peer."""

    def __init__(self, failures: dict[str, TransportError], later: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.failures = failures
        self.later: dict[str, asyncio.Future | None] = dict.fromkeys(later)

    def settle(self, peer_id: str, payload: bytes) -> asyncio.Future:
        if peer_id in self.failures:
            raise self.failures[peer_id]
        if peer_id in self.later:
            self.later[peer_id] = pending()
            return self.later[peer_id]
        return outcome()


def setup(failures: dict[str, TransportError], peers: tuple[str, ...] = ("a", "b"), later: tuple[str, ...] = ()):
    # "a" announces 10x the throughput of "b": on an idle stage load-aware routing tries "a" first
    router = Router(random.Random(0), num_stages=2)
    speeds = {"a": 10.0, "b": 1.0, "c": 1.0}
    router.refresh({1: [PeerRecord(p, 1, PeerState.ONLINE, throughput=speeds[p]) for p in peers]})
    transport = ScriptedTransport(failures, later)
    stats = PipelineStats()
    hops = HopSender(transport, router, stats, 0.1, 3, KnownPeers())
    return router, transport, stats, hops


def send(hops: HopSender, microbatch_id: int = 1) -> str | None:
    lost: list[int] = []
    peer_id = asyncio.run(hops.send_routed(1, "forward", forward_header(microbatch_id), {}, lambda: lost.append(1)))
    assert lost == ([] if peer_id else [1])  # a hop no peer was sent is lost, once
    return peer_id


def test_a_timed_out_peer_is_retried_elsewhere_and_not_banned():
    router, transport, stats, hops = setup({"a": timeout_error("a")})
    assert send(hops)
    assert transport.sent_to == ["a", "b"]
    assert not router.bans.is_banned("a") and router.bans.active() == {}
    assert stats.timeouts == 1
    # the next microbatch may try it again (it was only slow): it is still a candidate
    assert "a" in router.for_stage(1) and router.choose(1, exclude={"b"}) == "a"


def test_a_peer_that_errors_is_banned_and_the_hop_retried_elsewhere():
    router, transport, stats, hops = setup({"a": refused_error("a")})
    assert send(hops)
    assert transport.sent_to == ["a", "b"]
    assert router.bans.is_banned("a") and not router.bans.is_banned("b")
    assert stats.timeouts == 0
    assert send(hops, 2) and transport.sent_to[-1] == "b"  # the banned peer is avoided from then on


def test_a_hop_whose_every_peer_times_out_fails_without_any_ban():
    router, transport, stats, hops = setup({p: timeout_error(p) for p in "abc"}, peers=("a", "b", "c"))
    assert not send(hops)
    assert sorted(transport.sent_to) == ["a", "b", "c"]  # each tried once (excluded after its timeout)
    assert router.bans.active() == {} and stats.timeouts == 3


def test_a_timeout_keeps_the_peer_charged_an_error_releases_it():
    # SWARM's balancer keeps the heap entry a timed-out call pushed; a banned peer is un-charged
    router, _, _, hops = setup({"a": timeout_error("a")})
    assert send(hops)
    load_a = {p: load for p, load, _ in router.for_stage(1).loads()}["a"]
    assert load_a > 0.0
    router, _, _, hops = setup({"a": refused_error("a")})
    assert send(hops)
    assert {p: load for p, load, _ in router.for_stage(1).loads()}["a"] == 0.0


# ------------------------------------------------------------------ what the real Transport raises


class SilentWriter:
    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class SilentP2P:
    """Opens streams whose peer never answers, or refuses to open them."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse

    async def call_binary_stream_handler(self, peer_id, protocol):
        if self.refuse:
            raise ConnectionRefusedError("p2pd: failed to dial")
        return None, asyncio.StreamReader(), SilentWriter()


def forward_message(transport: Transport):
    origin = PEER_IDS[1]
    meta = {"microbatch_id": 1, "origin": origin, "path": [origin], "order": [1], "hop": 1}
    return transport.message(MessageKind.FORWARD, meta, {"hidden": torch.zeros(1, 2, 4)})


def request_error(refuse: bool) -> TransportError:
    async def main() -> TransportError:
        transport = Transport(SilentP2P(refuse), "swarm", 0)  # type: ignore[arg-type]
        with pytest.raises(TransportError) as caught:
            await transport.request(PEER_IDS[0], "forward", forward_message(transport), 0.05)
        return caught.value

    return asyncio.run(main())


def test_transport_timeouts_are_told_apart_from_failures():
    silent, refused = request_error(refuse=False), request_error(refuse=True)
    assert "timed out" in str(silent) and timed_out(silent)  # no reply within the hop timeout
    assert "cannot open" in str(refused) and not timed_out(refused)  # the stream could not be opened
    assert not timed_out(TransportError("peer refused forward: not this stage"))  # an ERROR reply
    assert timed_out(TimeoutError())


# ------------------------------------------------------------------ refusals after the send returned


def settle_later(settle, peers=("a", "b")) -> tuple[Router, ScriptedTransport, PipelineStats, list[str], list[int]]:
    """Send one hop whose first peer ("a") settles after the send returned, the way `settle` does."""
    router, transport, stats, hops = setup({}, peers=peers, later=("a",))
    lost: list[int] = []

    async def main() -> list[str]:
        sent = await hops.send_routed(1, "forward", forward_header(7), {}, lambda: lost.append(1))
        assert sent == "a" and transport.sent_to == ["a"]  # the send returned without waiting
        settle(transport.later["a"])
        for _ in range(20):  # the reroute runs in the background: let it
            await asyncio.sleep(0)
        await hops.close()
        return transport.sent_to

    return router, transport, stats, asyncio.run(main()), lost


def test_a_hop_refused_busy_after_its_send_goes_to_another_peer_without_a_ban():
    router, _, stats, sent_to, lost = settle_later(lambda o: o.set_result(SimpleNamespace(kind=MessageKind.BUSY)))
    assert sent_to == ["a", "b"] and lost == []
    assert stats.busy_replies == 1 and stats.rerouted == 1 and router.bans.active() == {}


def test_a_hop_refused_with_an_error_after_its_send_bans_the_peer_and_goes_elsewhere():
    error = SimpleNamespace(kind=MessageKind.ERROR, meta={"reason": "this peer serves stage 2"})
    router, _, _, sent_to, lost = settle_later(lambda o: o.set_result(error))
    assert sent_to == ["a", "b"] and lost == []
    assert router.bans.is_banned("a") and not router.bans.is_banned("b")


def test_a_hop_whose_channel_closes_before_the_window_is_lost_not_sent_twice():
    # the peer may have taken it before it went away: the origin retries the microbatch under a new
    # id, instead of this peer running the same microbatch on two paths
    router, _, _, sent_to, lost = settle_later(lambda o: o.set_exception(ConnectionResetError("closed")))
    assert sent_to == ["a"] and lost == [1]
    assert router.bans.active() == {}


def test_a_late_refusal_with_no_peer_left_loses_the_hop_once():
    _, _, stats, sent_to, lost = settle_later(
        lambda o: o.set_result(SimpleNamespace(kind=MessageKind.BUSY)), peers=("a",)
    )
    assert sent_to == ["a"] and lost == [1] and stats.busy_replies == 1


def test_silence_is_a_hop_taken():
    _, _, stats, sent_to, lost = settle_later(lambda o: o.set_result(None))
    assert sent_to == ["a"] and lost == [] and stats.busy_replies == 0


def test_send_to_one_peer_loses_the_hop_on_any_refusal():
    async def main() -> list[int]:
        transport = ScriptedTransport({}, later=("origin",))
        hops = HopSender(transport, Router(random.Random(0), num_stages=2), PipelineStats(), 0.1, 3, KnownPeers())
        lost: list[int] = []
        sent = await hops.send_to("origin", "forward", forward_header(3), {}, lambda: lost.append(1))
        assert sent == "origin" and lost == []
        transport.later["origin"].set_result(SimpleNamespace(kind=MessageKind.BUSY, meta={}))
        await asyncio.sleep(0)
        return lost

    assert asyncio.run(main()) == [1]


def test_a_refusal_after_the_window_loses_the_hop_once_and_bans_only_on_an_error():
    for kind, banned in ((MessageKind.BUSY, False), (MessageKind.ERROR, True)):
        router, transport, _, hops = setup({})
        lost: list[int] = []

        async def main() -> None:
            assert await hops.send_routed(1, "forward", forward_header(9), {}, lambda: lost.append(1))
            transport.late_refusals["a"](SimpleNamespace(kind=kind, meta={"reason": "late"}))

        asyncio.run(main())
        assert transport.sent_to == ["a"] and lost == [1]  # no payload is kept that long: no reroute
        assert router.bans.is_banned("a") is banned
        assert {p: load for p, load, _ in router.for_stage(1).loads()}["a"] == 0.0  # un-charged either way


def test_a_hop_settling_after_close_leaves_no_unretrieved_error():
    # at shutdown the channels close after the sender: their errors must still be retrieved, or
    # asyncio logs "Future exception was never retrieved" for every hop in flight
    async def main() -> list[dict]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        _, transport, _, hops = setup({}, later=("a",))
        assert await hops.send_routed(1, "forward", forward_header(5), {}, lambda: None)
        await hops.close()
        transport.later["a"].set_exception(ConnectionResetError("closed at shutdown"))
        await asyncio.sleep(0)  # the outcome's callbacks run
        transport.later["a"] = None
        gc.collect()
        return errors

    assert asyncio.run(main()) == []
