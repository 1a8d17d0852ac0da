"""The hostile peer's case table: what each case sends, what a correct node does with it, and how
the answer is judged. Run by tests/helpers/hostile_peer.py, which provides `ctx` (identities,
streams to the target, notices the target sends back, the target's log).

The table is CASES, at the end: one `Case` row a case (its name, service, what it sends and the
refusal text of the check it targets). A row's `run` is a driver over a small builder where many
cases send alike (`frames`: fixed frames each refused; `member_forwards`: FORWARDs past the
membership gate; `bad_round` and `with_gossip_material`: gossip shaped like the target's state),
or a function of its own where a case is one of a kind (floods, slow senders, held slots).

Imports only `protocol`, torch and msgpack from the project: it runs beside py-libp2p, which
cannot share a process with hivemind.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import trio

from node.averaging.gossip_codec import GossipCodec, PhiDither
from protocol import MessageKind, encode_tensor
from protocol.version import PROTOCOL_VERSION

REJECTED = "rejected"
ACCEPTED = "accepted"
CRASHED = "crashed-handler (traceback)"
HANG = "hang"
INCONCLUSIVE = "inconclusive"
HARNESS_ERROR = "harness-error"
NOT_RUN = "not-run"
# refused, but the check the case is named for never spoke: an earlier gate stopped it, so the
# case covers less than its name says
OTHER_CHECK = "refused-by-another-check"
# worst first: a case that sends several inputs reports its worst answer
SEVERITY = [HARNESS_ERROR, CRASHED, HANG, ACCEPTED, OTHER_CHECK, INCONCLUSIVE, REJECTED]

HEADER = struct.Struct(">Q")
CHUNK_ELEMENTS = 1 << 18  # what the node's gossip sends per GOSSIP_CHUNK (node/averaging/gossip_wire.py)
# the swarm's gossip codec (its defaults: the test swarms do not change them): a round carries each
# tensor's Delta as 4-bit codes and scales and phi as residues on a grid dithered with the request's
# seed (node/averaging/gossip_codec.py)
GOSSIP_CODEC = GossipCodec()
PHI_KEY = PhiDither(0)
EVICTED_ATTEMPTS = 4  # own forwards a backward case sends before its gradient meets a stored microbatch
# node/p2p/membership.py's LIVENESS_PENDING (not imported: that module brings hivemind, which cannot
# share this process with py-libp2p; tests/unit/test_hostile_case_table.py checks they agree)
LIVENESS_PENDING = "liveness check pending"
FULL_QUEUE_ATTEMPTS = 10  # bare BUSY answers (a full queue) a case sends through before it gives up
EMFILE_MARKERS = ("too many open files", "emfile", "out of system resource")  # matched lowercased


# ------------------------------------------------------------------------------------------------
# Results


@dataclass
class Result:
    name: str
    service: str
    expected: str
    outcome: str | None = None
    detail: str = ""
    sent: list[str] = field(default_factory=list)
    replies: list[dict] = field(default_factory=list)
    notices: list[dict] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    log_tracebacks: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    traceback: str | None = None
    nursery: Any = None  # a trio nursery cancelled when the case ends (its identities live there)
    identity: Any = None  # the case's own peer id (fresh per case: nodes ban misbehaving peers)
    prober: Any = None  # a well-behaved peer id of the case, for "is the node still serving?"
    log_mark: int = 0  # size of the target's log when the case started
    peers: list[str] = field(default_factory=list)  # every peer id the case spoke as
    microbatches: list[int] = field(default_factory=list)  # every microbatch id it named

    def set(self, outcome: str, detail: str) -> None:
        self.outcome, self.detail = outcome, detail

    def worst(self, outcome: str, detail: str) -> None:
        """Keep the worse of the current and the new outcome."""
        if self.outcome is None or SEVERITY.index(outcome) < SEVERITY.index(self.outcome):
            self.set(outcome, detail)

    def reply(self, label: str, reply: Any) -> None:
        entry = {"label": label, "status": reply.status, "seconds": round(reply.seconds, 3)}
        for key in ("kind", "reason", "detail"):
            if getattr(reply, key):
                entry[key] = getattr(reply, key)
        self.replies.append(entry)

    def notice(self, notices: list) -> None:
        for n in notices:
            self.notices.append(
                {
                    "service": n.service,
                    "kind": n.kind,
                    "reason": n.reason,
                    "microbatch_id": n.microbatch_id,
                    "tensors": n.tensors,
                    "stats": n.stats,
                }
            )

    def to_json(self) -> dict:
        out = {
            "name": self.name,
            "service": self.service,
            "outcome": self.outcome,
            "detail": self.detail,
            "expected": self.expected,
            "sent": self.sent,
            "replies": self.replies[:40],
            "notices": self.notices[:20],
            "measurements": self.measurements,
            "seconds": round(self.seconds, 2),
            "log_tracebacks": self.log_tracebacks,
            "log_lines": self.log_lines,
        }
        if len(self.replies) > 40:
            out["replies_omitted"] = len(self.replies) - 40
        if self.traceback:
            out["traceback"] = self.traceback
        return out


@dataclass(frozen=True)
class Case:
    """One row of the table (CASES, at the end of this file): what is sent, what a correct node
    does, how it is sent (`run`: a driver over a small builder, or the case's own function), and
    the check that must be the one refusing it. `refused_by` are patterns (regular expressions,
    case-insensitive) that must all turn up in the case's evidence (`evidence`) when it is
    rejected: one per input the case sends, each naming its check's own refusal.
    `refused_by_stage0`, where given, replaces them against a stage-0 target, whose handlers differ
    (a FORWARD there is a last hop, taken only for a microbatch the target started)."""

    name: str
    service: str
    sent: str  # what goes on the wire, in words
    expected: str  # what a correct node does
    run: Callable[[Any, Result], Awaitable[None]]
    refused_by: tuple[str, ...]
    refused_by_stage0: tuple[str, ...] | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not self.refused_by:
            raise ValueError(f"case {self.name} names no check that must refuse it")

    def checks(self, stage: int) -> tuple[str, ...]:
        return self.refused_by_stage0 if stage == 0 and self.refused_by_stage0 is not None else self.refused_by


class NoMembersLeft(Exception):
    """The run has no member identity left for a case that must pass the membership gate."""


def evidence(res: Result, log_text: str) -> str:
    """Everything that can name the check that refused a case: its replies and notices (their
    reasons), its measurements, and the lines of the target's log that name one of its peer ids or
    microbatch ids (a refusal whose reply was lost, e.g. after our end of stream, is logged)."""
    parts = []  # not res.detail: the harness's own words prove nothing
    for r in res.replies:
        parts.append(" ".join(str(r[key]) for key in ("label", "status", "kind", "reason", "detail") if r.get(key)))
    parts += [f"{n['service']} {n['kind']} {n['reason']}" for n in res.notices]
    parts.append(json.dumps(res.measurements, default=str))
    names = [peer[-8:] for peer in res.peers] + [str(mb) for mb in res.microbatches]
    parts += [line for line in log_text.splitlines() if any(name in line for name in names)]
    return "\n".join(parts)


def confirm_check(case: Case, res: Result, stage: int, log_text: str) -> None:
    """A rejected case must have been refused by the checks it targets: else OTHER_CHECK."""
    if res.outcome != REJECTED:
        return
    text = evidence(res, log_text)
    missing = [pattern for pattern in case.checks(stage) if not re.search(pattern, text, re.IGNORECASE)]
    if missing:
        res.set(OTHER_CHECK, f"refused, but nothing shows {missing}: {res.detail}"[:400])


def select(spec: str | None) -> list[Case]:
    if not spec:
        return list(CASES)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    chosen = [c for c in CASES if any(c.name == w or c.name.startswith(w) for w in wanted)]
    unknown = [w for w in wanted if not any(c.name == w or c.name.startswith(w) for c in CASES)]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {[c.name for c in CASES]}")
    return chosen


# ------------------------------------------------------------------------------------------------
# Building inputs


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def raw_message(version: Any, body: Any) -> bytes:
    """A message packed by hand: whatever types we like, no validation."""
    return msgpack.packb(version) + msgpack.packb(body, use_bin_type=True)


def body(ctx, kind: str, meta: dict, tensors: dict | None = None, **over: Any) -> dict:
    out = {
        "kind": kind,
        "swarm_id": ctx.swarm_id,
        "sender_stage": ctx.stage,
        "request_id": ctx.microbatch_id(),
        "meta": meta,
        "tensors": tensors or {},
    }
    out.update(over)
    return out


def encoded(ctx, msg) -> bytes:
    from protocol import encode_message

    return frame(encode_message(msg, "none"))


def hidden(ctx, fill: float | None = None, shape: tuple[int, ...] | None = None, dtype=torch.float32) -> torch.Tensor:
    shape = shape or (1, ctx.seq_len, ctx.hidden_size)
    if fill is None:
        gen = torch.Generator().manual_seed(ctx.rng.randrange(1 << 30))
        return (torch.randn(shape, generator=gen) * 0.5).to(dtype)
    return torch.full(shape, fill, dtype=dtype)


def forward_meta(ctx, me: str, microbatch_id: int) -> dict:
    """A FORWARD that is consistent for the target's stage.

    Block stage s: order = the other block stages, then s, and hop = S, so the target's output
    goes straight back to the origin (us). Stage 0: the last hop back to the origin (the target),
    for a microbatch the target never started."""
    block_stages = ctx.num_stages - 1
    if ctx.stage >= 1:
        order = [s for s in range(1, block_stages + 1) if s != ctx.stage] + [ctx.stage]
        hop = block_stages
        origin = me
    else:
        order = list(range(1, block_stages + 1))
        hop = block_stages + 1
        origin = ctx.target_id
    return {
        "microbatch_id": microbatch_id,
        "origin": origin,
        "path": [origin] + [me] * (hop - 1),  # from its origin to the sender, as an honest path runs
        "order": order,
        "hop": hop,
        "token": token_for(microbatch_id),
    }


def backward_meta(ctx, me: str, microbatch_id: int) -> dict:
    """A BACKWARD consistent with forward_meta: the target is path[hop], we are the next hop."""
    token = token_for(microbatch_id)
    if ctx.stage >= 1:
        return {"microbatch_id": microbatch_id, "path": [me, ctx.target_id], "hop": 1, "token": token}
    return {"microbatch_id": microbatch_id, "path": [ctx.target_id, me], "hop": 0, "token": token}


def token_for(microbatch_id: int) -> str:
    """The per-attempt secret an origin may attach to a microbatch (extra meta: nodes that do not
    check one ignore it). Ours are made up: we are the origin, or guessing."""
    return hashlib.sha256(f"hostile-{microbatch_id}".encode()).hexdigest()[:32]


def forward_message(ctx, me: str, microbatch_id: int, tensor: torch.Tensor | None = None):
    return ctx.message(
        MessageKind.FORWARD, forward_meta(ctx, me, microbatch_id), {"hidden": hidden(ctx) if tensor is None else tensor}
    )


def garbage_frame() -> bytes:
    """A well-framed payload that is not msgpack: the node's cheapest rejection."""
    return frame(bytes([PROTOCOL_VERSION]) + b"\xc1" * 16)


# ------------------------------------------------------------------------------------------------
# Sending and judging


def judge(reply: Any) -> tuple[str, str]:
    """The outcome of a direct reply to an input that a correct node rejects."""
    if reply.status == "message":
        if reply.kind == "error":
            if reply.reason and "internal error" in reply.reason:
                return CRASHED, f"ERROR 'internal error' (the handler raised) after {reply.seconds:.2f}s"
            return REJECTED, f"ERROR {reply.reason!r}"[:300]
        if reply.kind == "busy":
            return REJECTED, "BUSY"
        return ACCEPTED, f"answered {reply.kind.upper()}"
    if reply.status in ("eof", "reset"):
        return REJECTED, f"stream {'closed' if reply.status == 'eof' else 'reset'} by the node"
    if reply.status == "timeout":
        return HANG, f"no reply and no close within {reply.seconds:.1f}s"
    return REJECTED, f"stream broke: {reply.status} {reply.detail or ''}".strip()


async def case_identity(ctx, res: Result):
    """The case's peer id, a fresh one after the node banned the previous one."""
    if res.identity is None:
        res.identity = await ctx.identity(res.name, res.nursery)
    return res.identity


async def member_identity(ctx, res: Result):
    """The case's peer id as a member of the swarm: its input reaches the checks behind the
    membership gate. One per case (its strikes are its own)."""
    if res.identity is None:
        res.identity = await ctx.member(res.name, res.nursery)
    return res.identity


async def prober(ctx, res: Result):
    if res.prober is None:
        res.prober = await ctx.identity(f"{res.name}-prober", res.nursery)
    return res.prober


def count_reason(reasons: dict[str, int], reply: Any) -> None:
    """Tally a reply's refusal reason (floods keep counts, not every reply)."""
    if reply.is_message and reply.reason:
        reasons[reply.reason[:120]] = reasons.get(reply.reason[:120], 0) + 1


def banned(reply: Any) -> bool:
    return reply.is_message and reply.kind == "error" and "banned" in (reply.reason or "")


async def exchange(
    ctx,
    res: Result,
    label: str,
    service: str,
    data: bytes,
    *,
    ident=None,
    close_write: bool = False,
    timeout: float | None = None,
    swarm_id: str | None = None,
    open_timeout: float | None = None,
):
    """Open a stream, write `data`, optionally half-close, read the reply; the stream is reset after.

    Note: p2pd ends the whole stream once the remote half-closes it, so after `close_write` the
    node's ERROR reply is usually lost and the rejection shows as a closed stream."""
    if ident is None:
        ident = await case_identity(ctx, res)
    try:
        wire = await ctx.open(service, ident, swarm_id=swarm_id, timeout=open_timeout)
    except Exception as e:
        reply = _Refused(str(e))
        res.reply(label, reply)
        return reply
    try:
        try:
            if data:
                await wire.send(data)
            if close_write:
                await wire.close_write()
        except Exception as e:  # the node may close before we finish writing: that is its answer
            res.sent.append(f"{label}: write failed ({type(e).__name__})")
        reply = await wire.read_message(timeout or ctx.settings.reply_timeout)
    finally:
        with trio.move_on_after(2.0):
            await wire.reset()
    res.reply(label, reply)
    return reply


@dataclass
class _Refused:
    """A stream the node would not open: protocol negotiation failed or the connection is gone."""

    detail: str
    status: str = "refused"
    seconds: float = 0.0
    kind: str | None = None
    reason: str | None = None

    @property
    def is_message(self) -> bool:
        return False


def judge_any(reply: Any) -> tuple[str, str]:
    if reply.status == "refused":
        return REJECTED, f"stream refused at negotiation ({reply.detail[:120]})"
    return judge(reply)


async def must_reject(
    ctx,
    res: Result,
    label: str,
    service: str,
    data: bytes,
    *,
    close_write: bool = True,
    repetitions: int | None = None,
    **kw: Any,
) -> None:
    """Send the same input `repetitions` times; each must be rejected."""
    for i in range(repetitions or ctx.settings.repetitions):
        reply = await exchange(ctx, res, f"{label}#{i + 1}", service, data, close_write=close_write, **kw)
        if banned(reply) and "ident" not in kw:
            # the node banned the case's peer id for its earlier inputs (a fine answer): this input
            # is judged on its own, from a new peer id
            res.measurements["banned_by_node"] = res.measurements.get("banned_by_node", 0) + 1
            res.identity = None
            reply = await exchange(
                ctx, res, f"{label}#{i + 1} (new peer id)", service, data, close_write=close_write, **kw
            )
        outcome, detail = judge_any(reply)
        res.worst(outcome, detail)


async def exchange_past_full_queue(ctx, res: Result, label: str, service: str, data: bytes, *, ident) -> Any:
    """`exchange`, sent again while the target answers a bare BUSY (its queue is full of honest
    traffic; an honest sender tries again too): the check the case targets sits behind the queue.
    A BUSY with a reason (e.g. "not a member") is an answer, returned as it is, except the one
    that asks us to answer the node's liveness ping first (our hosts answer it): sent again too."""
    for attempt in range(FULL_QUEUE_ATTEMPTS):
        reply = await exchange(ctx, res, f"{label} #{attempt + 1}", service, data, ident=ident)
        if not (reply.is_message and reply.kind == "busy" and (not reply.reason or LIVENESS_PENDING in reply.reason)):
            break
        await trio.sleep(0.5)
    return reply


async def send_and_follow(
    ctx, res: Result, label: str, service: str, msg, microbatch_id: int, *, ident=None, notice_wait: float | None = None
) -> tuple[Any, list]:
    """Send one pipeline message; when it is ACKed, wait for what the node does with it next: an
    ABORT notice (a deferred rejection) or a computed answer (FORWARD / BACKWARD to us)."""
    since = time.monotonic()
    reply = await exchange_past_full_queue(ctx, res, label, service, encoded(ctx, msg), ident=ident)
    if not (reply.is_message and reply.kind == "ack"):
        res.worst(*judge_any(reply))
        return reply, []
    notices = await ctx.wait_notice(microbatch_id, notice_wait or ctx.settings.notice_wait, since=since)
    res.notice(notices)
    aborts = [n for n in notices if n.service == "abort"]
    answers = [n for n in notices if n.service != "abort"]
    if aborts:
        res.worst(REJECTED, f"ACK, then an ABORT notice {aborts[0].reason!r}"[:300])
    elif answers:
        a = answers[0]
        res.worst(
            ACCEPTED, f"ACK, then computed and answered: {a.service.upper()} {a.tensors} after {a.at - since:.2f}s"
        )
    else:
        res.worst(ACCEPTED, f"ACK and no rejection within {notice_wait or ctx.settings.notice_wait:.0f}s")
    return reply, notices


async def own_forward(ctx, res: Result, ident, microbatch_id: int) -> bool:
    """A valid forward of ours that the target computes (block stages): the setup of the
    backward cases. True when its output came back, i.e. the activations are stored there."""
    msg = forward_message(ctx, ident.peer_id, microbatch_id)
    since = time.monotonic()
    reply = await exchange_past_full_queue(ctx, res, "setup: own forward", "forward", encoded(ctx, msg), ident=ident)
    if not (reply.is_message and reply.kind == "ack"):
        return False
    notices = await ctx.wait_notice(
        microbatch_id, 2 * ctx.settings.notice_wait, services=("forward", "abort"), since=since
    )
    res.notice(notices)
    return any(n.service == "forward" for n in notices)


async def probe(ctx, res: Result, label: str, fresh: bool = False, timeout: float | None = None) -> bool:
    """Is the node still serving? A malformed request must get its ERROR within the reply
    timeout; `fresh` also makes a new connection (a new peer reaching it)."""
    ident = None
    if fresh:
        try:
            ident = await ctx.identity(f"probe-{label}", res.nursery, timeout=timeout)
        except Exception as e:  # trio.TooSlowError included
            res.sent.append(f"probe {label}: could not connect ({type(e).__name__}: {e})"[:200])
            res.replies.append({"label": f"probe {label}", "status": "connect-failed", "detail": str(e)[:200]})
            return False
    if ident is None:
        ident = await prober(ctx, res)
    reply = await exchange(
        ctx, res, f"probe {label}", "forward", garbage_frame(), ident=ident, timeout=timeout, open_timeout=timeout
    )
    return reply.is_message and reply.kind == "error"


def log_has(ctx, res: Result, markers: tuple[str, ...]) -> list[str]:
    """New lines of the target's log holding any of `markers` (case-insensitive)."""
    lowered = [m.lower() for m in markers]
    return [line[:300] for line in ctx.log_since(res.log_mark).splitlines() if any(m in line.lower() for m in lowered)][
        :10
    ]


# ------------------------------------------------------------------------------------------------
# Rows whose inputs are fixed frames


@dataclass
class Input:
    """One frame a row sends, and where (the row's service unless named)."""

    label: str  # what it is, in words: the report's "sent" and its replies' label
    data: bytes
    service: str | None = None


def frames(
    build: Callable[[Any], list[Input]], *, close_write: bool = False, repetitions: int | None = None
) -> Callable[[Any, Result], Awaitable[None]]:
    """The driver of a row that sends fixed frames, each rejected every time (`must_reject`):
    `build` only makes the frames. `close_write`: end our side after the frame (the input is a
    truncation); `repetitions`: sends of each (default: the run's setting)."""

    async def run(ctx, res: Result) -> None:
        for one in build(ctx):
            res.sent.append(one.label)
            await must_reject(
                ctx,
                res,
                one.label,
                one.service or res.service,
                one.data,
                close_write=close_write,
                repetitions=repetitions,
            )

    return run


def tensor_claiming(shape: list[int], data_bytes: int) -> dict:
    """An encoded float32 tensor whose header claims `shape` over `data_bytes` zero bytes."""
    return {"dtype": "float32", "codec": "none", "shape": shape, "data": bytes(data_bytes)}


# ------------------------------------------------------------------------------------------------
# Framing and envelope


def random_bytes(ctx) -> list[Input]:
    data = bytes(ctx.rng.randrange(256) for _ in range(4096))
    return [Input(f"{len(data)} random bytes, first 8 = {data[:8].hex()}", data)]


def empty_stream(ctx) -> list[Input]:
    return [Input("nothing, then end of stream", b"")]


def truncated_header(ctx) -> list[Input]:
    return [Input("b'\\x00\\x00\\x00' then EOF", b"\x00\x00\x00")]


def truncated_frame(ctx) -> list[Input]:
    full = encoded(ctx, forward_message(ctx, "x", ctx.microbatch_id()))
    return [Input("header 4096 + 100 payload bytes of a real FORWARD, then EOF", HEADER.pack(4096) + full[8:108])]


def huge_length_prefix(ctx) -> list[Input]:
    return [
        Input("header 8589934592, 1024 zero bytes, no EOF", HEADER.pack(8 << 30) + bytes(1024)),
        Input("header 2**64-1, 16 zero bytes, no EOF", HEADER.pack((1 << 64) - 1) + bytes(16), service="abort"),
    ]


def garbage_msgpack(ctx) -> list[Input]:
    return [Input("frame(version byte + b'\\xc1' * 16)", garbage_frame())]


def wrong_msgpack_types(ctx) -> list[Input]:
    tensors = {"hidden": encode_tensor(hidden(ctx))}
    variants = {
        "body is a list": [1, 2, 3],
        "sender_stage is a string": body(ctx, "forward", {}, sender_stage="one"),
        "request_id negative": body(ctx, "forward", {}, request_id=-5),
        "meta is a list": body(ctx, "forward", [1, 2]),
        "tensors is a string": body(ctx, "forward", forward_meta(ctx, "x", 1), "hidden"),
        "microbatch_id is a string": body(
            ctx, "forward", {**forward_meta(ctx, "x", 1), "microbatch_id": "abc"}, tensors
        ),
        "hop is a float": body(ctx, "forward", {**forward_meta(ctx, "x", 1), "hop": 1.5}, tensors),
        "path holds ints": body(ctx, "forward", {**forward_meta(ctx, "x", 1), "path": [1, 2]}, tensors),
        "map key is an int": body(ctx, "forward", {7: "x"}),
    }
    return [Input(label, frame(raw_message(PROTOCOL_VERSION, value))) for label, value in variants.items()]


def unknown_kind(ctx) -> list[Input]:
    return [Input("kind='detonate'", frame(raw_message(PROTOCOL_VERSION, body(ctx, "detonate", {}))))]


def unknown_version(ctx) -> list[Input]:
    payload = encoded(ctx, forward_message(ctx, "x", ctx.microbatch_id()))[HEADER.size :]
    assert payload[0] == PROTOCOL_VERSION  # a positive fixint: swap in another version
    return [
        Input(f"FORWARD version {version}", frame(msgpack.packb(version) + payload[1:])) for version in (99, 1 << 40)
    ]


async def wrong_swarm_id(ctx, res: Result) -> None:
    me = (await case_identity(ctx, res)).peer_id
    msg = ctx.message(
        MessageKind.FORWARD,
        forward_meta(ctx, me, ctx.microbatch_id()),
        {"hidden": hidden(ctx)},
        swarm_id="some-other-swarm",
    )
    res.sent.append("FORWARD with swarm_id='some-other-swarm' on our swarm's protocol")
    await must_reject(ctx, res, "message swarm", "forward", encoded(ctx, msg), close_write=False)
    res.sent.append("stream to /pipeswarm/some-other-swarm/forward")
    await must_reject(
        ctx,
        res,
        "protocol swarm",
        "forward",
        encoded(ctx, msg),
        close_write=False,
        repetitions=1,
        swarm_id="some-other-swarm",
    )


# ------------------------------------------------------------------------------------------------
# Tensors


def _forward_with(ctx, me: str, mb: int, tensor_obj: dict) -> bytes:
    return frame(raw_message(PROTOCOL_VERSION, body(ctx, "forward", forward_meta(ctx, me, mb), {"hidden": tensor_obj})))


def tensor_byte_count(ctx) -> list[Input]:
    obj = encode_tensor(hidden(ctx))
    obj["data"] = obj["data"][:100]
    return [Input("hidden data truncated to 100 bytes", _forward_with(ctx, "x", ctx.microbatch_id(), obj))]


def tensor_bad_dtype(ctx) -> list[Input]:
    inputs = []
    for key, value in (("dtype", "complex128"), ("codec", "zip")):
        obj = encode_tensor(hidden(ctx))
        obj[key] = value
        inputs.append(Input(f"hidden {key}={value!r}", _forward_with(ctx, "x", ctx.microbatch_id(), obj)))
    return inputs


def tensor_dtype_disagrees(ctx) -> list[Input]:
    obj = encode_tensor(hidden(ctx))
    obj["dtype"] = "float16"
    return [Input("dtype float16, data of a float32 tensor", _forward_with(ctx, "x", ctx.microbatch_id(), obj))]


@dataclass(frozen=True)
class HiddenVariant:
    """One FORWARD a member sends: its hidden tensor, made once the microbatch id is drawn."""

    sent: str  # the report's "sent"
    label: str  # its replies' label
    tensor: Callable[[], torch.Tensor]


def member_forwards(build: Callable[[Any], list[HiddenVariant]]) -> Callable[[Any, Result], Awaitable[None]]:
    """The driver of a row whose FORWARDs must pass the membership gate to reach the tensor check
    they target: each variant from one member identity, followed (`send_and_follow`) to its ERROR,
    its ABORT notice, or the node's computed answer."""

    async def run(ctx, res: Result) -> None:
        ident = await member_identity(ctx, res)
        for variant in build(ctx):
            mb = ctx.microbatch_id()
            tensor = variant.tensor()
            res.sent.append(variant.sent)
            await send_and_follow(
                ctx, res, variant.label, "forward", forward_message(ctx, ident.peer_id, mb, tensor), mb
            )

    return run


def tensor_int_hidden(ctx) -> list[HiddenVariant]:
    shape = (1, ctx.seq_len, ctx.hidden_size)
    return [HiddenVariant("hidden int64 [1,T,H]", "int hidden", lambda: torch.ones(shape, dtype=torch.int64))]


def tensor_shape_disagrees(ctx) -> list[HiddenVariant]:
    return [
        HiddenVariant(f"hidden {list(shape)}", f"shape {list(shape)}", lambda shape=shape: hidden(ctx, shape=shape))
        for shape in ((1, ctx.seq_len, ctx.hidden_size + 1), (1, ctx.seq_len))
    ]


def absurd_shape(ctx) -> list[Input]:
    return [
        Input(f"shape {shape}, 16 bytes", _forward_with(ctx, "x", ctx.microbatch_id(), tensor_claiming(shape, 16)))
        for shape in ([1 << 40, 1 << 40, 64], [1 << 62], [0, 1 << 62, 1 << 62])
    ]


def absurd_dims(ctx) -> list[Input]:
    return [
        Input(
            f"shape of {len(shape)} dims, {shape[:4]}",
            _forward_with(ctx, "x", ctx.microbatch_id(), tensor_claiming(shape, 4)),
        )
        for shape in ([1] * 64, [-1, ctx.seq_len, ctx.hidden_size])
    ]


def nan_activations(ctx) -> list[HiddenVariant]:
    def holding(value: float) -> torch.Tensor:
        t = hidden(ctx)
        t[0, 0, 0] = value
        return t

    return [
        HiddenVariant(f"hidden with one {value}", f"{value} hidden", lambda value=value: holding(value))
        for value in (math.nan, math.inf)
    ]


# ------------------------------------------------------------------------------------------------
# Pipeline semantics


async def forward_bad_path(ctx, res: Result) -> None:
    ident = await case_identity(ctx, res)
    meta = forward_meta(ctx, ident.peer_id, ctx.microbatch_id())
    meta["path"] = [ctx.target_id] * meta["hop"]
    res.sent.append("path[-1] is the target, not us")
    msg = ctx.message(MessageKind.FORWARD, meta, {"hidden": hidden(ctx)})
    await must_reject(ctx, res, "path", "forward", encoded(ctx, msg), close_write=False, repetitions=1)
    meta = forward_meta(ctx, ident.peer_id, ctx.microbatch_id())
    # the path says who started it: an origin elsewhere would have abort notices sent to a bystander
    meta["origin"] = ident.peer_id if meta["origin"] == ctx.target_id else ctx.target_id
    res.sent.append("origin is not the path's first peer")
    msg = ctx.message(MessageKind.FORWARD, meta, {"hidden": hidden(ctx)})
    await must_reject(ctx, res, "origin", "forward", encoded(ctx, msg), close_write=False, repetitions=1)
    meta = forward_meta(ctx, ident.peer_id, ctx.microbatch_id())
    meta["order"] = [ctx.num_stages + 5] * len(meta["order"])
    res.sent.append(f"order {meta['order']}")
    msg = ctx.message(MessageKind.FORWARD, meta, {"hidden": hidden(ctx)})
    await must_reject(ctx, res, "order", "forward", encoded(ctx, msg), close_write=False, repetitions=1)


async def stranger_forward(ctx, res: Result) -> None:
    ident = await ctx.identity("stranger", res.nursery)
    mb = ctx.microbatch_id()
    res.sent.append(
        f"FORWARD [1,{ctx.seq_len},{ctx.hidden_size}] float32, origin = us, hop {forward_meta(ctx, 'x', 1)['hop']}"
    )
    await send_and_follow(
        ctx, res, "stranger forward", "forward", forward_message(ctx, ident.peer_id, mb), mb, ident=ident
    )


async def forward_flood(ctx, res: Result) -> None:
    ident = await ctx.identity("flooder", res.nursery)
    count = 24 if ctx.settings.quick else 300
    statuses: dict[str, int] = {}
    reasons: dict[str, int] = {}
    ids = [ctx.microbatch_id() for _ in range(count)]
    since = time.monotonic()
    limiter = trio.Semaphore(8)

    async def one(mb: int) -> None:
        async with limiter:
            reply = await exchange(
                ctx,
                _Sink(),
                "flood forward",
                "forward",
                encoded(ctx, forward_message(ctx, ident.peer_id, mb)),
                ident=ident,
            )
            key = reply.kind if reply.is_message else reply.status
            statuses[key] = statuses.get(key, 0) + 1
            count_reason(reasons, reply)

    async with trio.open_nursery() as nursery:
        for mb in ids:
            nursery.start_soon(one, mb)
    await trio.sleep(ctx.settings.notice_wait)
    wanted = set(ids)
    answered = [n for n in ctx.notices if n.microbatch_id in wanted and n.at >= since and n.service == "forward"]
    aborted = [n for n in ctx.notices if n.microbatch_id in wanted and n.at >= since and n.service == "abort"]
    res.sent.append(f"{count} valid FORWARDs")
    res.measurements.update(
        replies=statuses, reasons=reasons, computed_and_answered=len(answered), aborted=len(aborted)
    )
    if statuses.get("ack"):
        res.set(
            ACCEPTED,
            f"{statuses.get('ack')} of {count} ACKed, {len(answered)} computed and answered, replies {statuses}",
        )
    elif statuses.get("timeout"):
        res.set(HANG, f"replies {statuses}")
    else:
        res.set(REJECTED, f"replies {statuses}")


class _Sink(Result):
    """A Result that forgets what it is told (floods would fill the report)."""

    def __init__(self) -> None:
        super().__init__("", "", "", None)

    def reply(self, label: str, reply: Any) -> None:
        pass


async def nan_gradient(ctx, res: Result) -> None:
    grad = hidden(ctx)
    grad[0, 0, 0] = math.nan
    res.sent.append("BACKWARD grad with one NaN, after our own forward (block stages)")
    await backward_after_own_forward(ctx, res, grad, "nan grad")


async def backward_after_own_forward(ctx, res: Result, grad: torch.Tensor, label: str) -> list:
    """As a member: our own FORWARD computed by a block-stage target (its activations stored), then
    a BACKWARD carrying `grad` for it; the notices that followed. A target whose store evicted our
    microbatch for honest ones before the gradient came (its store holds one origin's window, and
    two stage-0 peers feed it) answers "backward failed" without reaching its gradient checks: that
    is tried again, a bounded number of times, with a new microbatch."""
    ident = await member_identity(ctx, res)
    notices: list = []
    for attempt in range(EVICTED_ATTEMPTS):
        mb = ctx.microbatch_id()
        stored = ctx.stage >= 1 and await own_forward(ctx, res, ident, mb)
        res.measurements["own_forward_stored"] = stored
        msg = ctx.message(MessageKind.BACKWARD, backward_meta(ctx, ident.peer_id, mb), {"grad": grad})
        _, notices = await send_and_follow(ctx, res, label, "backward", msg, mb, ident=ident)
        evicted = stored and any(n.service == "abort" and "rejected" not in (n.reason or "") for n in notices)
        if not evicted:
            break
        res.measurements["evicted_before_backward"] = attempt + 1
    return notices


async def backward_never_sent(ctx, res: Result) -> None:
    ident = await case_identity(ctx, res)
    mb = ctx.microbatch_id()
    res.sent.append(f"BACKWARD for microbatch {mb}")
    msg = ctx.message(MessageKind.BACKWARD, backward_meta(ctx, ident.peer_id, mb), {"grad": hidden(ctx)})
    await send_and_follow(ctx, res, "unknown microbatch", "backward", msg, mb)


async def backward_huge_gradient(ctx, res: Result) -> None:
    # the in-process case is tests/unit/test_stage_worker.py
    res.sent.append("BACKWARD grad = 3e38 everywhere (float32, 'none' codec), after our own forward (block stages)")
    notices = await backward_after_own_forward(ctx, res, hidden(ctx, fill=3e38), "3e38 grad")
    if res.outcome != ACCEPTED:
        return
    # the poisoned step happens when the accumulation completes (maybe with the next honest microbatch)
    deadline = time.monotonic() + ctx.settings.notice_wait * 2
    skipped: list[str] = []
    while time.monotonic() < deadline and not skipped:
        skipped = log_has(ctx, res, ("step skipped",))
        await trio.sleep(0.5)
    res.measurements["log_step_skipped"] = skipped
    grads = [n for n in notices if n.service == "backward"]
    detail = "ACK; the node backpropagated it"
    if grads:
        detail += (
            f" and sent us its input gradient (absmax {grads[0].stats.get('grad_absmax')}, "
            f"{grads[0].stats.get('grad_nonfinite')} non-finite)"
        )
    detail += f"; log: {skipped[0]!r}" if skipped else "; no 'step skipped' seen in the log (no --target-log?)"
    res.set(ACCEPTED, detail[:400])


def abort_list_id(ctx) -> list[Input]:
    msg = ctx.message(MessageKind.ERROR, {"reason": "hostile", "microbatch_id": [1, 2, 3], "token": token_for(1)})
    return [Input("ERROR{reason:'hostile', microbatch_id:[1,2,3]} to abort", encoded(ctx, msg))]


async def backward_names_a_victim(ctx, res: Result) -> None:
    sender = await case_identity(ctx, res)
    victim = await ctx.identity("victim", res.nursery)
    mb = ctx.microbatch_id()
    # we are the next hop after the target on a path whose origin is the victim: the target never
    # computed that microbatch, so it refuses the gradient at once and must not tell the victim
    meta = {
        "microbatch_id": mb,
        "path": [victim.peer_id, ctx.target_id, sender.peer_id],
        "hop": 1,
        "token": token_for(mb),
    }
    res.sent.append(f"BACKWARD from {sender.peer_id[-8:]} naming victim {victim.peer_id[-8:]} as origin")
    since = time.monotonic()
    reply = await exchange(
        ctx,
        res,
        "backward naming a victim",
        "backward",
        encoded(ctx, ctx.message(MessageKind.BACKWARD, meta, {"grad": hidden(ctx)})),
        ident=sender,
    )
    await ctx.wait_notice(mb, ctx.settings.notice_wait, since=since)
    await trio.sleep(1.0)  # a reflected notice may come after the one to the sender
    notices = [n for n in ctx.notices if n.microbatch_id == mb and n.at >= since]
    res.notice(notices)
    to_victim = [n for n in notices if n.receiver == victim.peer_id]
    to_sender = [n for n in notices if n.receiver == sender.peer_id and n.service == "abort"]
    res.measurements.update(to_victim=len(to_victim), returned_to_sender=to_sender[0].reason if to_sender else None)
    if to_victim:
        res.set(
            ACCEPTED, f"reflected: the target sent {to_victim[0].service.upper()} to the peer the request only named"
        )
    elif reply.is_message and reply.kind == "ack":
        res.set(
            REJECTED,
            "ACK; the victim heard nothing" + (f", the sender got {to_sender[0].reason!r}" if to_sender else ""),
        )
    else:
        res.set(*judge_any(reply))


async def abort_unrelated(ctx, res: Result) -> None:
    ident = await ctx.identity("aborter", res.nursery)
    mb = ctx.microbatch_id()
    msg = ctx.message(MessageKind.ERROR, {"reason": "hostile: give up", "microbatch_id": mb, "token": token_for(mb)})
    res.sent.append(f"ERROR{{reason, microbatch_id:{mb}}} to abort from a stranger")
    reply = await exchange(ctx, res, "unrelated abort", "abort", encoded(ctx, msg), ident=ident)
    outcome, detail = judge_any(reply)
    if outcome == ACCEPTED:
        detail += " for a microbatch we are on no path of (any in-flight id would be cancelled the same way)"
    res.set(outcome, detail)


# ------------------------------------------------------------------------------------------------
# State download


def state_wrong_stage(ctx) -> list[Input]:
    return [
        Input(
            f"STATE_REQUEST stage {stage}",
            encoded(ctx, ctx.message(MessageKind.STATE_REQUEST, {"stage": stage, "part": "stage"})),
        )
        for stage in (ctx.stage + 7, (1 << 31) - 1)
    ]


def state_bad_request(ctx) -> list[Input]:
    bad_part = ctx.message(MessageKind.STATE_REQUEST, {"stage": ctx.stage, "part": "../../private_key"})
    return [
        Input("part '../../private_key'", encoded(ctx, bad_part)),
        Input("FORWARD on the state service", encoded(ctx, forward_message(ctx, "x", 1))),
    ]


async def state_download_loop(ctx, res: Result) -> None:
    ident = await ctx.identity("state-looper", res.nursery)
    served = 0
    for attempt in range(12):  # the budget is 4 an identity a minute: the 5th must be refused
        wire = await ctx.open("state", ident)
        try:
            await wire.send_message(ctx.message(MessageKind.STATE_REQUEST, {"stage": ctx.stage, "part": "stage"}))
            head = await wire.read_message(ctx.settings.reply_timeout)
        finally:
            with trio.move_on_after(2.0):
                await wire.reset()  # the donor counted the answer once it sent the header
        res.sent.append(f"request {attempt + 1}")
        if head.is_message and head.kind == "state_header":
            served += 1
            continue
        res.reply(f"request {attempt + 1} (after {served} served)", head)
        if head.is_message and head.kind == "busy":  # uploading to others: not an answer, ask again
            await trio.sleep(1.0)
            continue
        res.measurements["served_before_refusal"] = served
        res.set(*judge(head))
        return
    res.measurements["served_before_refusal"] = served
    res.set(ACCEPTED, f"the whole stage was served {served} times to one identity without a refusal")


async def download_state(ctx, res: Result, ident) -> dict | None:
    """The target's own stage state through the ordinary state service (what any joiner gets). Only
    the attack's setup: a busy donor, a refusal or a broken download is tried again (as a joiner
    tries another donor), up to 10 times, and each failure is noted in the case's report."""
    for _ in range(10):
        wire = await ctx.open("state", ident)
        try:
            await wire.send_message(ctx.message(MessageKind.STATE_REQUEST, {"stage": ctx.stage, "part": "stage"}))
            head = await wire.read_message(ctx.settings.reply_timeout)
            if not (head.is_message and head.kind == "state_header"):
                res.sent.append(f"setup: state download answered {head.summary()}")
                await trio.sleep(1.0)
                continue
            meta = wire.last_message.meta
            payload = bytearray()
            while True:
                reply = await wire.read_message(ctx.settings.reply_timeout)
                if not reply.is_message or reply.kind == "state_end":
                    break
                payload += wire.last_message.tensors["chunk"].numpy().tobytes()
            if not reply.is_message:
                res.sent.append(f"setup: state download broke: {reply.summary()}")
                await trio.sleep(1.0)
                continue
        finally:
            with trio.move_on_after(2.0):
                await wire.reset()
        tensors, offset = {}, 0
        from protocol.tensors import DTYPES

        for name, shape, dtype in zip(meta["names"], meta["shapes"], meta["dtypes"]):
            t = torch.empty(shape, dtype=DTYPES[dtype])
            size = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(payload[offset : offset + size]), dtype=torch.uint8)
            )
            tensors[name] = t
            offset += size
        return {"meta": meta, "tensors": tensors}
    return None


