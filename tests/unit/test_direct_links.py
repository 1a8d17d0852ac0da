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
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dht.identity_keys import Identity
from dht.records import PeerRecord, Reachability, RecordError
from node.p2p import sealed_link
from node.p2p.direct import (
    MAX_HANDSHAKE_BYTES,
    MAX_PENDING_HANDSHAKES,
    DirectLinks,
    direct_addresses,
    direct_addresses_of,
)
from node.p2p.sealed_link import MAX_RECORD_BYTES, DirectLinkError, SealedLink
from protocol import DEFAULT_LIMITS

SWARM = "test-swarm"
SERVICE = "forward"


@pytest.fixture(scope="module")
def identities() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


class Frames:
    """A started link's frames, one at a time: what a channel does with them, in test form."""

    def __init__(self, link: SealedLink):
        self.link = link
        self.queue: asyncio.Queue = asyncio.Queue()
        link.start(self.queue.put_nowait, lambda error: self.queue.put_nowait(error or EOFError()), DEFAULT_LIMITS)

    def send(self, payload: bytes) -> None:
        self.link.send_frame(payload)

    async def next(self) -> bytes:
        item = await asyncio.wait_for(self.queue.get(), 10.0)
        if isinstance(item, BaseException):  # how the link ended
            raise item
        return bytes(item)


async def echo_listener(identity: Identity, swarm_key: bytes | None = None):
    """A listener whose handler echoes every frame back and records who it served."""
    links = DirectLinks(identity, swarm_key)
    served: list[str] = []
    failures: list[BaseException] = []

    async def echo(sender: str, link: SealedLink) -> None:
        served.append(sender)
        ended = asyncio.get_running_loop().create_future()

        def closed(error: BaseException | None) -> None:
            if error is not None:  # what a bad record does to the listener's side of the link
                failures.append(error)
            ended.set_result(None)

        link.start(lambda payload: link.send_frame(bytes(payload)), closed, DEFAULT_LIMITS)
        await ended

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
        link = Frames(await client.open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0))
        # small, about one record, spanning several records, empty; and many at once, which arrive
        # several to a read of the socket
        sizes = (1, 64 * 1024, MAX_RECORD_BYTES - 8, MAX_RECORD_BYTES, 3 * MAX_RECORD_BYTES + 17, 0)
        for payload in [os.urandom(size) for size in sizes]:
            link.send(payload)
            assert await link.next() == payload
        burst = [os.urandom(n * 997) for n in range(40)]
        for payload in burst:
            link.send(payload)
        assert [await link.next() for _ in burst] == burst
        link.link.close()
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
    return proxy, Frames(link)


def test_a_tampered_record_ends_the_link_and_the_listener_goes_on(identities):
    server_id, client_id, _ = identities

    async def scenario():
        server, port, _served, failures = await echo_listener(server_id)
        proxy, link = await link_through_proxy(server_id, client_id, port)
        link.send(b"first")
        assert await link.next() == b"first"
        proxy.flip_at = proxy.forwarded + 40  # inside the next record's ciphertext
        link.send(os.urandom(1000))
        with pytest.raises((EOFError, ConnectionError)):
            await link.next()  # the listener dropped the link instead of echoing altered bytes
        # the listener still serves an honest link
        honest = Frames(
            await DirectLinks(client_id).open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0)
        )
        honest.send(b"still here")
        echoed = await honest.next()
        honest.link.close()
        link.link.close()
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
        link.send(b"served")
        assert await link.next() == b"served"
        (length,) = struct.unpack(">I", proxy.hello[:4])
        hello = proxy.hello[: 4 + length]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello)  # the same signed hello again, from someone without its ephemeral secret
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(100), 10.0)
        writer.close()
        link.link.close()
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
        link = Frames(await client.open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0))
        link.send(b"hello members")
        with pytest.raises((EOFError, ConnectionError)):
            await link.next()
        link.link.close()
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
        link = Frames(await DirectLinks(client_id).open(server_id.peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 5.0))
        link.send(b"ok")
        echoed = await link.next()
        link.link.close()
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


