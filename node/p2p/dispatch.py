"""The one place a request meets its handler, on a stream or a channel alike (node/p2p/transport.py).

A service's contract (node/p2p/request_contract.py: the kinds it takes, the meta its handler reads)
is checked before its handler runs, and anything the handler raises, a ProtocolError or not,
becomes one ERROR reply and a strike against the sender. A failure that is not a ProtocolError (an
input no check foresaw, or a bug of ours) is logged on one line without a traceback: a stranger
must not be able to fill the log, and one that keeps trying is banned by its strikes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from dht.records import short_peer_id
from node.p2p.peer_conduct import PeerConduct
from node.p2p.request_contract import RequestContract
from protocol import Message, ProtocolError

logger = logging.getLogger(__name__)

# a request's handler answers at once (a Message) or later (an awaitable of one): a pipeline hop's
# handler only checks and queues, and answering it at once spares a task per hop (node/p2p/channels.py)
RequestHandler = Callable[[str, Message], Message | Awaitable[Message]]


class DispatchOwner(Protocol):
    """What the dispatcher needs of the transport that owns it."""

    conduct: PeerConduct

    def error(self, reason: str, request_id: int = 0) -> Message: ...


class RequestDispatcher:
    """The request services of one transport, each a handler and its contract."""

    def __init__(self, owner: DispatchOwner) -> None:
        self.owner = owner
        self._served: dict[str, tuple[RequestHandler, RequestContract]] = {}

    def serve(self, service: str, handler: RequestHandler, contract: RequestContract) -> None:
        self._served[service] = (handler, contract)

    @property
    def services(self) -> tuple[str, ...]:
        """The services served, in the order registered."""
        return tuple(self._served)

    def answer(self, sender: str, service: str, request: Message) -> Message | Awaitable[Message]:
        """The reply of `service`'s handler to `request`, now or as an awaitable, once `request` met
        the service's contract; never raises: whatever goes wrong is an ERROR reply and a strike."""
        handler, contract = self._served[service]
        try:
            contract.check(request)
            reply = handler(sender, request)
        except Exception as e:
            return self._failed(sender, service, request, e)
        if isinstance(reply, Message):
            return reply
        return self._answer_later(sender, service, request, reply)

    async def _answer_later(self, sender: str, service: str, request: Message, reply: Awaitable[Message]) -> Message:
        try:
            return await reply
        except Exception as e:
            return self._failed(sender, service, request, e)

    def _failed(self, sender: str, service: str, request: Message, error: Exception) -> Message:
        if isinstance(error, ProtocolError):
            reason = str(error)
        else:
            reason = f"request failed: {type(error).__name__}"
            logger.warning(f"{service} handler failed on a request from {short_peer_id(sender)}: {error!r:.300}")
        self.owner.conduct.strike(sender, f"{service}: {reason}")
        return self.owner.error(reason, request.request_id)