# (parameter names, phi, theta) of the target's stage, from its downloaded state
GossipMaterial = tuple[list[str], list[torch.Tensor], list[torch.Tensor]]


def gossip_material(state: dict) -> GossipMaterial | None:
    """(parameter names, phi, theta) from a downloaded state; None when it has no outer state."""
    tensors = state["tensors"]
    names = [n[len("outer.phi.") :] for n in tensors if n.startswith("outer.phi.")]
    if not names or any(n not in tensors for n in names):
        return None
    phi = [tensors[f"outer.phi.{n}"].to(torch.float32) for n in names]
    theta = [tensors[n].to(torch.float32) for n in names]
    return names, phi, theta


# ------------------------------------------------------------------------------------------------
# Gossip


async def gossip_request(ctx, res: Result, ident, meta: dict, sender_stage: int | None = None):
    """Ask for a round until the target is free: (wire with an ACCEPT read, None) or (None, final reply)."""
    busy = 0
    for attempt in range(ctx.settings.gossip_attempts):
        wire = await ctx.open("gossip", ident)
        await wire.send_message(ctx.message(MessageKind.GOSSIP_REQUEST, meta, sender_stage=sender_stage))
        reply = await wire.read_message(ctx.settings.reply_timeout)
        if reply.is_message and reply.kind == "gossip_accept":
            res.reply(f"gossip request #{attempt + 1}", reply)
            res.measurements["busy_before_accept"] = busy
            return wire, reply
        with trio.move_on_after(2.0):
            await wire.reset()
        if reply.is_message and reply.kind == "busy":
            busy += 1
            count_reason(res.measurements.setdefault("busy_reasons", {}), reply)
            await trio.sleep(ctx.rng.uniform(0.3, 0.8))
            continue
        res.reply(f"gossip request #{attempt + 1}", reply)
        res.measurements["busy_before_accept"] = busy
        return None, reply
    res.measurements["busy_before_accept"] = busy
    return None, None


