"""What a FORWARD or a BACKWARD says about the microbatch it carries, typed: its header.

On the wire a header is the message's meta (protocol/messages.py, KIND_SCHEMAS: the keys each kind
requires; node/pipeline/contracts.py: the optional token and purpose). A microbatch leaves its
stage-0 origin as a FORWARD at hop 1 with a path of one peer; every block stage passes its output on
as the next hop (`ForwardHeader.next_hop`), the last back to the origin, which sends the gradient
back along the same path as a BACKWARD (`BackwardHeader.next_hop`).

A hop passes on as it came, as when every peer copied the meta it received: what a peer of this
version does not read (a newer peer's keys, the transport's posted flag) is kept in `passed_on` and
sent on after the keys read here, and an optional key its sender left out stays out. So
`from_meta(meta).to_meta() == meta`, and a header built here gives the keys in the order our origins
send them: a hop's bytes are those of a peer that copies the meta it received and changes two keys.

A microbatch's purpose is the FORWARD's optional `purpose`: absent means training (what every older
peer sends). A stage-0 peer marks an evaluation microbatch `eval` (node/pipeline/validation.py). It
then takes the normal stage order (CheckFree+'s swaps are a training device), and every peer on its
path runs its stage under `torch.no_grad()`: nothing is stored, no gradient flows back, no
optimizer, throughput or gradient-gate state changes. The origin computes the loss on the returned
hidden states and the microbatch ends there (no BACKWARD). The passes themselves are the stage
floor's (node/stage/forward_only.py), run on the stage worker's compute thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from protocol.errors import ProtocolError
from protocol.messages import MessageKind, MetaValue

PURPOSE_KEY = "purpose"  # FORWARD meta key; absent means training (what every older peer sends)
TOKEN_KEY = "token"  # FORWARD and BACKWARD meta key; absent from an older peer's hops


class MicrobatchPurpose(StrEnum):
    """Why a microbatch travels: to train (forward, then backward) or to evaluate (forward only)."""

    TRAIN = "train"
    EVAL = "eval"


def purpose_of(meta: Mapping[str, Any]) -> MicrobatchPurpose:
    """The purpose a FORWARD message states; ProtocolError for anything but a known value."""
    raw = meta.get(PURPOSE_KEY, MicrobatchPurpose.TRAIN.value)
    try:
        return MicrobatchPurpose(raw)
    except ValueError:
        raise ProtocolError(f"unknown microbatch purpose {str(raw)[:32]!r}") from None


PassedOn = tuple[tuple[str, MetaValue], ...]

_FORWARD_KEYS = frozenset({"microbatch_id", "origin", "path", "order", "hop", TOKEN_KEY, PURPOSE_KEY})
_BACKWARD_KEYS = frozenset({"microbatch_id", "path", "hop", TOKEN_KEY})


def _passed_on(meta: Mapping[str, Any], read_here: frozenset[str]) -> PassedOn:
    return tuple((key, value) for key, value in meta.items() if key not in read_here)


@dataclass(frozen=True, slots=True)
class ForwardHeader:
    """A FORWARD's header: the microbatch, its origin, the peers it visited and its stage order."""

    KIND: ClassVar[MessageKind] = MessageKind.FORWARD

    microbatch_id: int
    origin: str  # the stage-0 peer that started it and gets its output back
    path: tuple[str, ...]  # the peers it visited, the origin first and the sender last
    order: tuple[int, ...]  # the block stages it visits, in turn (CheckFree+ swaps some)
    hop: int  # 1 leaving the origin, len(order) + 1 coming back to it
    token: str = ""  # the attempt's secret, shared only along its path; "" matches nothing
    purpose: MicrobatchPurpose | None = None  # None: none stated, which means training
    # False: an older peer's hop, which came without a token and passes on without one; the origin
    # refuses such a hop as malformed, where a wrong or empty token is only an unknown microbatch
    carries_token: bool = True
    passed_on: PassedOn = ()

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ForwardHeader:
        """The header of a FORWARD whose meta already passed its kind's schema and its service's
        contract: this only converts. The one value it reads that neither checks is the purpose's
        meaning, and an unknown purpose is a ProtocolError (`purpose_of`)."""
        return cls(
            meta["microbatch_id"],
            meta["origin"],
            tuple(meta["path"]),
            tuple(meta["order"]),
            meta["hop"],
            meta.get(TOKEN_KEY, ""),
            purpose_of(meta) if PURPOSE_KEY in meta else None,
            TOKEN_KEY in meta,
            _passed_on(meta, _FORWARD_KEYS),
        )

    def to_meta(self) -> dict[str, MetaValue]:
        """The meta this header travels as: the keys in the order our origins send them, then what
        it passes on."""
        meta: dict[str, MetaValue] = {
            "microbatch_id": self.microbatch_id,
            "origin": self.origin,
            "path": list(self.path),
            "order": list(self.order),
            "hop": self.hop,
        }
        if self.carries_token:
            meta[TOKEN_KEY] = self.token
        if self.purpose is not None:
            meta[PURPOSE_KEY] = self.purpose.value
        meta.update(self.passed_on)
        return meta

    @property
    def trains(self) -> bool:
        """Whether the microbatch is a training one, with a backward to come (no purpose stated is training)."""
        return self.purpose is None or self.purpose is MicrobatchPurpose.TRAIN

    def next_hop(self, peer_id: str) -> ForwardHeader:
        """The header `peer_id`, which computed this hop, sends its output on with (built field by
        field: dataclasses.replace inspects the class on every call, and every hop makes one)."""
        return ForwardHeader(
            self.microbatch_id,
            self.origin,
            (*self.path, peer_id),
            self.order,
            self.hop + 1,
            self.token,
            self.purpose,
            self.carries_token,
            self.passed_on,
        )


