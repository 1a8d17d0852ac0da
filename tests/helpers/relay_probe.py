"""One libp2p daemon for tests/netns/test_relay_circuit.py, run inside a test-bed namespace.

    relay_probe.py relay  HOST                      a public relay (p2pd forced public)
    relay_probe.py home   HOST RELAY_MADDR          behind a NAT: reserves a slot on RELAY
    relay_probe.py dialer HOST RELAY_MADDR HOME_ID  dials HOME through RELAY's circuit, then sends
                                                    messages of growing sizes and has them echoed

Each prints `ID <peer id>` and `MADDR <multiaddr>` lines when up; the dialer prints one
`RESULT {json}` line per attempt. Uses hivemind's P2P directly (no pipeswarm code): what is
measured is p2pd's relay, whatever pipeswarm builds on it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

ECHO = "pipeswarm-relay-echo"
SIZES = (1_000, 100_000, 1_000_000)
ATTEMPT_EVERY = 10.0


async def echo(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > max(SIZES):
            return
        writer.write(await reader.readexactly(size))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def echo_through(p2p: P2P, home: PeerID, size: int) -> bool:
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(home, ECHO), 10)
    try:
        writer.write(size.to_bytes(4, "big") + b"x" * size)
        await writer.drain()
        return len(await asyncio.wait_for(reader.readexactly(size), 30)) == size
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        return False
    finally:
        writer.close()


async def dial_and_measure(p2p: P2P, relay: str, home_id: str, duration: float) -> None:
    home = PeerID.from_base58(home_id)
    circuit = Multiaddr(f"{relay}/p2p-circuit")
    started = time.monotonic()
    while time.monotonic() - started < duration:
        result: dict = {"at": round(time.monotonic() - started, 1)}
        try:
            await asyncio.wait_for(p2p._client.connect(home, [circuit]), 10)
            result["connected"] = True
            for size in SIZES:  # one fresh stream each, all over the one relayed connection
                if size == SIZES[-1]:  # the connections to the home before the large one: relayed only?
                    peers = await p2p._client.list_peers()
                    result["paths"] = [str(a) for info in peers if info.peer_id == home for a in info.addrs]
                result[str(size)] = await echo_through(p2p, home, size)
        except Exception as e:
            result["connected"] = result.get("connected", False)
            result["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        print("RESULT " + json.dumps(result), flush=True)
        if result.get(str(SIZES[0])):
            return
        await asyncio.sleep(ATTEMPT_EVERY)


async def main(role: str, host: str, rest: list[str]) -> None:
    options: dict = {"host_maddrs": [f"/ip4/{host}/tcp/0"]}
    if role == "relay":
        options["force_reachability"] = "public"
    elif role == "home":
        options.update(initial_peers=rest, force_reachability="private", use_auto_relay=True, trusted_relays=rest)
    else:
        options.update(initial_peers=rest[:1], force_reachability="public")
    p2p = await P2P.create(**options)
    print(f"ID {p2p.peer_id}", flush=True)
    for maddr in await p2p.get_visible_maddrs():
        print(f"MADDR {maddr}", flush=True)
    await p2p.add_binary_stream_handler(ECHO, echo)
    try:
        if role == "dialer":
            await dial_and_measure(p2p, rest[0], rest[1], duration=float(rest[2]))
        else:
            await asyncio.sleep(3600)  # until the test kills it
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