def request_meta(n: int, total: int) -> dict:
    return {"round": 0, "num_tensors": n, "total_numel": total, "mode": "noloco", "steps": 0, "phi_seed": PHI_KEY.seed}


def round_tensors(phi: list[torch.Tensor], delta: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an initiator sends in a round (as the node encodes it): each tensor's Delta codes and
    scales and phi's residues. A NaN in Delta lands in its scale, and so in the decoded values."""
    return GOSSIP_CODEC.encode(delta, [torch.zeros_like(d) for d in delta], phi, PHI_KEY)[0]


async def drain(wire, timeout: float, out: dict, done: trio.Event) -> None:
    """Read the target's side of a round (its chunks, then its DONE) until it ends."""
    out["chunks"] = 0
    try:
        deadline = time.monotonic() + timeout
        while True:
            reply = await wire.read_message(max(0.1, deadline - time.monotonic()))
            if reply.is_message and reply.kind == "gossip_chunk":
                out["chunks"] += 1
                continue
            out["final"] = reply
            out["ended_at"] = time.monotonic()
            if reply.is_message and reply.kind == "gossip_done":
                out["accept"] = wire.last_message.meta.get("accept")
                out["reason"] = wire.last_message.meta.get("reason")
            return
    finally:
        done.set()


async def send_tensors(ctx, wire, tensors: list[torch.Tensor]) -> None:
    for index, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        for offset in range(0, max(flat.numel(), 1), CHUNK_ELEMENTS):
            meta = {"round": 0, "index": index, "offset": offset}
            await wire.send_message(
                ctx.message(MessageKind.GOSSIP_CHUNK, meta, {"chunk": flat[offset : offset + CHUNK_ELEMENTS].clone()})
            )


async def gossip_round(
    ctx,
    res: Result,
    label: str,
    phi: list[torch.Tensor],
    delta: list[torch.Tensor],
    chunks: Callable[[Any], Awaitable[None]] | None = None,
) -> None:
    """A whole noloco round as a responder sees it from an initiator: request, swap, DONE. Sent as
    a member of the swarm (a record of the target's stage), since only members get an exchange."""
    ident = await ctx.member(label, res.nursery, stage=ctx.stage)  # one per round: a rejected round bans the sender
    total = sum(p.numel() for p in phi)
    wire, reply = await gossip_request(ctx, res, ident, request_meta(len(phi), total))
    if wire is None:
        if reply is None:
            res.set(
                INCONCLUSIVE, f"the target answered BUSY {ctx.settings.gossip_attempts} times: never free for a round"
            )
        else:
            res.set(*judge_any(reply))
        return
    out: dict = {}
    done = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, wire, 3 * ctx.settings.reply_timeout, out, done)
            try:
                if chunks is not None:
                    await chunks(wire)
                else:
                    await send_tensors(ctx, wire, round_tensors(phi, delta))
                    await wire.send_message(
                        ctx.message(MessageKind.GOSSIP_DONE, {"round": 0, "accept": True, "reason": ""})
                    )
            except Exception as e:
                out["write_error"] = type(e).__name__
            with trio.move_on_after(3 * ctx.settings.reply_timeout):
                await done.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.move_on_after(2.0):
            await wire.reset()
    final = out.get("final")
    res.measurements.update(target_chunks=out.get("chunks"), write_error=out.get("write_error"))
    if final is None:
        res.set(HANG, "the round neither finished nor closed")
        return
    res.reply("round end", final)
    if final.is_message and final.kind == "gossip_done":
        if out.get("accept"):
            res.set(
                ACCEPTED,
                f"GOSSIP_DONE accept=True: the target took our tensors into its outer step "
                f"(after {out['chunks']} chunks of its own)",
            )
        else:
            res.set(REJECTED, f"GOSSIP_DONE accept=False {out.get('reason')!r}"[:300])
        return
    res.set(*judge(final))


