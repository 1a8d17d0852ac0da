#!/usr/bin/env python
"""Keep DHT records for identities that are not nodes: makes the hostile peer a *member*.

    python tests/helpers/member_records.py --initial-peers MADDR --swarm-id ID \\
        --ttl 5 --period 2 --max-seconds 600 STAGE:KEY_FILE [STAGE:KEY_FILE ...]

A node admits FORWARDs only from members of its swarm (a peer with a record in its view), so a
stranger's tensors stop at that gate, BUSY, and never reach the checks the hostile cases are named
for. The hostile peer (tests/helpers/hostile_peer.py, py-libp2p, which cannot share a process with
hivemind) connects with these RSA keys; this process signs a `joining` record for each of them
exactly as a joining node does (dht/signing.py `seal`, the key's own signature) and re-stores them
all every `--period` seconds, in one DHT store per stage, through a client DHT node of its own.
Each key's record claims the stage written before it (`1:member0.key`): a gossip partner must hold
a record of the responder's own stage. A joining
record is never routed to, so honest traffic does not reach the hostile peer; it is what a stranger
can publish for free (docs/security.md, "Microbatches").

Prints `MEMBERS ANNOUNCED <count>` once every record was stored, then keeps them fresh until it is
killed or `--max-seconds` pass.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hivemind.utils import get_dht_time  # noqa: E402

from dht.identity_keys import Identity  # noqa: E402
from dht.records import PeerRecord, PeerState, stage_key  # noqa: E402
from dht.signing import seal  # noqa: E402
from node.p2p.network import start_network  # noqa: E402


async def keep_announced(args: argparse.Namespace) -> None:
    by_stage: dict[int, list[Identity]] = {}
    for spec in args.keys:
        stage, _, path = spec.partition(":")
        by_stage.setdefault(int(stage), []).append(Identity.from_file(path))
    network = await start_network(initial_peers=args.initial_peers, client_mode=True)
    deadline = time.monotonic() + args.max_seconds
    first = True
    try:
        while time.monotonic() < deadline:
            expiration = get_dht_time() + args.ttl
            complete = True
            for stage, members in by_stage.items():
                key = stage_key(args.swarm_id, stage)
                envelopes = []
                for member in members:
                    record = PeerRecord(peer_id=member.peer_id, stage=stage, state=PeerState.JOINING)
                    record.updated = get_dht_time()
                    envelopes.append(seal(member, key, member.peer_id, record.to_wire(), expiration))
                # one traversal and one store request per DHT node for a stage's records: the nodes'
                # DHT guard budgets each sender's requests (node/p2p/dht_guard.py), and one store per
                # record per period would outrun it and have the records refused
                stored = await network.dht.store_many(
                    [key] * len(members), envelopes, expiration, subkeys=[m.peer_id for m in members]
                )
                complete = complete and len(stored) == len(members) and all(stored.values())
            if first and complete:
                print(f"MEMBERS ANNOUNCED {sum(map(len, by_stage.values()))}", flush=True)
                first = False
            await asyncio.sleep(args.period)
    finally:
        await network.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--swarm-id", required=True)
    parser.add_argument("--ttl", type=float, default=5.0, help="each record's lifetime: the swarm's heartbeat TTL")
    parser.add_argument("--period", type=float, default=2.0, help="seconds between re-stores, well under --ttl")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument(
        "keys",
        nargs="+",
        help="STAGE:FILE, a libp2p RSA private key file (dht.identity_keys.Identity.save) and its stage",
    )
    asyncio.run(keep_announced(parser.parse_args()))


if __name__ == "__main__":
    main()
