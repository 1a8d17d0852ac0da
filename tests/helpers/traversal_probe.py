"""One side of a NAT-traversal probe, run in a test-bed host (tests/netns/test_nat_traversal.py): the
product's relay and traversal code (node/p2p/relay.py, traversal.py) without a swarm around them.
Each role prints JSON lines on stdout.

    relay BUDGET_BYTES RATE_BYTES_PER_S      -> {"peer_id", "port"}, then {"stats": ...} every 0.5 s
    home RELAY_ID RELAY_HOST RELAY_PORT      -> {"peer_id"}, then {"registered": [...]} on each change;
                                                serves an echo (every frame back) on its direct links
    ask RELAY_ID RELAY_HOST RELAY_PORT HOME_ID BYTES [relay]
                                             -> {"path", "seconds", "echoed"} or {"error"}; exits
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from dht.identity_keys import Identity
from node.p2p.direct import DirectLinks
from node.p2p.relay import Relay, RelayBudget
from node.p2p.sealed_link import SealedLink
from node.p2p.traversal import RelayRoute, Traversal
from protocol import DEFAULT_LIMITS

SWARM, SERVICE = "probe-swarm", "echo"


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def echo(sender: str, link: SealedLink) -> None:
    ended = asyncio.get_running_loop().create_future()
    link.start(
        lambda frame: link.send_frame(bytes(frame)),
        lambda error: ended.done() or ended.set_result(None),
        DEFAULT_LIMITS,
    )
    await ended


async def relay(budget: int, rate: float) -> None:
    identity = Identity.generate()
    links = DirectLinks(identity)
    port = await links.listen("0.0.0.0", 0)
    server = Relay(identity, SWARM, RelayBudget(budget, rate))
    server.attach(links)
    say(peer_id=identity.peer_id, port=port)
    while True:
        say(stats=vars(server.stats), registered=server.registered, left=server.budget.left)
        await asyncio.sleep(0.5)


async def home(relay_id: str, host: str, port: int) -> None:
    identity = Identity.generate()
    links = DirectLinks(identity)
    await links.listen("0.0.0.0", 0)
    links.serve(SWARM, SERVICE, echo)
    traversal = Traversal(links, SWARM)
    say(peer_id=identity.peer_id)
    route = RelayRoute(relay_id, ((host, port),))
    await traversal.keep_registered(
        lambda: [route], lambda relays: say(registered=relays, paths=traversal.paths.announced())
    )


async def ask(relay_id: str, host: str, port: int, home_id: str, size: int, relay_only: bool) -> None:
    links = DirectLinks(Identity.generate())
    await links.listen("0.0.0.0", 0)
    traversal = Traversal(links, SWARM)
    traversal.relays_of = lambda peer_id: [RelayRoute(relay_id, ((host, port),))]
    if relay_only:
        traversal.paths.punch_failed(home_id)
    began = time.monotonic()
    try:
        link = await links.open(home_id, [], SWARM, SERVICE, 15.0)
        got = asyncio.Queue()
        link.start(got.put_nowait, lambda error: got.put_nowait(error or EOFError()), DEFAULT_LIMITS)
        payload, echoed = os.urandom(size), 0
        for start in range(0, size, 1 << 20):  # frames of 1 MiB, each echoed before the next
            link.send_frame(payload[start : start + (1 << 20)])
            frame = await asyncio.wait_for(got.get(), 30.0)
            if isinstance(frame, BaseException):
                raise frame
            assert bytes(frame) == payload[start : start + (1 << 20)]
            echoed += len(frame)
        link.close()
        say(path=traversal.paths.announced().get(home_id), seconds=time.monotonic() - began, echoed=echoed)
    except Exception as e:
        say(error=repr(e)[:400], path=traversal.paths.announced().get(home_id), seconds=time.monotonic() - began)


def main(argv: list[str]) -> None:
    role = argv[0]
    if role == "relay":
        asyncio.run(relay(int(argv[1]), float(argv[2])))
    elif role == "home":
        asyncio.run(home(argv[1], argv[2], int(argv[3])))
    else:
        asyncio.run(ask(argv[1], argv[2], int(argv[3]), argv[4], int(argv[5]), argv[6:] == ["relay"]))


if __name__ == "__main__":
    main(sys.argv[1:])