async def material(ctx, res: Result) -> GossipMaterial | None:
    ident = await ctx.identity("state-reader", res.nursery)
    state = await download_state(ctx, res, ident)
    if state is None:
        res.set(INCONCLUSIVE, "could not download the target's state (needed to shape gossip tensors)")
        return None
    found = gossip_material(state)
    if found is None:
        res.set(INCONCLUSIVE, "the target's state carries no outer state (gossip disabled?)")
        return None
    res.measurements["state_inner_step"] = state["meta"].get("inner_step")
    res.measurements["state_outer_round"] = state["meta"].get("outer_round")
    return found


def with_gossip_material(
    play: Callable[[Any, Result, GossipMaterial], Awaitable[None]],
) -> Callable[[Any, Result], Awaitable[None]]:
    """The driver of a gossip row whose tensors are shaped like the target's own: its state is
    downloaded first (`material`, INCONCLUSIVE when that fails), then `play` runs with it."""

    async def run(ctx, res: Result) -> None:
        found = await material(ctx, res)
        if found is not None:
            await play(ctx, res, found)

    return run


async def gossip_from_stranger(ctx, res: Result, found: GossipMaterial) -> None:
    _names, phi, _theta = found
    request = ctx.message(MessageKind.GOSSIP_REQUEST, request_meta(len(phi), sum(p.numel() for p in phi)))
    label = "GOSSIP_REQUEST, well-formed, from a stranger"
    await must_reject(ctx, res, label, "gossip", encoded(ctx, request), close_write=False, repetitions=1)


