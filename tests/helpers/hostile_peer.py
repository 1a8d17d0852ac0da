#!/usr/bin/env python
"""A hostile peer: connects to a pipeswarm node's real stream handlers with py-libp2p (an
independent libp2p implementation, not hivemind's p2pd) and feeds them bad input.

    .venv/bin/python tests/helpers/hostile_peer.py --target /ip4/127.0.0.1/tcp/PORT/p2p/PEER \\
        --swarm-id pipeswarm-demo --stage 1 --num-stages 2 --target-log peer1.log \\
        --quick --report out.json

Every case (tests/helpers/hostile_cases.py) records what it sent, what came back (a reply and its
reason, a closed or reset stream, or nothing within the deadline), what the node sent back later
on its own (ABORT notices, forwarded results), the new lines of the target's log (--target-log)
and its timing, and ends as one outcome:

    rejected                      an ERROR/BUSY reply, a closed or reset stream, or a deferred ABORT,
                                  and the case's evidence (replies, notices, the target's log lines
                                  naming the case's peer or microbatch ids) shows the refusal of
                                  each check the case targets (`refused_by` in its table row)
    refused-by-another-check      refused, but not by the check the case is named for: an earlier
                                  gate stopped it (a stranger's tensors stop at the membership gate)
    accepted                      the node took it (ACK with no later rejection, a computed answer,
                                  an accepting gossip round, a held slot, exhausted resources)
    crashed-handler (traceback)   an "internal error" reply or a new Traceback in the target's log
    hang                          nothing within the case's deadline
    inconclusive                  the case could not set itself up (e.g. the target never free)
    harness-error                 a bug of this script (its traceback is in the report)

Cases that must pass the membership gate (the tensor checks of a block stage) send as members:
RSA identities from --member-keys whose `joining` records tests/helpers/member_records.py keeps in
the swarm's DHT, each at the stage the case needs (a microbatch's origin at stage 0, a gossip
partner at the target's). Every identity's host answers the node's liveness ping, as a member must
(node/p2p/membership.py). Everything else is sent by strangers, fresh peer ids with no record.

Bounded: each case has a deadline, every loop a count, the whole run --max-seconds; the script
exits by itself. Exit code 0 when every case was rejected, 1 otherwise, 2 when the target could
not be reached at all. libp2p cannot be imported next to hivemind (duplicate protobuf symbol), so
this always runs as its own process; it imports only `protocol` (torch, msgpack) from the repo.

Interop with hivemind 1.1.12's p2pd: TCP, Noise (/noise) or TLS (/tls/1.0.0), yamux
(/yamux/1.0.0) or mplex (/mplex/6.7.0) all work; the default is Noise + yamux. Quirks:
py-libp2p's yamux keeps at most 256 outbound streams open per connection, so cases that hold many
streams spread them over several identities (each its own host, key and connection); p2pd tears
a stream down once the remote half-closes it, so a reply the node writes after our end-of-stream
is lost and such a rejection shows as a closed stream. Every case uses peer ids of its own, so a
node that bans misbehaving peers judges each case afresh (a "banned" refusal in the middle of a
case is retried once from a new peer id).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import struct
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
for path in (str(REPO), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import hostile_cases  # noqa: E402
import multiaddr  # noqa: E402
import trio  # noqa: E402
from hostile_cases import ACCEPTED, CRASHED, HANG, HARNESS_ERROR, INCONCLUSIVE, NOT_RUN, REJECTED  # noqa: E402
from libp2p import create_mplex_muxer_option, create_yamux_muxer_option, new_host  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402
from libp2p.crypto.keys import KeyPair  # noqa: E402
from libp2p.crypto.serialization import deserialize_private_key  # noqa: E402
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair  # noqa: E402
from libp2p.custom_types import TProtocol  # noqa: E402
from libp2p.peer.peerinfo import info_from_p2p_addr  # noqa: E402
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID  # noqa: E402
from libp2p.security.noise.transport import Transport as NoiseTransport  # noqa: E402
from libp2p.security.tls.transport import PROTOCOL_ID as TLS_ID  # noqa: E402
from libp2p.security.tls.transport import TLSTransport  # noqa: E402

from protocol import Message, MessageKind, ProtocolError, decode_message, encode_message  # noqa: E402
from protocol.limits import Limits  # noqa: E402

logger = logging.getLogger("hostile")

HEADER = struct.Struct(">Q")
# what this script accepts from the target: generous, it only has to parse the node's replies
READ_LIMITS = Limits()
INBOX_SERVICES = ("abort", "forward", "backward")
LIVENESS_SERVICE = "liveness"  # node/p2p/membership.py: a member answers the node's PING


class OpenFailed(Exception):
    """A stream to the target could not be opened (refused protocol, dead connection, timeout)."""


# ------------------------------------------------------------------------------------------------
# Settings


@dataclass
class Settings:
    """Sizes and deadlines of one run; --quick shrinks repetitions, floods and holds."""

    quick: bool
    reply_timeout: float = 8.0  # a direct reply to a small request
    notice_wait: float = 6.0  # an ABORT notice or a computed answer sent back later
    open_timeout: float = 10.0
    case_timeout: float = 60.0
    flood_requests: int = 2000
    flood_concurrency: int = 48
    slow_streams: int = 24  # with the never-finishing ones: under a 32-streams-per-peer limit
    slow_byte_interval: float = 0.5
    slow_forever_streams: int = 4  # long run only: streams that never finish their frame
    slow_forever_hold: float = 75.0  # longer than the node's request read timeout (60 s, or 30 s)
    half_open_streams: int = 2000
    half_open_hold: float = 20.0
    streams_per_identity: int = 200  # py-libp2p yamux: 256 outbound streams per connection at most
    silence_hold: float = 40.0  # accept-then-silence: how long we stay silent at most
    silence_grace: float = 5.0  # a node that still holds the slot after this has let it be taken
    gossip_attempts: int = 40  # BUSY replies tolerated while waiting for the target to be free
    repetitions: int = 3  # sends of the cheap malformed inputs (each must be rejected every time)

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if not quick:
            return cls(quick=False)
        return cls(
            quick=True,
            notice_wait=4.0,
            case_timeout=40.0,
            flood_requests=200,
            flood_concurrency=20,
            slow_streams=6,
            slow_byte_interval=0.2,
            slow_forever_streams=0,
            half_open_streams=1100,
            half_open_hold=4.0,
            silence_hold=8.0,
            gossip_attempts=30,
            repetitions=1,
        )


# ------------------------------------------------------------------------------------------------
# Replies and notices


@dataclass
class Reply:
    """What came back on a stream: a message, a clean end (eof), a reset, garbage, or nothing."""

    status: str  # message | eof | reset | timeout | garbage | error
    seconds: float
    kind: str | None = None
    reason: str | None = None
    meta: dict | None = None
    detail: str | None = None

    @property
    def is_message(self) -> bool:
        return self.status == "message"

    def summary(self) -> str:
        if self.status == "message":
            text = self.kind or "?"
            if self.reason:
                text += f" {self.reason!r}"
            return f"{text} after {self.seconds:.2f}s"
        return f"{self.status}{' (' + self.detail + ')' if self.detail else ''} after {self.seconds:.2f}s"


@dataclass
class Notice:
    """A message the target sent to one of our identities on its own (ABORT, FORWARD, BACKWARD)."""

    service: str
    kind: str
    sender: str
    receiver: str
    at: float
    microbatch_id: Any
    reason: str | None
    tensors: dict[str, list[int]]
    stats: dict[str, float] = field(default_factory=dict)


def _meta_summary(meta: dict) -> dict:
    out = {}
    for key, value in meta.items():
        text = repr(value)
        out[key] = value if len(text) <= 120 and not isinstance(value, bytes) else text[:120] + "..."
    return out


# ------------------------------------------------------------------------------------------------
# A stream to the target


class Wire:
    """One libp2p stream to a target handler, with frame-level reads and raw writes."""

    def __init__(self, stream: Any, service: str, opened_at: float):
        self.stream = stream
        self.service = service
        self.opened_at = opened_at
        self._buffer = bytearray()
        self.closed = False
        self.write_closed = False
        self.last_message: Message | None = None  # the decoded message behind the last Reply

    async def send(self, data: bytes) -> None:
        await self.stream.write(bytes(data))

    async def send_frame(self, payload: bytes) -> None:
        await self.send(HEADER.pack(len(payload)) + payload)

    async def send_message(self, message: Message, compression: str = "none") -> None:
        await self.send_frame(encode_message(message, compression))

    async def close_write(self) -> None:
        if not self.write_closed:
            self.write_closed = True
            with contextlib.suppress(Exception):
                await self.stream.close_write()

    async def reset(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                await self.stream.reset()

    async def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self.stream.read(max(65536, n - len(self._buffer)))
            if not chunk:
                raise EOFError("stream ended")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def read_message(self, timeout: float) -> Reply:
        """The next framed message, or how the stream ended, within `timeout`."""
        start = time.monotonic()
        with trio.move_on_after(timeout):
            try:
                header = await self._read_exact(HEADER.size)
            except Exception as e:
                return self._ended(e, start, at_boundary=not self._buffer)
            (length,) = HEADER.unpack(header)
            if length > READ_LIMITS.max_frame_bytes:
                return Reply("garbage", time.monotonic() - start, detail=f"reply frame declares {length} bytes")
            try:
                payload = await self._read_exact(length)
            except Exception as e:
                return self._ended(e, start, at_boundary=False)
            try:
                message = decode_message(payload, READ_LIMITS)
            except ProtocolError as e:
                return Reply("garbage", time.monotonic() - start, detail=str(e)[:200])
            self.last_message = message
            return Reply(
                "message",
                time.monotonic() - start,
                kind=message.kind.value,
                reason=message.meta.get("reason") if isinstance(message.meta.get("reason"), str) else None,
                meta=_meta_summary(message.meta),
            )
        return Reply("timeout", time.monotonic() - start)

    def _ended(self, error: Exception, start: float, at_boundary: bool) -> Reply:
        name = type(error).__name__
        elapsed = time.monotonic() - start
        if "Reset" in name:
            return Reply("reset", elapsed, detail=name)
        if isinstance(error, EOFError) or "EOF" in name or "Closed" in name:
            return Reply("eof", elapsed, detail=None if at_boundary else "mid-frame")
        return Reply("error", elapsed, detail=f"{name}: {error}"[:200])


# ------------------------------------------------------------------------------------------------
# Identities (one py-libp2p host each) and the run context


@dataclass
class Identity:
    label: str
    host: Any
    peer_id: str


class Context:
    """What a case can use: identities, streams to the target, messages, notices, log evidence."""

    def __init__(self, args: argparse.Namespace, settings: Settings, nursery: trio.Nursery):
        self.args = args
        self.settings = settings
        self.nursery = nursery
        self.target_maddr = multiaddr.Multiaddr(args.target)
        self.target_info = info_from_p2p_addr(self.target_maddr)
        self.target_id = self.target_info.peer_id.to_base58()
        self.swarm_id = args.swarm_id
        self.stage = args.stage
        self.num_stages = args.num_stages
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.seq_len = args.seq_len
        self.rng = random.Random(args.seed)
        self.notices: list[Notice] = []
        self._notice_event = trio.Event()
        self.identities: list[Identity] = []
        self._main: Identity | None = None
        # RSA keys whose DHT records tests/helpers/member_records.py keeps: members of the swarm,
        # by the stage of their records (files `stage<S>-member<i>.key`)
        self._member_keys: dict[int, list[Path]] = {}
        for path in sorted(Path(args.member_keys).glob("stage*-member*.key")) if args.member_keys else []:
            self._member_keys.setdefault(int(path.name[len("stage") : path.name.index("-")]), []).append(path)
        self.current: hostile_cases.Result | None = None  # the running case: its ids are its evidence
        self.log_path = Path(args.target_log) if args.target_log else None
        self.started = time.monotonic()

    # ---- protocol names and messages -------------------------------------------------------

    def protocol(self, service: str, swarm_id: str | None = None) -> TProtocol:
        return TProtocol(f"/pipeswarm/{swarm_id or self.swarm_id}/{service}")

    def message(
        self,
        kind: MessageKind,
        meta: dict | None = None,
        tensors: dict | None = None,
        *,
        swarm_id: str | None = None,
        sender_stage: int | None = None,
        version: int | None = None,
    ) -> Message:
        msg = Message(
            kind=kind,
            swarm_id=swarm_id or self.swarm_id,
            sender_stage=self.stage if sender_stage is None else sender_stage,
            request_id=self.rng.randrange(1, 1 << 62),
            meta=meta or {},
            tensors=tensors or {},
        )
        if version is not None:
            msg.version = version
        return msg

    def microbatch_id(self) -> int:
        microbatch_id = self.rng.randrange(1 << 50, 1 << 60)
        if self.current is not None:
            self.current.microbatches.append(microbatch_id)
        return microbatch_id

    # ---- identities ---------------------------------------------------------------------------

    def _security(self, key_pair: Any) -> dict:
        if self.args.security == "tls":
            return {TLS_ID: TLSTransport(key_pair)}
        return {NOISE_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)}

    def _muxer(self) -> dict:
        return create_mplex_muxer_option() if self.args.muxer == "mplex" else create_yamux_muxer_option()

    async def identity(
        self, label: str, nursery: trio.Nursery | None = None, timeout: float | None = None, key_pair: Any = None
    ) -> Identity:
        """A fresh peer id (its own host and connection to the target), serving the notice inbox.
        It lives until `nursery` is cancelled (default: the end of the run). A stranger unless
        `key_pair` is given (see `member`)."""
        key_pair = key_pair or create_new_key_pair()
        host = new_host(key_pair=key_pair, sec_opt=self._security(key_pair), muxer_opt=self._muxer())

        async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
            # a task of its own: py-libp2p's host keeps nurseries open for as long as it runs
            async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                task_status.started()
                await trio.sleep_forever()

        await (nursery or self.nursery).start(serve)
        ident = Identity(label, host, host.get_id().to_base58())
        for service in INBOX_SERVICES:
            host.set_stream_handler(self.protocol(service), self._inbox_handler(service, ident))
        host.set_stream_handler(self.protocol(LIVENESS_SERVICE), self._answer_ping)
        with trio.fail_after(timeout or self.settings.open_timeout):
            await host.connect(self.target_info)
        self.identities.append(ident)
        if self.current is not None:
            self.current.peers.append(ident.peer_id)
        return ident

    async def member(self, label: str, nursery: trio.Nursery | None = None, stage: int = 0) -> Identity:
        """A peer id the swarm counts as a member (a record of `stage` in the DHT; 0: an origin of
        microbatches), each used by one case only: a member that misbehaves collects strikes like
        anyone. NoMembersLeft when --member-keys gave none of that stage, or they are used up."""
        keys = self._member_keys.get(stage, [])
        if not keys:
            raise hostile_cases.NoMembersLeft(f"no member identity of stage {stage} left (--member-keys)")
        private = deserialize_private_key(keys.pop(0).read_bytes())
        return await self.identity(label, nursery, key_pair=KeyPair(private, private.get_public_key()))

    async def main_identity(self) -> Identity:
        """One long-lived identity for cases that cannot get it banned."""
        if self._main is None:
            self._main = await self.identity("main")
        return self._main

    async def open(
        self, service: str, ident: Identity | None = None, *, swarm_id: str | None = None, timeout: float | None = None
    ) -> Wire:
        ident = ident or await self.main_identity()
        start = time.monotonic()
        try:
            with trio.fail_after(timeout or self.settings.open_timeout):
                stream = await ident.host.new_stream(self.target_info.peer_id, [self.protocol(service, swarm_id)])
        except Exception as e:
            raise OpenFailed(f"{type(e).__name__}: {e}"[:300]) from None
        return Wire(stream, service, start)

    # ---- notices the target sends us --------------------------------------------------------

    async def _answer_ping(self, stream: Any) -> None:
        """PONG to the node's liveness PING, on the stream it opened."""
        wire = Wire(stream, LIVENESS_SERVICE, time.monotonic())
        try:
            reply = await wire.read_message(10.0)
            if reply.is_message and reply.kind == MessageKind.PING.value and wire.last_message is not None:
                pong = self.message(MessageKind.PONG)
                pong.request_id = wire.last_message.request_id
                await wire.send_message(pong)
                await wire.close_write()
        except Exception as e:  # a ping we cannot answer only delays our membership
            logger.debug(f"liveness ping: {e!r}")
        finally:
            with trio.move_on_after(1.0):
                await wire.reset()

    def _inbox_handler(self, service: str, ident: Identity):
        async def handle(stream: Any) -> None:
            wire = Wire(stream, service, time.monotonic())
            try:
                reply = await wire.read_message(10.0)
                message = getattr(wire, "last_message", None)
                if reply.is_message and message is not None:
                    tensors = {name: list(t.shape) for name, t in message.tensors.items()}
                    stats = {}
                    for name, t in message.tensors.items():
                        if t.is_floating_point() and t.numel():
                            finite = t[t.isfinite()]
                            stats[f"{name}_absmax"] = float(finite.abs().max()) if finite.numel() else float("nan")
                            stats[f"{name}_nonfinite"] = int((~t.isfinite()).sum())
                    reason = message.meta.get("reason")
                    self.notices.append(
                        Notice(
                            service,
                            message.kind.value,
                            stream.muxed_conn.peer_id.to_base58(),
                            ident.peer_id,
                            time.monotonic(),
                            message.meta.get("microbatch_id"),
                            reason if isinstance(reason, str) else None,
                            tensors,
                            stats,
                        )
                    )
                    self._notice_event.set()
                    self._notice_event = trio.Event()
                    ack = self.message(MessageKind.ACK)
                    ack.request_id = message.request_id
                    await wire.send_message(ack)
                    await wire.close_write()
            except Exception as e:  # the target's notices are evidence, never a reason to stop
                logger.debug(f"inbox {service}: {e!r}")
            finally:
                with trio.move_on_after(1.0):
                    await wire.reset()

        return handle

    async def wait_notice(
        self, microbatch_id: int, timeout: float, services: tuple[str, ...] = INBOX_SERVICES, since: float = 0.0
    ) -> list[Notice]:
        """Notices about `microbatch_id` (first one within `timeout`, plus any that came with it)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [
                n for n in self.notices if n.microbatch_id == microbatch_id and n.service in services and n.at >= since
            ]
            if found or time.monotonic() >= deadline:
                return found
            with trio.move_on_after(max(0.0, deadline - time.monotonic())):
                await self._notice_event.wait()

    # ---- the target's log ---------------------------------------------------------------------

    def log_mark(self) -> int:
        if self.log_path is None or not self.log_path.exists():
            return 0
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read(4 << 20).decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------------
# Log evidence

EVIDENCE_PATTERNS = (
    "Traceback",
    "Error",
    "error",
    "step skipped",
    "Too many open files",
    "outer round",
    "rejected",
    "banned",
    "internal error",
    "gave up",
    "handler failed",
    "session",
    "failed",
)


def log_evidence(text: str, limit: int = 24) -> tuple[list[str], list[str]]:
    """(traceback blocks, other notable lines) in new log text."""
    lines = text.splitlines()
    tracebacks: list[str] = []
    notable: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Traceback"):
            block = [lines[i - 1]] if i > 0 else []
            j = i
            while j < len(lines) and (
                j == i
                or lines[j].startswith((" ", "\t", "Traceback", "During handling", "The above exception"))
                or not lines[j].strip()
                or not re.match(r"^\d\d:\d\d:\d\d ", lines[j])
            ):
                block.append(lines[j])
                j += 1
                if len(block) > 60:
                    break
            tracebacks.append("\n".join(block[:8] + (["  ..."] if len(block) > 12 else []) + block[-4:]))
            i = j
            continue
        if any(p in line for p in EVIDENCE_PATTERNS) and len(notable) < limit:
            notable.append(line[:300])
        i += 1
    return tracebacks, notable


# ------------------------------------------------------------------------------------------------
# Running the cases


async def run_case(ctx: Context, case: hostile_cases.Case) -> dict:
    result = hostile_cases.Result(case.name, case.service, case.expected)
    mark = result.log_mark = ctx.log_mark()
    start = time.monotonic()
    ctx.current = result
    async with trio.open_nursery() as nursery:  # the case's own identities live here
        result.nursery = nursery
        try:
            with trio.move_on_after(case.timeout or ctx.settings.case_timeout) as scope:
                await case.run(ctx, result)
            if scope.cancelled_caught and result.outcome is None:
                result.set(HANG, f"case deadline of {case.timeout or ctx.settings.case_timeout:.0f}s passed")
        except hostile_cases.NoMembersLeft as e:
            result.set(INCONCLUSIVE, str(e))
        except Exception as e:
            result.set(HARNESS_ERROR, f"{type(e).__name__}: {e}"[:300])
            result.traceback = traceback.format_exc()[-3000:]
        nursery.cancel_scope.cancel()
    ctx.current = None
    await trio.sleep(0.3 if ctx.settings.quick else 1.0)  # let the node log what it did
    result.seconds = time.monotonic() - start
    log_text = ctx.log_since(mark)
    hostile_cases.confirm_check(case, result, ctx.stage, log_text)
    tracebacks, notable = log_evidence(log_text)
    result.log_tracebacks = tracebacks
    result.log_lines = notable
    if result.outcome is None:
        result.set(HARNESS_ERROR, "the case set no outcome")
    if tracebacks and result.outcome in (REJECTED, ACCEPTED, HANG):
        result.detail = f"{result.outcome} on the wire, but the node logged a traceback; {result.detail}"
        result.outcome = CRASHED
    return result.to_json()


async def run(args: argparse.Namespace) -> int:
    settings = Settings.make(args.quick)
    chosen = hostile_cases.select(args.cases)
    report: dict[str, Any] = {
        "target": args.target,
        "swarm_id": args.swarm_id,
        "stage": args.stage,
        "num_stages": args.num_stages,
        "mode": "quick" if args.quick else "long",
        "security": args.security,
        "muxer": args.muxer,
        "settings": asdict(settings),
        "started": time.time(),
        "cases": [],
        "finished": False,
    }
    code = 0

    def write_report() -> None:
        report["duration"] = round(time.monotonic() - t0, 2)
        counts: dict[str, int] = {}
        for case in report["cases"]:
            counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
        report["summary"] = counts
        if args.report:
            tmp = Path(args.report + ".tmp")
            tmp.write_text(json.dumps(report, indent=1, default=str))
            os.replace(tmp, args.report)

    t0 = time.monotonic()
    with trio.move_on_after(args.max_seconds) as overall:
        async with trio.open_nursery() as nursery:
            ctx = Context(args, settings, nursery)
            try:
                await ctx.main_identity()
            except Exception as e:
                report["setup_error"] = f"cannot connect to {args.target}: {type(e).__name__}: {e}"
                nursery.cancel_scope.cancel()
            else:
                for case in chosen:
                    print(f"[{time.monotonic() - t0:6.1f}s] {case.name} ...", file=sys.stderr, flush=True)
                    result = await run_case(ctx, case)
                    report["cases"].append(result)
                    print(f"           -> {result['outcome']}: {result['detail'][:160]}", file=sys.stderr, flush=True)
                    write_report()
                report["finished"] = True
                nursery.cancel_scope.cancel()
    if "setup_error" in report:
        print(report["setup_error"], file=sys.stderr)
        write_report()
        return 2
    if overall.cancelled_caught:
        done = {c["name"] for c in report["cases"]}
        for case in chosen:
            if case.name not in done:
                report["cases"].append(
                    {
                        "name": case.name,
                        "service": case.service,
                        "outcome": NOT_RUN,
                        "detail": f"--max-seconds {args.max_seconds} reached",
                    }
                )
    write_report()
    print_table(report)
    if any(c["outcome"] != REJECTED for c in report["cases"]):
        code = 1
    return code


def print_table(report: dict) -> None:
    width = max((len(c["name"]) for c in report["cases"]), default=10)
    print(
        f"hostile peer vs {report['target']} (stage {report['stage']}, {report['mode']} run, "
        f"{report.get('duration', 0):.1f}s)"
    )
    for case in report["cases"]:
        print(f"  {case['name']:<{width}}  {case['outcome']:<28} {case.get('detail', '')[:110]}")
    print("  summary: " + ", ".join(f"{k} {v}" for k, v in sorted(report.get("summary", {}).items())))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the node's multiaddr, /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID")
    parser.add_argument("--swarm-id", default="pipeswarm-demo")
    parser.add_argument("--stage", type=int, required=True, help="the stage the target serves")
    parser.add_argument("--num-stages", type=int, default=3, help="stages of the swarm, stage 0 included")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=8, help="sequence length of the activations we send")
    parser.add_argument("--target-log", help="the target's log file: new lines become each case's evidence")
    parser.add_argument("--report", help="write the JSON report here")
    parser.add_argument(
        "--member-keys",
        help="a directory of RSA identity files (*.key) whose DHT records someone keeps "
        "(tests/helpers/member_records.py): the cases that must pass the membership gate send as these",
    )
    parser.add_argument("--cases", help="comma-separated case names or prefixes (default: all); --list shows them")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--quick", action="store_true", help="short run: few repetitions, small floods and holds")
    parser.add_argument("--max-seconds", type=float, help="hard bound on the whole run (default 240 quick, 1800 long)")
    parser.add_argument("--security", choices=("noise", "tls"), default="noise")
    parser.add_argument("--muxer", choices=("yamux", "mplex"), default="yamux")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.max_seconds is None:
        args.max_seconds = 240.0 if args.quick else 1800.0
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and "--list" in sys.argv:
        for case in hostile_cases.CASES:
            print(f"{case.name:<28} {case.service:<9} {case.sent}")
        return 0
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # py-libp2p logs every reset stream at WARNING/ERROR: the report says it better
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
