"""Direct links (node/p2p/direct.py, node/p2p/sealed_link.py): the handshake authenticates both peers, records are sealed,
and bad input from a stranger ends only its own connection."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

import msgpack
import pytest

from dht.records import PeerRecord, Reachability, RecordError
from dht.signing import Identity
from node.p2p import sealed_link
from node.p2p.direct import (
    MAX_HANDSHAKE_BYTES,
    MAX_PENDING_HANDSHAKES,
    DirectLinks,
    direct_addresses,
    direct_addresses_of,
)
from node.p2p.sealed_link import MAX_RECORD_BYTES, DirectLinkError, _RecordReader
from protocol import read_frame, write_frame

SWARM = "test-swarm"
SERVICE = "forward"


@pytest.fixture(scope="module")
def identities() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


async def echo_listener(identity: Identity, swarm_key: bytes | None = None):
    """A listener whose handler echoes every frame back and records who it served."""
    links = DirectLinks(identity, swarm_key)
    served: list[str] = []
    failures: list[BaseException] = []

    async def echo(sender: str, link) -> None:
        served.append(sender)
        try:
            while True:
                payload = await read_frame(link)
                await write_frame(link, payload)
        except EOFError:
            return
        except Exception as e:  # what a bad record does to the listener's side of the link
            failures.append(e)

    links.serve(SWARM, SERVICE, echo)
    port = await links.listen("127.0.0.1", 0)
    return links, port, served, failures


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30.0))


def test_a_link_carries_frames_both_ways_and_names_the_initiator(identities):
    server_id, client_id, _ = identities

    async def scenario():
        server, port, served, _ = await echo_listener(server_id)
        client = DirectLinks(client_id)
        link = await client.open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        # small, exactly one record, and one spanning several records
        for payload in (b"x", os.urandom(64 * 1024), os.urandom(3 * MAX_RECORD_BYTES + 17), b""):
            await write_frame(link, payload)
            assert await read_frame(link) == payload
        link.close()
        await server.close()
        return served, client.opened, server.accepted

    served, opened, accepted = run(scenario())
    assert served == [client_id.peer_id]
    assert (opened, accepted) == (1, 1)


def test_the_initiator_reaches_only_the_peer_it_named(identities):
    server_id, client_id, other_id = identities

    async def scenario():
        server, port, served, _ = await echo_listener(server_id)
        client = DirectLinks(client_id)
        with pytest.raises(DirectLinkError):
            # `other_id`'s address is wrong (it is server_id's): the link must fail, not reach server_id
            await client.open(other_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        usable_after = client.usable(other_id.peer_id)
        await server.close()
        return served, usable_after

    served, usable_after = run(scenario())
    assert served == []
    assert not usable_after  # p2pd is used for that peer for a while


def test_a_link_to_an_unserved_service_or_swarm_is_refused(identities):
    server_id, client_id, _ = identities

    async def scenario():
        server, port, served, _ = await echo_listener(server_id)
        client = DirectLinks(client_id)
        for swarm, service in ((SWARM, "gossip"), ("another-swarm", SERVICE)):
            with pytest.raises(DirectLinkError):
                await client.open(server_id.peer_id, [("127.0.0.1", port)], swarm, service, 5.0)
        await server.close()
        return served

    assert run(scenario()) == []


class TamperingProxy:
    """A TCP relay between a client and the listener that can flip a byte it forwards to the listener."""

    def __init__(self, target_port: int, flip_at: int | None):
        self.target_port, self.flip_at = target_port, flip_at
        self.forwarded = 0
        self.hello = b""

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(source, sink, tamper: bool):
            try:
                while data := await source.read(65536):
                    if tamper:
                        if len(self.hello) < 4096:
                            self.hello += data
                        if self.flip_at is not None and self.forwarded <= self.flip_at < self.forwarded + len(data):
                            i = self.flip_at - self.forwarded
                            data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
                        self.forwarded += len(data)
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def close(self):
        self.server.close()


async def link_through_proxy(server_id: Identity, client_id: Identity, port: int):
    """A direct link from `client_id` to the listener on `port`, through a TamperingProxy."""
    proxy = TamperingProxy(port, flip_at=None)
    proxy_port = await proxy.start()
    link = await DirectLinks(client_id).open(server_id.peer_id, [("127.0.0.1", proxy_port)], SWARM, SERVICE, 5.0)
    return proxy, link


def test_a_tampered_record_ends_the_link_and_the_listener_goes_on(identities):
    server_id, client_id, _ = identities

    async def scenario():
        server, port, _served, failures = await echo_listener(server_id)
        proxy, link = await link_through_proxy(server_id, client_id, port)
        await write_frame(link, b"first")
        assert await read_frame(link) == b"first"
        proxy.flip_at = proxy.forwarded + 40  # inside the next record's ciphertext
        await write_frame(link, os.urandom(1000))
        with pytest.raises((EOFError, ConnectionError, asyncio.IncompleteReadError)):
            await read_frame(link)  # the listener dropped the link instead of echoing altered bytes
        # the listener still serves an honest link
        honest = await DirectLinks(client_id).open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        await write_frame(honest, b"still here")
        echoed = await read_frame(honest)
        honest.close()
        link.close()
        proxy.close()
        await server.close()
        return failures, echoed

    failures, echoed = run(scenario())
    assert echoed == b"still here"
    assert len(failures) == 1 and isinstance(failures[0], DirectLinkError)
    assert "does not authenticate" in str(failures[0])


def test_a_replayed_hello_gets_no_answer(identities, caplog):
    server_id, client_id, _ = identities
    caplog.set_level(logging.DEBUG, logger="node.p2p.direct")

    async def scenario():
        server, port, served, _ = await echo_listener(server_id)
        proxy, link = await link_through_proxy(server_id, client_id, port)
        (length,) = struct.unpack(">I", proxy.hello[:4])
        hello = proxy.hello[: 4 + length]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello)  # the same signed hello again, from someone without its ephemeral secret
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(100), 10.0)
        writer.close()
        link.close()
        proxy.close()
        await server.close()
        return answer, served

    answer, served = run(scenario())
    assert answer == b""  # closed without an accept (no signature spent on it)
    assert served == [client_id.peer_id]
    assert "a hello seen before (replayed)" in caplog.text


def test_another_private_swarm_key_opens_no_record(identities):
    server_id, client_id, _ = identities

    async def scenario():
        server, port, _served, failures = await echo_listener(server_id, swarm_key=b"k" * 32)
        client = DirectLinks(client_id, swarm_key=b"x" * 32)
        link = await client.open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        await write_frame(link, b"hello members")
        with pytest.raises((EOFError, ConnectionError, asyncio.IncompleteReadError)):
            await read_frame(link)
        link.close()
        await server.close()
        return failures

    failures = run(scenario())
    assert len(failures) == 1 and "does not authenticate" in str(failures[0])


def test_oversized_or_junk_hellos_are_refused_and_a_flood_is_cut_short(identities, caplog):
    server_id, client_id, _ = identities
    caplog.set_level(logging.DEBUG, logger="node.p2p.direct")

    async def refused(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(100), 10.0)
        writer.close()
        return answer

    async def scenario():
        server, port, _served, _ = await echo_listener(server_id)
        answers = [
            await refused(port, struct.pack(">I", 1 << 30)),  # declares 1 GiB: refused before reading
            await refused(port, struct.pack(">I", MAX_HANDSHAKE_BYTES + 1) + b"\0" * 64),
            await refused(port, struct.pack(">I", 5) + b"\xc1junk"),  # not msgpack
            await refused(port, struct.pack(">I", 3) + msgpack.packb([1, 2])),  # not a map
        ]
        hello = msgpack.packb({"v": 1, "swarm": SWARM, "service": SERVICE, "to": server_id.peer_id, "time": 0.0})
        answers.append(await refused(port, struct.pack(">I", len(hello)) + hello))  # no key, no signature
        # a flood of silent connections: past MAX_PENDING_HANDSHAKES the listener closes them at once
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_PENDING_HANDSHAKES)]
        await asyncio.sleep(0.2)
        extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
        flood_answer = await asyncio.wait_for(extra_reader.read(100), 10.0)
        for _, writer in silent:
            writer.close()
        extra_writer.close()
        await asyncio.sleep(0.2)
        link = await DirectLinks(client_id).open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        await write_frame(link, b"ok")
        echoed = await read_frame(link)
        link.close()
        await server.close()
        return answers, flood_answer, echoed

    answers, flood_answer, echoed = run(scenario())
    assert answers == [b""] * 5
    for reason in ("hello of 1073741824 bytes", "is not msgpack", "hello is not a map", "field 'eph' is not a bytes"):
        assert reason in caplog.text
    assert flood_answer == b""
    assert echoed == b"ok"


def test_addresses_come_from_the_records_direct_tcp_hosts():
    addrs = [
        "/ip4/10.77.0.2/tcp/4001/p2p/QmPeer",
        "/ip4/10.77.0.2/tcp/4002",
        "/ip6/::1/tcp/4001",
        "/ip4/10.77.0.9/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmPeer",
        "/ip4/10.77.0.3/udp/4001/quic",
        "/dns4/example.org/tcp/4001",
    ]
    assert direct_addresses(addrs, 5000) == [("10.77.0.2", 5000), ("::1", 5000)]
    assert direct_addresses(addrs, None) == []
    record = PeerRecord(peer_id="QmPeer", stage=1, addrs=addrs, direct_port=5000, reachability=Reachability.PUBLIC)
    assert direct_addresses_of(record) == [("10.77.0.2", 5000), ("::1", 5000)]
    record.reachability = Reachability.RELAYED  # behind a NAT: nobody can dial it directly
    assert direct_addresses_of(record) == []
    assert direct_addresses_of(None) == []


def test_a_records_direct_port_is_checked():
    wire = PeerRecord(peer_id="QmPeer", stage=1, direct_port=5000).to_wire()
    assert PeerRecord.from_wire(wire).direct_port == 5000
    assert PeerRecord.from_wire({**wire, "direct_port": None}).direct_port is None
    for bad in (0, 70000, "5000", True):
        with pytest.raises(RecordError):
            PeerRecord.from_wire({**wire, "direct_port": bad})


def test_a_record_arriving_in_segments_wakes_its_reader_once():
    """A record fed in TCP-segment-sized pieces resumes the task waiting for it only when the last piece
    is in (the stock StreamReader resumes it for every piece), with the bytes intact; the end of the
    connection inside a record still ends the read with what arrived."""

    async def main() -> None:
        record = os.urandom(64 * 1024)
        reader = _RecordReader(limit=MAX_RECORD_BYTES)
        waits = []  # each time the reading task (re)starts waiting: once per wakeup
        wait_for_data = reader._wait_for_data
        reader._wait_for_data = lambda name: (waits.append(name), wait_for_data(name))[1]
        read = asyncio.create_task(reader.readexactly(len(record)))
        await asyncio.sleep(0)
        for start in range(0, len(record), 1448):
            reader.feed_data(record[start : start + 1448])
            await asyncio.sleep(0)
        assert await asyncio.wait_for(read, 5) == record
        assert len(waits) == 1, f"the reader waited {len(waits)} times for one record"

        cut = asyncio.create_task(reader.readexactly(100))
        await asyncio.sleep(0)
        reader.feed_data(b"x" * 40)
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError) as error:
            await asyncio.wait_for(cut, 5)
        assert error.value.partial == b"x" * 40

    asyncio.run(main())


def test_a_record_body_sets_the_sockets_low_water_mark_and_never_above_what_is_missing():
    """While a record's body is awaited on a real TCP connection the kernel is asked (SO_RCVLOWAT) to
    wake the loop only once the missing bytes are in, capped at a quarter of the receive buffer, and
    lowered as pieces arrive: a mark above what is still coming would never fire and the read would
    hang (a 512 KiB record arriving in four pieces checks that). The mark is 1 again after each read."""

    async def main() -> None:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connection(reader, writer) -> None:
            accepted.set_result((reader, writer))
            await asyncio.sleep(30)

        server = await sealed_link.listen(on_connection, "127.0.0.1", 0)
        _, client = await sealed_link.connect("127.0.0.1", server.sockets[0].getsockname()[1])
        reader, _ = await asyncio.wait_for(accepted, 5)
        sock = reader._transport.get_extra_info("socket")

        def mark() -> int:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

        for size, pieces in ((64 * 1024, 2), (512 * 1024, 4)):
            record = os.urandom(size)
            read = asyncio.create_task(reader.readexactly(size))
            marks = []
            for start in range(0, size, size // pieces):
                client.write(record[start : start + size // pieces])
                await client.drain()
                await asyncio.sleep(0.05)
                marks.append(mark())
            assert await asyncio.wait_for(read, 5) == record
            buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            waiting = marks[:-1]  # before the last piece the read was still waiting
            assert all(1 < m <= min(size, buffer // 4) for m in waiting), (size, marks, buffer)
            assert mark() == 1
        # a short read leaves the mark alone
        small = asyncio.create_task(reader.readexactly(100))
        await asyncio.sleep(0.05)
        assert mark() == 1
        client.write(b"y" * 100)
        assert await asyncio.wait_for(small, 5) == b"y" * 100
        client.close()
        server.close()

    asyncio.run(main())