async def gossip_wrong_stage(ctx, res: Result) -> None:
    ident = await ctx.identity("gossip-wrong", res.nursery)
    other = (ctx.stage + 1) % ctx.num_stages
    res.sent.append(f"GOSSIP_REQUEST sender_stage {other}")
    wire, reply = await gossip_request(ctx, res, ident, request_meta(1, 1), sender_stage=other)
    if wire is not None:
        with trio.move_on_after(2.0):
            await wire.reset()
        res.worst(ACCEPTED, "ACCEPT for another stage")
    elif reply is not None:
        res.worst(*judge_any(reply))
    res.sent.append("GOSSIP_REQUEST num_tensors 100000, total_numel 3")
    wire, reply = await gossip_request(ctx, res, ident, request_meta(100000, 3))
    if wire is not None:
        with trio.move_on_after(2.0):
            await wire.reset()
        res.worst(ACCEPTED, "ACCEPT with wrong tensor counts")
    elif reply is not None:
        res.worst(*judge_any(reply))
    else:
        res.worst(INCONCLUSIVE, "always BUSY")


async def gossip_chunk_shape(ctx, res: Result, found: GossipMaterial) -> None:
    _names, phi, _theta = found

    async def bad_chunks(wire) -> None:
        first = phi[0].reshape(-1)
        bad = torch.zeros(2, first.numel() + 7)
        res.sent.append(f"GOSSIP_CHUNK index 0 shaped {list(bad.shape)} (tensor 0 has {first.numel()} elements)")
        await wire.send_message(
            ctx.message(MessageKind.GOSSIP_CHUNK, {"round": 0, "index": 0, "offset": 0}, {"chunk": bad})
        )
        await wire.send_message(ctx.message(MessageKind.GOSSIP_DONE, {"round": 0, "accept": True, "reason": ""}))

    await gossip_round(ctx, res, "gossip-shape", phi, phi, chunks=bad_chunks)