@dataclass(frozen=True, slots=True)
class BackwardHeader:
    """A BACKWARD's header: the microbatch and the forward's path, which the gradient retraces."""

    KIND: ClassVar[MessageKind] = MessageKind.BACKWARD

    microbatch_id: int
    path: tuple[str, ...]  # the forward's path: the origin first, the last block stage's peer last
    hop: int  # the index in `path` of the peer it is sent to: len(path) - 1 from the origin, 0 back at it
    token: str = ""  # the attempt's secret, as in its forward
    carries_token: bool = True  # as ForwardHeader.carries_token
    passed_on: PassedOn = ()

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> BackwardHeader:
        """The header of a BACKWARD whose meta already passed its kind's schema and its service's
        contract: this only converts, and checks nothing."""
        return cls(
            meta["microbatch_id"],
            tuple(meta["path"]),
            meta["hop"],
            meta.get(TOKEN_KEY, ""),
            TOKEN_KEY in meta,
            _passed_on(meta, _BACKWARD_KEYS),
        )

    def to_meta(self) -> dict[str, MetaValue]:
        """The meta this header travels as: the keys in the order our origins send them, then what
        it passes on."""
        meta: dict[str, MetaValue] = {"microbatch_id": self.microbatch_id, "path": list(self.path), "hop": self.hop}
        if self.carries_token:
            meta[TOKEN_KEY] = self.token
        meta.update(self.passed_on)
        return meta

    @property
    def origin(self) -> str:
        """The stage-0 peer whose microbatch this is: the path's first (the path must not be empty)."""
        return self.path[0]

    @property
    def sender(self) -> str:
        """The peer that should have sent this hop: the next one on the path, or the origin, which
        starts the backward (meaningful once `hop` is known to index the path)."""
        return self.path[self.hop + 1] if self.hop + 1 < len(self.path) else self.path[0]

    def next_hop(self) -> BackwardHeader:
        """The header the gradient goes on with, to the peer before this one on the path (built as
        ForwardHeader.next_hop's is)."""
        return BackwardHeader(
            self.microbatch_id, self.path, self.hop - 1, self.token, self.carries_token, self.passed_on
        )


MicrobatchHeader = ForwardHeader | BackwardHeader