def sealed_record(key: bytes, counter: int, plain: bytes) -> bytes:
    """A record as the link's peer seals it: a 4-byte length, then AES-256-GCM under a counter nonce."""
    sealed = AESGCM(key).encrypt(counter.to_bytes(12, "big"), plain, None)
    return struct.pack(">I", len(sealed)) + sealed


class _NoSocket(asyncio.Transport):
    """A transport with nothing under it: the bytes come from the test, through data_received."""

    def get_extra_info(self, name, default=None):
        return default

    closing = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def test_a_record_arriving_in_segments_is_handed_on_once_whole():
    """A frame fed in TCP-segment-sized pieces of its record reaches the consumer once, intact, when the
    last piece is in; the end of the connection inside a record ends the link with a reset, and
    inside a frame spanning records with a ProtocolError (the channel server's strike)."""
    key = os.urandom(32)
    payload = os.urandom(64 * 1024)
    record = sealed_record(key, 0, struct.pack(">Q", len(payload)) + payload)

    def started() -> tuple[SealedLink, list, list]:
        link, frames, ends = SealedLink(), [], []
        link.connection_made(_NoSocket())
        link.seal(os.urandom(32), key)
        link.start(lambda frame: frames.append(bytes(frame)), ends.append, DEFAULT_LIMITS)
        return link, frames, ends

    link, frames, ends = started()
    for start in range(0, len(record), 1448):
        assert frames == []
        link.data_received(record[start : start + 1448])
    assert frames == [payload]
    link.data_received(record[:100])  # the same record again: its nonce is spent, but it never completes
    link.connection_lost(None)
    assert isinstance(ends[0], ConnectionResetError) and frames == [payload]

    link, frames, ends = started()  # a frame whose header declares more than its record holds
    link.data_received(sealed_record(key, 0, struct.pack(">Q", 1000) + b"x" * 10))
    link.connection_lost(None)
    assert frames == [] and "mid-frame" in str(ends[0])

    link, frames, ends = started()  # over the size limit: refused before any of it is kept
    link.data_received(sealed_record(key, 0, struct.pack(">Q", DEFAULT_LIMITS.max_frame_bytes + 1)))
    assert frames == [] and "max_frame_bytes" in str(ends[0])


def test_a_record_body_sets_the_sockets_low_water_mark_and_never_above_what_is_missing():
    """While a record's body is awaited on a real TCP connection the kernel is asked (SO_RCVLOWAT) to
    wake the loop only once the missing bytes are in, capped at a quarter of the receive buffer, and
    lowered as pieces arrive: a mark above what is still coming would never fire and the read would
    hang (a 512 KiB record arriving in four pieces checks that). The mark is 1 again after each record."""

    async def main() -> None:
        key = os.urandom(32)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        frames: asyncio.Queue = asyncio.Queue()

        async def on_connection(link: SealedLink) -> None:
            link.seal(os.urandom(32), key)
            link.start(lambda frame: frames.put_nowait(bytes(frame)), lambda error: None, DEFAULT_LIMITS)
            accepted.set_result(link)

        server = await sealed_link.listen(on_connection, "127.0.0.1", 0)
        _, client = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        link = await asyncio.wait_for(accepted, 5)
        sock = link.get_extra_info("socket")

        def mark() -> int:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

        for counter, (size, pieces) in enumerate(((64 * 1024, 2), (512 * 1024, 4))):
            payload = os.urandom(size)
            record = sealed_record(key, counter, struct.pack(">Q", size) + payload)
            marks = []
            step = -(-len(record) // pieces)
            for start in range(0, len(record), step):
                client.write(record[start : start + step])
                await client.drain()
                await asyncio.sleep(0.05)
                marks.append(mark())
            assert await asyncio.wait_for(frames.get(), 5) == payload
            buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            waiting = marks[:-1]  # before the last piece the record was still incomplete
            assert all(1 < m <= min(len(record), buffer // 4) for m in waiting), (size, marks, buffer)
            assert mark() == 1
        # a short record leaves the mark alone
        record = sealed_record(key, 2, struct.pack(">Q", 100) + b"y" * 100)
        client.write(record[:50])
        await client.drain()
        await asyncio.sleep(0.05)
        assert mark() == 1
        client.write(record[50:])
        assert await asyncio.wait_for(frames.get(), 5) == b"y" * 100
        client.close()
        link.close()
        server.close()

    asyncio.run(main())