@dataclass(frozen=True)
class BadRound:
    """What a round of a gossip row sends: phi and Delta made from the target's own."""

    sent: str  # the report's "sent"
    phi: list[torch.Tensor]
    delta: list[torch.Tensor]


def bad_round(label: str, build: Callable[[GossipMaterial], BadRound]) -> Callable[[Any, Result], Awaitable[None]]:
    """The driver of a row that plays one whole round (`gossip_round`, as member `label`) of the
    tensors `build` makes from the target's own state."""

    async def play(ctx, res: Result, found: GossipMaterial) -> None:
        sent = build(found)
        res.sent.append(sent.sent)
        await gossip_round(ctx, res, label, sent.phi, sent.delta)

    return with_gossip_material(play)


def gossip_nan_weights(found: GossipMaterial) -> BadRound:
    names, phi, theta = found
    delta = [p - t for p, t in zip(phi, theta)]
    delta[0].view(-1)[0] = math.nan  # its block's scale becomes NaN
    return BadRound(f"phi = the target's phi; Delta = its own with {names[0]}[0] = NaN", phi, delta)


def gossip_huge_weights(found: GossipMaterial) -> BadRound:
    _names, phi, theta = found
    return BadRound(
        "phi = 1e6 x the target's phi; Delta = 1e6 x its own",
        [p * 1e6 for p in phi],
        [(p - t) * 1e6 for p, t in zip(phi, theta)],
    )


def gossip_negated_weights(found: GossipMaterial) -> BadRound:
    _names, phi, theta = found
    # the negated phi decodes within the grid's reach of the target's own: the negated Delta is what the checks see
    return BadRound(
        "phi = -(the target's phi), Delta = -(its phi - theta): same norms, opposite direction",
        [-p for p in phi],
        [-(p - t) for p, t in zip(phi, theta)],
    )


async def gossip_accept_then_silence(ctx, res: Result, found: GossipMaterial) -> None:
    _names, phi, _theta = found
    s = ctx.settings
    ident = await ctx.member("silent", res.nursery, stage=ctx.stage)
    total = sum(p.numel() for p in phi)
    wire, reply = await gossip_request(ctx, res, ident, request_meta(len(phi), total))
    if wire is None:
        res.set(
            INCONCLUSIVE if reply is None else judge_any(reply)[0],
            "never ACCEPTed" if reply is None else judge_any(reply)[1],
        )
        return
    accepted_at = time.monotonic()
    res.sent.append(f"GOSSIP_REQUEST ({len(phi)} tensors), then nothing for up to {s.silence_hold:.0f}s")
    out: dict = {}
    done = trio.Event()
    probes: list[tuple[float, str]] = []
    prober = await ctx.member("honest-looking", res.nursery, stage=ctx.stage)  # a stranger would be turned away anyway
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, wire, s.silence_hold, out, done)
            while not done.is_set() and time.monotonic() - accepted_at < s.silence_hold:
                with trio.move_on_after(2.0):
                    await done.wait()
                if done.is_set():
                    break
                # an honest partner asking for a round now
                probe_wire = await ctx.open("gossip", prober)
                try:
                    await probe_wire.send_message(
                        ctx.message(MessageKind.GOSSIP_REQUEST, request_meta(len(phi), total))
                    )
                    answer = await probe_wire.read_message(s.reply_timeout)
                finally:
                    with trio.move_on_after(2.0):
                        await probe_wire.reset()  # an ACCEPTed probe is dropped at once
                probes.append(
                    (round(time.monotonic() - accepted_at, 1), answer.kind if answer.is_message else answer.status)
                )
            nursery.cancel_scope.cancel()
    finally:
        with trio.move_on_after(2.0):
            await wire.reset()
    ended = out.get("ended_at")
    held = (ended if ended is not None else time.monotonic()) - accepted_at
    busy = [t for t, kind in probes if kind == "busy"]
    res.measurements.update(
        held_seconds=round(held, 1), target_closed=ended is not None, probes=probes, target_chunks=out.get("chunks")
    )
    if ended is not None and held < s.silence_grace:
        res.set(REJECTED, f"the node dropped the silent partner after {held:.1f}s")
    elif busy and held >= s.silence_grace:
        closed = (
            f"closed it after {held:.1f}s" if ended is not None else f"still held it after {held:.1f}s (we gave up)"
        )
        res.set(
            ACCEPTED,
            f"a silent stranger held the gossip slot: {len(busy)} of {len(probes)} honest-looking "
            f"requests got BUSY (at {busy[:6]} s); the node {closed}",
        )
    elif ended is not None:
        res.set(REJECTED, f"the node dropped the silent partner after {held:.1f}s; probes {probes}")
    else:
        res.set(REJECTED, f"slot not held: probes {probes}")


# ------------------------------------------------------------------------------------------------
# Resources


async def request_flood(ctx, res: Result) -> None:
    s = ctx.settings
    ident = await case_identity(ctx, res)
    statuses: dict[str, int] = {}
    reasons: dict[str, int] = {}
    latencies: list[float] = []
    limiter = trio.Semaphore(s.flood_concurrency)
    sink = _Sink()
    start = time.monotonic()

    async def one() -> None:
        async with limiter:
            t0 = time.monotonic()
            reply = await exchange(ctx, sink, "flood", "forward", garbage_frame(), ident=ident)
            latencies.append(time.monotonic() - t0)
            key = reply.kind if reply.is_message else reply.status
            statuses[key] = statuses.get(key, 0) + 1
            count_reason(reasons, reply)

    async with trio.open_nursery() as nursery:
        for _ in range(s.flood_requests):
            nursery.start_soon(one)
    elapsed = time.monotonic() - start
    latencies.sort()
    q = lambda f: round(latencies[min(len(latencies) - 1, int(f * len(latencies)))], 3) if latencies else None  # noqa: E731
    res.sent.append(f"{s.flood_requests} malformed frames, {s.flood_concurrency} at a time")
    res.measurements.update(
        replies=statuses,
        reasons=reasons,
        seconds=round(elapsed, 2),
        rate=round(s.flood_requests / elapsed, 1),
        p50=q(0.5),
        p95=q(0.95),
        max=q(1.0),
    )
    alive = await probe(ctx, res, "after flood", fresh=True)
    res.measurements["responsive_after"] = alive
    bad = {k: v for k, v in statuses.items() if k not in ("error", "eof", "reset", "refused", "busy")}
    if statuses.get("timeout"):
        res.set(
            HANG, f"{statuses['timeout']} of {s.flood_requests} got nothing within {s.reply_timeout:.0f}s; {statuses}"
        )
    elif bad:
        res.set(ACCEPTED, f"unexpected replies {bad}")
    elif not alive:
        res.set(ACCEPTED, f"every request answered ({statuses}) but the node stopped serving afterwards")
    else:
        res.set(
            REJECTED, f"all {s.flood_requests} rejected ({statuses}) in {elapsed:.1f}s, p95 {q(0.95)}s; still serving"
        )


