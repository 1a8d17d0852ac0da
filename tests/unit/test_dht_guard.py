"""DHTRequestGuard charges a DHT request to its sender by size before hivemind decodes it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node.p2p.dht_guard import DHT_BURST_BYTES, DHT_MESSAGE_LIMIT, DHTRequestGuard, DHTRequestRefused, dht_conduct


class FakeProtocol:
    def __init__(self) -> None:
        self.decoded = 0

    async def rpc_store(self, request, context):
        self.decoded += 1
        return "stored"


def request_of(size: int) -> SimpleNamespace:
    return SimpleNamespace(ByteSize=lambda: size)


def context_of(peer: str) -> SimpleNamespace:
    return SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))


def test_a_sender_over_its_byte_budget_is_refused_before_decoding():
    protocol = FakeProtocol()
    guard = DHTRequestGuard(protocol, dht_conduct())  # type: ignore[arg-type]
    at_limit = request_of(DHT_MESSAGE_LIMIT)
    fits = DHT_BURST_BYTES // DHT_MESSAGE_LIMIT

    async def main() -> None:
        for _ in range(fits):
            assert await guard.rpc_store(at_limit, context_of("stranger")) == "stored"
        with pytest.raises(DHTRequestRefused, match="rate"):
            await guard.rpc_store(at_limit, context_of("stranger"))
        # another sender's budget is its own, and small requests of an honest peer pass
        for _ in range(50):
            assert await guard.rpc_store(request_of(2000), context_of("honest")) == "stored"

    asyncio.run(main())
    assert protocol.decoded == fits + 50
    assert guard.refused == 1
    assert guard.conduct.open_streams() == 0  # every admitted request released its slot


def test_a_banned_sender_is_refused():
    protocol = FakeProtocol()
    conduct = dht_conduct()
    for _ in range(conduct.limits.strikes_to_ban):
        conduct.strike("villain", "garbage")
    guard = DHTRequestGuard(protocol, conduct)  # type: ignore[arg-type]
    with pytest.raises(DHTRequestRefused, match="banned"):
        asyncio.run(guard.rpc_store(request_of(10), context_of("villain")))
    assert protocol.decoded == 0
