"""The request contracts of this node's pipeline services (node/p2p/request_contract.py): the
kinds each takes and the meta its handler reads beyond the kind's schema (protocol/messages.py).
The transport checks them before a handler runs, so the handlers in node/pipeline/traffic.py and
node/pipeline/check_server.py read only what was checked."""

from __future__ import annotations

from node.p2p.request_contract import Count, RequestContract, Text, Token
from protocol import PURPOSE_KEY, MessageKind

# a microbatch's token (secrets.token_hex(8) in node/pipeline/in_flight.py): only peers on its path
# know it; absent from an older peer's hops, which the handlers then treat as no token
MICROBATCH_TOKEN = Token(max_chars=64)

FORWARD_CONTRACT = RequestContract(
    frozenset({MessageKind.FORWARD}), optional={"token": MICROBATCH_TOKEN, PURPOSE_KEY: Text(max_chars=32)}
)
BACKWARD_CONTRACT = RequestContract(frozenset({MessageKind.BACKWARD}), optional={"token": MICROBATCH_TOKEN})
# an abort notice is an ERROR naming one of the origin's microbatches (HopSender.notify_abort)
ABORT_CONTRACT = RequestContract(
    frozenset({MessageKind.ERROR}), required={"microbatch_id": Count(), "token": MICROBATCH_TOKEN}
)
CHECK_CONTRACT = RequestContract(
    frozenset({MessageKind.CHECK, MessageKind.AUDIT, MessageKind.OPEN}), optional={"token": MICROBATCH_TOKEN}
)