async def slow_senders(ctx, res: Result) -> None:
    s = ctx.settings
    data = garbage_frame()
    results: list[str] = []
    forever: list[str] = []
    probes: list[bool] = []
    reasons: dict[str, int] = {}

    async def drip(ident) -> None:
        try:
            wire = await ctx.open("forward", ident)
        except Exception as e:
            results.append(f"refused {type(e).__name__}")
            return
        try:
            for i in range(len(data)):
                await wire.send(data[i : i + 1])
                await trio.sleep(s.slow_byte_interval)
            reply = await wire.read_message(s.reply_timeout)
            results.append(reply.kind if reply.is_message else reply.status)
            count_reason(reasons, reply)
        except Exception as e:
            results.append(f"write failed {type(e).__name__}")
        finally:
            with trio.move_on_after(2.0):
                await wire.reset()

    async def drip_forever(ident) -> None:
        wire = await ctx.open("forward", ident)
        start = time.monotonic()
        try:
            await wire.send(HEADER.pack(1 << 20))
            out: dict = {}
            done = trio.Event()

            async def watch() -> None:
                out["reply"] = await wire.read_message(s.slow_forever_hold)
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                while not done.is_set() and time.monotonic() - start < s.slow_forever_hold:
                    with contextlib_suppress():
                        await wire.send(b"\x00")
                    with trio.move_on_after(1.0):
                        await done.wait()
                nursery.cancel_scope.cancel()
            reply = out.get("reply")
            forever.append(
                f"{reply.kind if reply.is_message else reply.status} after {time.monotonic() - start:.0f}s"
                if reply is not None and reply.status != "timeout"
                else f"still open after {time.monotonic() - start:.0f}s"
            )
        finally:
            with trio.move_on_after(2.0):
                await wire.reset()

    ident = await ctx.identity("slow", res.nursery)
    await prober(ctx, res)
    res.sent.append(f"{s.slow_streams} streams x {len(data)} bytes, one byte every {s.slow_byte_interval}s")
    if s.slow_forever_streams:
        res.sent.append(
            f"{s.slow_forever_streams} streams declaring 1 MiB, one byte a second for up to {s.slow_forever_hold:.0f}s"
        )
    async with trio.open_nursery() as nursery:
        for _ in range(s.slow_streams):
            nursery.start_soon(drip, ident)
        for _ in range(s.slow_forever_streams):
            nursery.start_soon(drip_forever, ident)
        await trio.sleep(len(data) * s.slow_byte_interval / 2)
        probes.append(await probe(ctx, res, "during slow senders"))
    res.measurements.update(slow_replies=results, reasons=reasons, never_finishing=forever, probes_ok=probes)
    if not all(probes):
        res.set(ACCEPTED, f"the node stopped answering others while {s.slow_streams} slow senders were connected")
    elif any(r in ("timeout",) for r in results):
        res.set(HANG, f"slow senders got no reply after completing their frame: {results}")
    elif any(f.startswith("still open") for f in forever):
        res.set(HANG, f"never-finishing senders were never cut: {forever}")
    else:
        res.set(
            REJECTED,
            f"slow frames answered {sorted(set(results))}"
            + (f"; never-finishing cut: {forever}" if forever else "")
            + "; others served meanwhile",
        )


