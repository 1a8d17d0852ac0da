"""Activation transport on loopback: our path vs hivemind's protobuf streams vs a raw TCP socket.

Not a test: a script that prints a report (docs/benchmarks.md holds a recorded run).

    python tests/benchmarks/bench_transport.py [--sizes 8x64x64 16x512x1024] [--seconds 6] [--json out.json]

What is timed, per message, for a float32 activation tensor of each size (the client and both
handlers run in this one process and event loop (uvloop, as a node runs); each P2P instance has
its own p2pd child process):

  pipeswarm   Transport.request(peer, "forward", FORWARD{hidden}) answered by ACK, exactly one hop
              of the pipeline as node/pipeline/traffic.py sends it: "forward" is multiplexed, so
              requests up to 4 MiB share one long-lived libp2p stream per peer (node/p2p/channels.py)
              and larger ones open a stream each; encode_message (+ wire compression none or fp16),
              length-prefixed frame, server decode_message (validation + tensor rebuild), ACK back.
              Between two peers made by node.p2p.network.start_network.
  pipeswarm-direct  the same request on a direct link (node/p2p/direct.py): the channel on a TCP
              connection of its own between the two peers, sealed with AES-256-GCM, no p2pd in the
              way. What peers that can reach each other's direct port use (tensors a channel carries).
  pipeswarm-stream  the same request on a new libp2p stream per request (the path before issue
              16, and still that of services that do not multiplex): open a stream, frame, ACK,
              close. Measured for tensors a channel carries (larger ones take this path anyway).
  hivemind    hivemind's expert-forward stream path between the same two P2P instances:
              serialize_torch_tensor -> split_for_streaming(4 MiB parts) -> ExpertRequest per part
              -> P2P.iterate_protobuf_handler (stream_input/stream_output handler) -> server
              combine_from_streaming + deserialize_torch_tensor -> one empty ExpertResponse back.
              hivemind itself sends payloads under 2 MiB as a unary protobuf call instead, so
              that path ("hivemind-unary") is measured too for tensors below that size.
  tcp-streams asyncio streams (StreamReader/StreamWriter, what hivemind's p2pd bindings and so
              our frames use) on 127.0.0.1, one persistent connection: 8-byte length + the
              tensor's bytes (readexactly on the server), a 1-byte ACK back.
  tcp-socket  the same exchange on plain non-blocking sockets (loop.sock_sendall of the tensor's
              memory, loop.sock_recv_into a preallocated buffer): no serialization, no extra
              copy, no stream setup. The ceiling of one loopback TCP connection from Python.

MB/s is 10^6 bytes of the float32 payload (numel * 4) per second of round-trip latency; the wire
bytes column is what the client actually writes per message. Messages are sent one after another
(no overlap), so MB/s = payload / latency for each message.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import signal
import socket
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import torch  # noqa: E402

MB = 1e6
DEFAULT_SIZES = ("8x64x64", "16x512x1024")


# ---- shared report helpers (bench_swarm and bench_all use them too) ----------------------------


def machine_info() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def q(p: float) -> float:
        if len(ordered) == 1:
            return ordered[0]
        position = p * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"p10": q(0.10), "median": q(0.50), "p90": q(0.90), "mean": statistics.fmean(ordered), "n": len(ordered)}


def parse_size(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.lower().split("x"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---- measurement ---------------------------------------------------------------------------------

MAX_FAILED_SHARE = 0.01  # of a path's calls that may fail before its measurement is abandoned


async def measure(
    send: Callable[[], Awaitable[None]], payload_bytes: int, seconds: float, min_reps: int, max_reps: int, warmup: int
) -> dict:
    """Run `send` sequentially: `warmup` untimed calls, then at least min_reps and at most max_reps
    timed calls, stopping once `seconds` have passed (after min_reps). A call that fails (a stream
    the daemons dropped: seen once in ~10^5 on this host) is counted in "failed" and left out of the
    latencies; more than MAX_FAILED_SHARE of the calls failing ends the run with the last error."""
    for _ in range(warmup):
        await send()
    latencies: list[float] = []
    failed: list[str] = []
    started = time.perf_counter()
    while len(latencies) < max_reps:
        t0 = time.perf_counter()
        try:
            await send()
        except Exception as e:  # whatever the path under test raises: counted, reported
            failed.append(repr(e)[:200])
            if len(failed) > MAX_FAILED_SHARE * max(min_reps, len(latencies)):
                raise
            continue
        latencies.append(time.perf_counter() - t0)
        if len(latencies) >= min_reps and time.perf_counter() - started > seconds:
            break
    rates = [payload_bytes / MB / lat for lat in latencies]
    return {
        "latency_ms": {k: (v * 1e3 if k != "n" else v) for k, v in percentiles(latencies).items()},
        "mb_per_s": percentiles(rates),
        "aggregate_mb_per_s": payload_bytes * len(latencies) / MB / sum(latencies),
        "failed": len(failed),
        "failures": failed[:3],
    }


def codec_costs(shape: tuple[int, ...], compressions: tuple[str, ...], reps: int) -> list[dict]:
    """encode_message + decode_message of one FORWARD message, no network."""
    from protocol import Message, MessageKind, decode_message, encode_message

    x = torch.randn(shape)
    payload = x.numel() * x.element_size()
    message = Message(MessageKind.FORWARD, "bench", 0, 1, forward_meta("QmBenchOrigin"), {"hidden": x})
    rows = []
    for compression in compressions:
        encode_message(message, compression)  # warm-up
        enc, dec = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            data = encode_message(message, compression)
            t1 = time.perf_counter()
            decoded = decode_message(data, expected_swarm="bench")
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        assert decoded.tensors["hidden"].shape == x.shape
        rows.append(
            {
                "shape": list(shape),
                "compression": compression,
                "payload_bytes": payload,
                "wire_bytes": len(data),
                "encode_ms": percentiles([t * 1e3 for t in enc]),
                "decode_ms": percentiles([t * 1e3 for t in dec]),
                "encode_mb_per_s": payload / MB / statistics.median(enc),
                "decode_mb_per_s": payload / MB / statistics.median(dec),
            }
        )
    return rows


def forward_meta(origin: str) -> dict:
    return {"microbatch_id": 1, "origin": origin, "path": [origin], "order": [1, 2], "hop": 1}


async def run_network_benchmarks(shapes: list[tuple[int, ...]], args: argparse.Namespace) -> list[dict]:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
    from hivemind.proto import runtime_pb2
    from hivemind.utils.asyncio import as_aiter
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    from node.p2p.channels import CHANNEL_MAX_PAYLOAD
    from node.p2p.network import start_network
    from node.p2p.peer_conduct import ConductLimits, PeerConduct
    from node.p2p.transport import Transport
    from node.pipeline.contracts import FORWARD_CONTRACT
    from protocol import MessageKind, encode_message

    server_net = await start_network(host="127.0.0.1", direct_port=0)
    client_net = await start_network(host="127.0.0.1", initial_peers=await server_net.visible_maddrs(), direct_port=0)
    server_direct = [("127.0.0.1", server_net.direct.port)]
    tcp_server = None
    listener = sock_client = sock_server = None
    rows: list[dict] = []
    try:
        server_peer = server_net.peer_id
        server_pid = server_net.p2p.peer_id

        # (a) pipeswarm: one Transport per compression on each side (the server's only replies ACK)
        received = {"pipeswarm": 0, "hivemind": 0, "hivemind-unary": 0, "tcp-streams": 0, "tcp-socket": 0}
        clients: dict[str, Transport] = {}
        stream_clients: dict[str, Transport] = {}  # the same requests, one stream each (no multiplex)
        direct_clients: dict[str, Transport] = {}  # the same channel on a direct link
        # back-to-back requests from one peer outrun a node's per-peer request rate (200/s): this
        # measures the transport, not the flood limit
        unlimited = ConductLimits(requests_per_second=1e9, request_burst=10**9)
        for compression in args.compressions:
            swarm_id = f"bench-{compression}"
            server = Transport(
                server_net.p2p,
                swarm_id,
                1,
                compression=compression,
                conduct=PeerConduct(unlimited),
                direct=server_net.direct,
            )
            server.multiplex("forward")

            async def on_forward(sender, msg, server=server):
                assert msg.tensors["hidden"].dtype == torch.float32
                received["pipeswarm"] += 1
                return server.message(MessageKind.ACK, request_id=msg.request_id)

            await server.serve_requests("forward", on_forward, FORWARD_CONTRACT)
            clients[compression] = Transport(client_net.p2p, swarm_id, 0, compression=compression)
            clients[compression].multiplex("forward")
            stream_clients[compression] = Transport(client_net.p2p, swarm_id, 0, compression=compression)
            direct_clients[compression] = Transport(
                client_net.p2p,
                swarm_id,
                0,
                compression=compression,
                direct=client_net.direct,
                direct_addresses=lambda peer_id: server_direct,
            )
            direct_clients[compression].multiplex("forward")

        # (b) hivemind: expert-forward style protobuf stream, and the unary call it uses below 2 MiB
        async def hm_stream_handler(requests, context):
            parts = []
            async for request in requests:
                parts.extend(request.tensors)
            tensor = deserialize_torch_tensor(combine_from_streaming(parts))
            assert tensor.dtype == torch.float32
            received["hivemind"] += 1
            yield runtime_pb2.ExpertResponse()

        async def hm_unary_handler(request, context):
            tensor = deserialize_torch_tensor(request.tensors[0])
            assert tensor.dtype == torch.float32
            received["hivemind-unary"] += 1
            return runtime_pb2.ExpertResponse()

        await server_net.p2p.add_protobuf_handler(
            "bench.forward_stream", hm_stream_handler, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        await server_net.p2p.add_protobuf_handler("bench.forward", hm_unary_handler, runtime_pb2.ExpertRequest)

        # (c) raw TCP: persistent connection, length-prefixed bytes, 1-byte ACK
        async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    (length,) = struct.unpack(">Q", await reader.readexactly(8))
                    await reader.readexactly(length)
                    received["tcp-streams"] += 1
                    writer.write(b"\x01")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        tcp_server = await asyncio.start_server(on_tcp, "127.0.0.1", 0)
        tcp_port = tcp_server.sockets[0].getsockname()[1]
        tcp_reader, tcp_writer = await asyncio.open_connection("127.0.0.1", tcp_port)

        # (c') the same on bare sockets: recv_into one preallocated buffer
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        sock_client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock_client.setblocking(False)
        await loop.sock_connect(sock_client, listener.getsockname())
        sock_server, _ = await loop.sock_accept(listener)
        sock_server.setblocking(False)
        for s_ in (sock_client, sock_server):
            s_.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        max_payload = max(math.prod(shape) for shape in shapes) * 4
        sink = memoryview(bytearray(max(max_payload, 8)))

        async def recv_exactly(n: int) -> memoryview:
            got = 0
            while got < n:
                k = await loop.sock_recv_into(sock_server, sink[got:n])
                if k == 0:
                    raise ConnectionError("closed")
                got += k
            return sink[:n]

        async def sock_serve() -> None:
            try:
                while True:
                    (length,) = struct.unpack(">Q", await recv_exactly(8))
                    await recv_exactly(length)
                    received["tcp-socket"] += 1
                    await loop.sock_sendall(sock_server, b"\x01")
            except (ConnectionError, OSError):
                pass

        sock_task = asyncio.create_task(sock_serve())

        hm_codecs = {"none": runtime_pb2.CompressionType.NONE, "fp16": runtime_pb2.CompressionType.FLOAT16}

        for shape in shapes:
            x = torch.randn(shape)
            payload = x.numel() * x.element_size()
            big = payload > 4 * 1024 * 1024
            reps = dict(
                seconds=args.seconds,
                min_reps=args.min_reps if not big else max(5, args.min_reps // 4),
                max_reps=args.max_reps,
                warmup=2 if big else 10,
            )

            def row(path: str, compression: str, wire_bytes: int, result: dict) -> None:
                rows.append(
                    {
                        "shape": list(shape),
                        "path": path,
                        "compression": compression,
                        "payload_bytes": payload,
                        "wire_bytes": wire_bytes,
                        **result,
                    }
                )
                print(
                    f"  {list(shape)!s:<18} {path:<15} {compression:<5} "
                    f"median {result['mb_per_s']['median']:8.1f} MB/s  "
                    f"latency p50 {result['latency_ms']['median']:8.2f} ms  (n={result['latency_ms']['n']}"
                    + (f", {result['failed']} failed: {result['failures'][0]}" if result["failed"] else "")
                    + ")",
                    file=sys.stderr,
                    flush=True,
                )

            for compression, client in clients.items():

                def make_message(client=client):
                    return client.message(MessageKind.FORWARD, forward_meta(client_net.peer_id), {"hidden": x})

                async def send_ours(client=client, make_message=make_message):
                    reply = await client.request(server_peer, "forward", make_message(), timeout=120.0)
                    assert reply.kind == MessageKind.ACK

                wire = len(encode_message(make_message(), compression)) + 8
                row("pipeswarm", compression, wire, await measure(send_ours, payload, **reps))
                if wire <= CHANNEL_MAX_PAYLOAD:
                    stream_client = stream_clients[compression]
                    send_stream = functools.partial(
                        send_ours, stream_client, functools.partial(make_message, stream_client)
                    )
                    row("pipeswarm-stream", compression, wire, await measure(send_stream, payload, **reps))
                    direct_client = direct_clients[compression]
                    send_direct = functools.partial(
                        send_ours, direct_client, functools.partial(make_message, direct_client)
                    )
                    row("pipeswarm-direct", compression, wire, await measure(send_direct, payload, **reps))

            for compression in args.compressions:
                if compression not in hm_codecs:
                    continue
                codec = hm_codecs[compression]

                async def send_hm_stream(codec=codec):
                    serialized = serialize_torch_tensor(x, codec)
                    parts = [
                        runtime_pb2.ExpertRequest(uid="bench", tensors=[part])
                        for part in split_for_streaming(serialized, DEFAULT_MAX_MSG_SIZE)
                    ]
                    stream = await client_net.p2p.iterate_protobuf_handler(
                        server_pid, "bench.forward_stream", as_aiter(*parts), runtime_pb2.ExpertResponse
                    )
                    async for _ in stream:
                        pass

                serialized = serialize_torch_tensor(x, codec)
                wire = sum(
                    runtime_pb2.ExpertRequest(uid="bench", tensors=[p]).ByteSize() + 8
                    for p in split_for_streaming(serialized, DEFAULT_MAX_MSG_SIZE)
                )
                row("hivemind", compression, wire, await measure(send_hm_stream, payload, **reps))

                if payload <= MAX_UNARY_PAYLOAD_SIZE:

                    async def send_hm_unary(codec=codec):
                        request = runtime_pb2.ExpertRequest(uid="bench", tensors=[serialize_torch_tensor(x, codec)])
                        await client_net.p2p.call_protobuf_handler(
                            server_pid, "bench.forward", request, runtime_pb2.ExpertResponse
                        )

                    wire = runtime_pb2.ExpertRequest(uid="bench", tensors=[serialized]).ByteSize()
                    row("hivemind-unary", compression, wire, await measure(send_hm_unary, payload, **reps))

            buffer = memoryview(x.numpy()).cast("B")

            async def send_tcp():
                tcp_writer.write(struct.pack(">Q", len(buffer)))
                tcp_writer.write(buffer)
                await tcp_writer.drain()
                assert await tcp_reader.readexactly(1) == b"\x01"

            row("tcp-streams", "none", payload + 8, await measure(send_tcp, payload, **reps))

            async def send_sock():
                await loop.sock_sendall(sock_client, struct.pack(">Q", len(buffer)))
                await loop.sock_sendall(sock_client, buffer)
                ack = bytearray(1)
                assert await loop.sock_recv_into(sock_client, ack) == 1

            row("tcp-socket", "none", payload + 8, await measure(send_sock, payload, **reps))
        tcp_writer.close()
        sock_task.cancel()
        await asyncio.gather(sock_task, return_exceptions=True)
    finally:
        for s_ in (sock_client, sock_server, listener):
            if s_ is not None:
                s_.close()
        if tcp_server is not None:
            tcp_server.close()
        await client_net.shutdown()
        await server_net.shutdown()
    return rows


# ---- report --------------------------------------------------------------------------------------


def format_report(result: dict) -> str:
    lines = ["## Activation transport (loopback)", ""]
    lines.append(
        "| tensor (float32) | payload | path | wire codec | wire bytes/msg | MB/s median | MB/s p10..p90 "
        "| latency ms median | latency ms p10..p90 | n |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["network"]:
        mbs, lat = r["mb_per_s"], r["latency_ms"]
        lines.append(
            f"| {'x'.join(map(str, r['shape']))} | {human_bytes(r['payload_bytes'])} | {r['path']} | {r['compression']} "
            f"| {human_bytes(r['wire_bytes'])} | {mbs['median']:.1f} | {mbs['p10']:.1f}..{mbs['p90']:.1f} "
            f"| {lat['median']:.2f} | {lat['p10']:.2f}..{lat['p90']:.2f} | {lat['n']}"
            + (f" ({r['failed']} failed)" if r.get("failed") else "")
            + " |"
        )
    lines += ["", "Codec alone (encode_message + decode_message of one FORWARD, no network):", ""]
    lines.append(
        "| tensor (float32) | codec | wire bytes | encode ms (median) | decode ms (median) "
        "| encode MB/s | decode MB/s |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for r in result["codec"]:
        lines.append(
            f"| {'x'.join(map(str, r['shape']))} | {r['compression']} | {human_bytes(r['wire_bytes'])} "
            f"| {r['encode_ms']['median']:.3f} | {r['decode_ms']['median']:.3f} "
            f"| {r['encode_mb_per_s']:.0f} | {r['decode_mb_per_s']:.0f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="float32 activation shapes, e.g. 8x64x64 (the default microbatch) 16x512x1024",
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per (size, path, codec)")
    parser.add_argument("--min-reps", type=int, default=30, help="timed messages at least (a quarter for > 4 MiB)")
    parser.add_argument("--max-reps", type=int, default=2000, help="timed messages at most")
    parser.add_argument(
        "--compressions",
        nargs="+",
        default=["none", "fp16"],
        choices=["none", "fp16", "bf16", "int8"],
        help="wire compressions of our path (hivemind gets none/fp16 only)",
    )
    parser.add_argument("--codec-reps", type=int, default=20, help="repetitions of the codec-only timing")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch CPU threads for the codec (default 1, as the swarm peers run with --threads 1)",
    )


def run(args: argparse.Namespace) -> dict:
    import uvloop

    if getattr(args, "torch_threads", None):
        torch.set_num_threads(args.torch_threads)
    shapes = [parse_size(s) for s in args.sizes]
    result = {"machine_before": machine_info()}
    print("transport benchmark: codec alone ...", file=sys.stderr, flush=True)
    result["codec"] = [
        row for shape in shapes for row in codec_costs(shape, ("none", "fp16", "bf16", "int8"), args.codec_reps)
    ]
    print("transport benchmark: over loopback ...", file=sys.stderr, flush=True)
    result["network"] = uvloop.run(run_network_benchmarks(shapes, args))
    result["machine_after"] = machine_info()
    return result


def end_through_cleanups_on_sigterm() -> None:
    """Make SIGTERM end a benchmark the way Ctrl-C does, through the `finally` blocks that end its
    swarms and namespaces by pid: Python's default action for SIGTERM skips them, and a benchmark
    started in the background ignores SIGINT, so a killed run used to leave its peers training."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def script_main(
    doc: str, add_arguments: Callable, run: Callable, format_report: Callable, argv: list[str] | None = None
) -> int:
    """The command line every benchmark script shares: arguments, run, one report, optional JSON."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    end_through_cleanups_on_sigterm()
    result = run(args)
    m0, m1 = result["machine_before"], result["machine_after"]
    print(
        f"machine: {m0['nproc']} CPUs, {m0['cpu']}; load average {m0['loadavg']} before, {m1['loadavg']} after; "
        f"python {m0['python']}, torch {m0['torch']} ({m0['torch_threads']} threads); {m0['time']}"
    )
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, add_arguments, run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