class contextlib_suppress:
    """contextlib.suppress(Exception) spelled out (the name keeps the drip loop readable)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)


async def half_open_streams(ctx, res: Result) -> None:
    s = ctx.settings
    count = s.half_open_streams
    per = s.streams_per_identity
    wires: list = []
    failures: list[str] = []
    ended: dict[str, int] = {}
    reasons: dict[str, int] = {}
    start = time.monotonic()
    await prober(ctx, res)  # connected before the streams pile up: "an existing peer"
    idents = []
    for i in range(math.ceil(count / per)):
        try:
            idents.append(await ctx.identity(f"half-open-{i}", res.nursery))
        except Exception as e:
            failures.append(f"identity {i}: {type(e).__name__}: {e}"[:200])
    limiter = trio.Semaphore(48)

    async def open_one(ident) -> None:
        async with limiter:
            try:
                wires.append(await ctx.open("forward", ident, timeout=5.0))
            except Exception as e:
                failures.append(str(e)[:160])

    async def watch(wire, hold: float) -> None:
        reply = await wire.read_message(hold)
        if reply.status != "timeout":
            key = reply.kind if reply.is_message else reply.status
            ended[key] = ended.get(key, 0) + 1
            count_reason(reasons, reply)

    for wave in range(2):  # a second wave for what failed: a loaded node is slow to take streams
        missing = count - len(wires)
        if missing <= 0 or not idents:
            break
        if wave:
            await trio.sleep(0.5)
        async with trio.open_nursery() as nursery:
            for i in range(missing):
                nursery.start_soon(open_one, idents[i % len(idents)])
    opened_in = time.monotonic() - start
    res.sent.append(
        f"{count} idle streams over {len(idents)} peer ids (opened {len(wires)} in {opened_in:.1f}s), "
        f"held {s.half_open_hold:.0f}s"
    )
    probes: dict[str, bool] = {}
    async with trio.open_nursery() as nursery:
        for wire in wires:
            nursery.start_soon(watch, wire, s.half_open_hold + 2)
        await trio.sleep(s.half_open_hold / 2)

        async def probe_into(key: str, fresh: bool) -> None:
            probes[key] = await probe(ctx, res, key, fresh=fresh, timeout=5.0)

        async with trio.open_nursery() as probing:
            probing.start_soon(probe_into, "existing peer, during", False)
            probing.start_soon(probe_into, "new peer, during", True)
        await trio.sleep(s.half_open_hold / 2)
        emfile = log_has(ctx, res, EMFILE_MARKERS)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        for wire in wires:
            nursery.start_soon(_reset_quietly, wire)
    await trio.sleep(2.0)
    probes["new peer, after release"] = await probe(ctx, res, "new peer, after release", fresh=True)
    first_failures = sorted(set(failures))[:5]
    res.measurements.update(
        opened=len(wires),
        open_failures=len(failures),
        first_open_failures=first_failures,
        ended_by_node_during_hold=ended,
        reasons=reasons,
        probes=probes,
        log_emfile=emfile,
        open_seconds=round(opened_in, 1),
    )
    during_ok = probes["existing peer, during"] and probes["new peer, during"]
    if not during_ok or emfile:
        res.set(
            ACCEPTED,
            f"{len(wires)} idle streams exhausted the node: probes {probes}; "
            f"{('log: ' + repr(emfile[0])) if emfile else 'no EMFILE line in the log'}"[:400],
        )
    else:
        res.set(
            REJECTED,
            f"still serving with {len(wires)} idle streams ({len(failures)} refused, "
            f"{sum(ended.values())} closed by the node): probes {probes}",
        )


async def _reset_quietly(wire) -> None:
    with trio.move_on_after(2.0):
        await wire.reset()


# ------------------------------------------------------------------------------------------------
# The table: every case, in the order a run plays them

CASES: list[Case] = [
    Case(
        "random_bytes",
        "forward",
        "4 KiB of random bytes, then end of stream",
        "ERROR reply (its first 8 bytes declare an absurd frame) or a closed stream",
        frames(random_bytes, close_write=True),
        refused_by=(r"frame declares \d+ bytes > max_frame_bytes",),
    ),
    Case(
        "empty_stream",
        "forward",
        "open a stream and end it without a byte",
        "ERROR reply ('stream closed at a frame boundary') or a closed stream",
        frames(empty_stream, close_write=True),
        refused_by=("stream closed at a frame boundary",),
    ),
    Case(
        "truncated_header",
        "backward",
        "3 of the 8 length bytes, then end of stream",
        "ERROR reply ('inside the length header') or a closed stream",
        frames(truncated_header, close_write=True),
        refused_by=("inside the length header",),
    ),
    Case(
        "truncated_frame",
        "forward",
        "a frame declaring 4096 bytes with 100 of them, then end of stream",
        "ERROR reply ('closed mid-frame') or a closed stream",
        frames(truncated_frame, close_write=True),
        refused_by=(r"closed mid-frame \(100 of 4096 bytes\)",),
    ),
    Case(
        "huge_length_prefix",
        "forward",
        "a length prefix of 8 GiB followed by 1 KiB, stream left open",
        "an immediate ERROR (declared length over max_frame_bytes), no read of the payload, no allocation",
        frames(huge_length_prefix),
        refused_by=(
            "frame declares 8589934592 bytes > max_frame_bytes",
            "frame declares 18446744073709551615 bytes > max_frame_bytes",
        ),
    ),
    Case(
        "garbage_msgpack",
        "forward",
        "a well-formed frame whose payload is the current version then invalid msgpack",
        "ERROR ('malformed msgpack')",
        frames(garbage_msgpack),
        refused_by=("malformed msgpack",),
    ),
    Case(
        "wrong_msgpack_types",
        "forward",
        "envelopes whose fields have the wrong msgpack types",
        "ERROR for each (header/meta/tensor types are validated)",
        frames(wrong_msgpack_types, repetitions=1),
        refused_by=(
            "envelope must be a map",
            "sender_stage must be an int",
            "request_id must be an unsigned",
            "meta must be a map",
            "tensors must be a map",
            "'microbatch_id' must be int",
            "'hop' must be int",
            "'path' must be list",
            "int is not allowed for map key",
        ),
    ),
    Case(
        "unknown_kind",
        "forward",
        "a valid envelope with kind 'detonate'",
        "ERROR ('unknown message kind')",
        frames(unknown_kind),
        refused_by=("unknown message kind 'detonate'",),
    ),
    Case(
        "unknown_version",
        "forward",
        "a valid FORWARD under protocol versions 99 and 2**40",
        "ERROR ('protocol version ... not supported')",
        frames(unknown_version, repetitions=1),
        refused_by=("protocol version 99 not supported", "protocol version 1099511627776 not supported"),
    ),
    Case(
        "wrong_swarm_id",
        "forward",
        "a valid FORWARD naming another swarm; and a stream to another swarm's protocol",
        "ERROR ('message for swarm ...'), and the other swarm's protocol refused at negotiation",
        wrong_swarm_id,
        refused_by=("message for swarm 'some-other-swarm'", "protocol swarm#1 refused StreamFailure"),
    ),
    Case(
        "tensor_byte_count",
        "forward",
        "FORWARD whose hidden declares [1,T,H] float32 but carries 100 bytes",
        "ERROR ('tensor data has 100 bytes ...')",
        frames(tensor_byte_count),
        refused_by=("tensor data has 100 bytes",),
    ),
    Case(
        "tensor_bad_dtype",
        "forward",
        "FORWARD whose hidden has dtype 'complex128', and one with codec 'zip'",
        "ERROR ('unsupported tensor dtype' / 'unknown tensor codec')",
        frames(tensor_bad_dtype, repetitions=1),
        refused_by=("unsupported tensor dtype 'complex128'", "unknown tensor codec 'zip'"),
    ),
    Case(
        "tensor_dtype_disagrees",
        "forward",
        "FORWARD whose hidden says float16 but carries float32 bytes",
        "ERROR (byte count does not match shape x itemsize)",
        frames(tensor_dtype_disagrees),
        refused_by=(r"tensor data has \d+ bytes, shape \[[\d, ]+\] with codec 'none' needs",),
    ),
    Case(
        "tensor_int_hidden",
        "forward",
        "FORWARD whose hidden is a well-formed int64 tensor",
        "rejected: ERROR, or ACK then an ABORT notice ('expected a floating-point tensor')",
        member_forwards(tensor_int_hidden),
        refused_by=("expected a floating-point tensor, got torch.int64",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "tensor_shape_disagrees",
        "forward",
        "FORWARD whose hidden is [1,T,H+1] and one of [1,T] (both well-formed)",
        "rejected: ERROR, or ACK then an ABORT notice (hidden size / dims)",
        member_forwards(tensor_shape_disagrees),
        refused_by=(r"hidden size \d+ != \d+", r"expected \[batch, seq, hidden\]"),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "absurd_shape",
        "forward",
        "FORWARD whose hidden declares shape [2**40, 2**40, 64] (and [2**62]) with 16 bytes",
        "ERROR before any allocation ('needs ... bytes > max_tensor_bytes')",
        frames(absurd_shape, repetitions=1),
        refused_by=("bytes > max_tensor_bytes",),
    ),
    Case(
        "absurd_dims",
        "forward",
        "FORWARD whose hidden has 64 dims of size 1, and one with a negative dim",
        "ERROR ('dims > max_tensor_dims' / 'non-negative ints')",
        frames(absurd_dims, repetitions=1),
        refused_by=("dims > max_tensor_dims", "non-negative"),
    ),
    Case(
        "nan_activations",
        "forward",
        "FORWARD whose hidden holds NaN, and one holding +Inf",
        "rejected: ERROR, or ACK then an ABORT notice ('contains NaN or infinite values')",
        member_forwards(nan_activations),
        refused_by=("contains NaN or infinite values",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "forward_bad_path",
        "forward",
        "FORWARD whose path does not end with the sender, one whose origin is not the path's first peer, and one "
        "with an invalid order",
        "ERROR ('inconsistent hop' / 'bad stage order')",
        forward_bad_path,
        refused_by=("inconsistent hop", "bad stage order"),
    ),
    Case(
        "stranger_forward",
        "forward",
        "a valid FORWARD from a peer that is in no DHT record and on no path",
        "refused: the node computes only for microbatches of peers of the swarm",
        stranger_forward,
        refused_by=("not a member of this swarm",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "forward_flood",
        "forward",
        "many valid FORWARDs from one stranger, 8 at a time",
        "refused (as stranger_forward); at least BUSY beyond the queue",
        forward_flood,
        refused_by=("not a member of this swarm",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "nan_gradient",
        "backward",
        "after our own FORWARD was computed, a BACKWARD whose grad holds NaN",
        "rejected: ERROR, or ACK then an ABORT notice ('contains NaN or infinite values'); no step poisoned",
        nan_gradient,
        refused_by=("contains NaN or infinite values",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "backward_never_sent",
        "backward",
        "a BACKWARD for a microbatch we never forwarded there",
        "rejected: ERROR ('unknown microbatch') before any work",
        backward_never_sent,
        refused_by=("unknown microbatch",),
    ),
    Case(
        "backward_huge_gradient",
        "backward",
        "after our own FORWARD was computed, a BACKWARD of 3e38 per element (finite in fp32)",
        "rejected, or at most this microbatch dropped: the honest gradients accumulated for the step survive",
        backward_huge_gradient,
        refused_by=("norm is not finite",),
        refused_by_stage0=("unknown microbatch",),
    ),
    Case(
        "abort_list_id",
        "abort",
        "an ABORT (ERROR on the abort service) whose microbatch_id is a list",
        "ERROR ('bad request') or ACK; no exception in the handler",
        frames(abort_list_id),
        refused_by=("'microbatch_id' must be an integer",),
    ),
    Case(
        "backward_names_a_victim",
        "backward",
        "a BACKWARD whose path names another peer (a victim we also run) as the microbatch's origin",
        "no notice to the victim (no reflection); the sender gets ERROR ('unknown microbatch'): never computed here",
        backward_names_a_victim,
        refused_by=(r'"to_victim": 0', "unknown microbatch"),
    ),
    Case(
        "abort_unrelated",
        "abort",
        "an ABORT for a microbatch the sender is on no path of",
        "ERROR (the sender is not on the microbatch's path / unknown microbatch)",
        abort_unrelated,
        refused_by=("unknown microbatch",),
    ),
    Case(
        "state_wrong_stage",
        "state",
        "a STATE_REQUEST for a stage the peer does not serve",
        "ERROR ('this peer serves stage ...')",
        frames(state_wrong_stage, repetitions=1),
        refused_by=(r"cannot serve stage \d+ part 'stage'",),
    ),
    Case(
        "state_bad_request",
        "state",
        "a STATE_REQUEST for an unknown part, and a FORWARD sent to the state service",
        "ERROR for both",
        frames(state_bad_request, repetitions=1),
        refused_by=(r"cannot serve stage \d+ part '../../private_key'", "expected a state request, got forward"),
    ),
    Case(
        "state_download_loop",
        "state",
        "one identity asking for the target's whole stage state again and again (reset after each header)",
        "served a few times, then ERROR ('answer budget spent ...') before any copy is taken",
        state_download_loop,
        refused_by=(r"answer budget spent \(\d+ per identity",),
    ),
    Case(
        "gossip_from_stranger",
        "gossip",
        "a well-formed GOSSIP_REQUEST from a peer with no record in the swarm",
        "BUSY ('gossip partners are the stage's members: no record of you at stage N here')",
        with_gossip_material(gossip_from_stranger),
        refused_by=(r"gossip partners are the stage's members: no record of you at stage \d+",),
    ),
    Case(
        "gossip_wrong_stage",
        "gossip",
        "a GOSSIP_REQUEST claiming another stage, and one with wrong tensor counts",
        "ERROR ('this peer serves stage ...' / 'num_tensors ... != ...')",
        gossip_wrong_stage,
        refused_by=(r"this peer serves stage \d+, not \d+", r"num_tensors 100000 != \d+"),
    ),
    Case(
        "gossip_chunk_shape",
        "gossip",
        "an accepted round whose first chunk has the wrong shape (2-D, too long)",
        "the stream closed or an ERROR; no ban of anyone honest, the slot freed",
        with_gossip_material(gossip_chunk_shape),
        refused_by=(r"as responder: ProtocolError\('chunk 0 has \d+ torch.float32 elements \(2-D\)",),
    ),
    Case(
        "gossip_nan_weights",
        "gossip",
        "an accepted round whose Delta holds a NaN (phi's residues decode to finite values whatever they hold)",
        "GOSSIP_DONE accept=False ('holds NaN or Inf'), the sender banned",
        bad_round("gossip-nan", gossip_nan_weights),
        refused_by=(r"gossip_done phi: tensor \d+ holds NaN or Inf",),
    ),
    Case(
        "gossip_huge_weights",
        "gossip",
        "an accepted round whose Delta is the target's x 1e6 (its grid steps too, so phi may decode far off)",
        "GOSSIP_DONE accept=False from a plausibility check (the norm, or the cosine if phi decodes far off)",
        bad_round("gossip-huge", gossip_huge_weights),
        refused_by=(r"gossip_done (phi|delta): ",),
    ),
    Case(
        "gossip_negated_weights",
        "gossip",
        "an accepted round whose phi and Delta are the target's own, negated",
        "GOSSIP_DONE accept=False: a partner pointing the opposite way is not an honest replica",
        bad_round("gossip-negated", gossip_negated_weights),
        refused_by=(r"gossip_done (phi|delta): ",),
    ),
    Case(
        "gossip_accept_then_silence",
        "gossip",
        "a valid GOSSIP_REQUEST, then silence after the target's ACCEPT (its chunks are read, none sent)",
        "the node drops a silent partner quickly; honest partners are not kept BUSY for the round timeout",
        with_gossip_material(gossip_accept_then_silence),
        refused_by=("went silent mid-exchange",),
        timeout=180,
    ),
    Case(
        "request_flood",
        "forward",
        "hundreds of malformed requests, each on its own stream, many at once",
        "every one answered ERROR (or refused) within the deadline; the node keeps serving",
        request_flood,
        refused_by=("malformed msgpack",),
        timeout=300,
    ),
    Case(
        "slow_senders",
        "forward",
        "streams that drip a (malformed) frame one byte at a time",
        "each answered ERROR once complete (or cut at the read timeout); other requests served meanwhile",
        slow_senders,
        refused_by=("malformed msgpack",),
        timeout=150,
    ),
    Case(
        "half_open_streams",
        "forward",
        "many streams opened and left idle (no byte sent), spread over several peer ids",
        "refused beyond a per-peer limit or closed early; the node keeps serving others",
        half_open_streams,
        refused_by=("too many (open streams|streams from this peer)",),
        timeout=240,
    ),
]
