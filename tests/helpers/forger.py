"""A stranger who knows the bootstrap multiaddr and tries to take the swarm over through the DHT.

Runs in its own process with plain hivemind (a DHT server node *without* pipeswarm's validator, so
it stores whatever it likes locally and offers it to everyone), joins through the bootstrap
multiaddr and, every `--period` seconds for `--rounds` rounds, stores the forgeries of the issue
"An open swarm that strangers cannot take over", each in the variants a signature scheme has to
survive:

    pin        the victim's record re-stored as `leaving`, one hour ahead: unsigned; the victim's
               genuine envelope with the state edited; signed by the forger under the victim's
               subkey; the victim's genuine envelope replayed one hour ahead; and a plain value
               over the whole stage key (which would replace every peer's record in hivemind)
    phantom    an `online` stage-1 peer with a made-up id and huge throughput: unsigned, and
               signed by the forger
    event      an `unrecoverable` event in the victim's name: unsigned, and signed by the forger
    config     the swarm config with num_stages = 5 (hash recomputed): unsigned under the swarm id,
               the founder's envelope with the body edited, signed by the forger under the
               founder's slot, and (the control) signed by the forger under its own slot, which
               honest nodes must accept and joiners must ignore
    bigvalue   (finding 10; only when asked for with --only) a whole-dictionary store of a 3.9 MB
               and of a 450 KB value of tiny items, sent straight to every DHT node the forger
               knows: hivemind decodes such a value before any validator sees it

Stores use `exclude_self=True`, so "accepted" means an honest DHT node took it. Prints
`FORGER READY` after the first round and `FORGER DONE <json>` (per forgery: attempts, accepted)
when it stops: after `--rounds` rounds, `--max-seconds`, or SIGTERM. The test ends it by pid in
any case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from dht.identity_keys import Identity
from dht.records import SWARMS_KEY, ConfigRecord, EventKind, PeerRecord, PeerState, SwarmEvent, events_key, stage_key
from dht.signing import ENVELOPE_VERSION, _signed_bytes, config_subkey, kind_of_key, seal
from node.config import SwarmConfig

FAR = 3600.0  # finding 1: one hour ahead
PHANTOM_ID = "QmPhantomPeerWithAMadeUpIdAndHugeThroughput1234"
CONTROL = "config_forger_own_slot"  # the one forgery honest nodes must accept (it is validly signed)


def edited(envelope: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A genuine envelope whose body was edited after signing."""
    body = msgpack.unpackb(envelope["body"], raw=False)
    body.update(changes)
    return {**envelope, "body": msgpack.packb(body, use_bin_type=True)}


def signed_by(identity: Identity, key: str, subkey: str, body: dict[str, Any], expiration: float) -> dict[str, Any]:
    """A correct signature by `identity` over any record, including one that claims to be from
    someone else (`seal` refuses to make those)."""
    body_bytes = msgpack.packb(body, use_bin_type=True)
    signs_expiration = kind_of_key(key) != "config"
    signature = identity.sign(_signed_bytes(key, subkey, body_bytes, expiration if signs_expiration else None))
    return {"v": ENVELOPE_VERSION, "key": key, "body": body_bytes, "pk": identity.public_key, "sig": signature}


def forged_config(founder_config: dict[str, Any]) -> dict[str, Any]:
    config = dict(founder_config["config"])
    config["num_stages"] = 5
    record = ConfigRecord(
        founder_config["protocol_version"],
        SwarmConfig.from_dict(config).config_hash(),
        config,
        founder_config.get("software_version", ""),
    )
    return record.to_wire()


class Forger:
    def __init__(self, dht: DHTNode, swarm_id: str, victim: str, founder: str, only: set[str] | None):
        self.dht, self.swarm_id, self.victim, self.founder = dht, swarm_id, victim, founder
        self.only = only
        self.me = Identity.generate()  # the forger's own key: it can sign, just not as anyone else
        self.attempts: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self._big_values: dict[str, DictionaryDHTValue] = {}

    async def store(self, name: str, key: str, value: Any, expiration: float, subkey: Any = None) -> None:
        if self.only is not None and name.split("_")[0] not in self.only:
            return
        self.attempts[name] = self.attempts.get(name, 0) + 1
        try:
            ok = await self.dht.store(key, value, expiration, subkey=subkey, exclude_self=True)
        except Exception as e:  # a refusal may come back as an error: that is a rejection too
            print(f"store {name} raised {e!r}", file=sys.stderr, flush=True)
            ok = False
        self.accepted[name] = self.accepted.get(name, 0) + int(bool(ok))

    def big_value(self, megabytes: float) -> DictionaryDHTValue:
        """A dictionary of tiny items, the costliest shape to decode per byte we found (~19 bytes an item)."""
        name = f"{megabytes}"
        if name not in self._big_values:
            value = DictionaryDHTValue()
            for index in range(int(megabytes * 1e6 / 18.6)):
                value.store(index, b"", get_dht_time() + 600)
            self._big_values[name] = value
        return self._big_values[name]

    async def store_big_values(self) -> None:
        """Finding 10: whole-dictionary stores, sent to every node the forger knows, not through the
        DHT's store (which would refuse to send a value without subkeys this large)."""
        if self.only is None or "bigvalue" not in self.only:
            return
        key = DHTID.generate(source=stage_key(self.swarm_id, 1))

        async def attack(peer: Any, name: str, megabytes: float) -> None:
            self.attempts[name] = self.attempts.get(name, 0) + 1
            try:
                ok = await self.dht.protocol.call_store(
                    peer, [key], [self.big_value(megabytes)], [get_dht_time() + 600]
                )
            except Exception as e:
                print(f"store {name} raised {e!r}", file=sys.stderr, flush=True)
                ok = None
            self.accepted[name] = self.accepted.get(name, 0) + int(bool(ok and all(ok)))

        async def attack_one(peer: Any) -> None:
            # the 450 KB value four times: more than one sender's burst allows
            for _ in range(4):
                await attack(peer, "bigvalue_0.45MB", 0.45)

        peers = list(self.dht.protocol.routing_table.peer_id_to_uid)
        await asyncio.gather(*(attack(peer, "bigvalue_3.9MB", 3.9) for peer in peers), *map(attack_one, peers))

    async def genuine(self, key: str, subkey: str) -> dict[str, Any] | None:
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict) or subkey not in found.value:
            return None
        value = found.value[subkey].value
        return value if isinstance(value, dict) and "body" in value else None

    async def round(self) -> None:
        await self.store_big_values()
        now = get_dht_time()
        far = now + FAR
        stage1 = stage_key(self.swarm_id, 1)
        leaving = PeerRecord(peer_id=self.victim, stage=1, state=PeerState.LEAVING).to_wire()
        await self.store("pin_unsigned", stage1, leaving, far, subkey=self.victim)
        victim_envelope = await self.genuine(stage1, self.victim)
        if victim_envelope is not None:
            await self.store("pin_edited", stage1, edited(victim_envelope, state="leaving"), far, subkey=self.victim)
            await self.store("pin_replayed_far", stage1, victim_envelope, far, subkey=self.victim)
        await self.store(
            "pin_forger_signed", stage1, signed_by(self.me, stage1, self.victim, leaving, far), far, subkey=self.victim
        )
        await self.store("pin_plain_value", stage1, b"gone", far)

        phantom = PeerRecord(
            peer_id=PHANTOM_ID, stage=1, state=PeerState.ONLINE, throughput=1e9, inner_step=10**6
        ).to_wire()
        await self.store("phantom_unsigned", stage1, phantom, now + 30, subkey=PHANTOM_ID)
        await self.store(
            "phantom_forger_signed",
            stage1,
            signed_by(self.me, stage1, PHANTOM_ID, phantom, now + 30),
            now + 30,
            subkey=PHANTOM_ID,
        )

        events = events_key(self.swarm_id)
        event = SwarmEvent(
            time.time(), EventKind.UNRECOVERABLE, self.victim, None, "forged: the swarm is lost", reporter=self.victim
        )
        subkey = f"{self.victim}:{event.time:.6f}"
        await self.store("event_unsigned", events, event.to_wire(), now + 60, subkey=subkey)
        await self.store(
            "event_forger_signed",
            events,
            signed_by(self.me, events, subkey, event.to_wire(), now + 60),
            now + 60,
            subkey=subkey,
        )

        founder_slot = config_subkey(self.swarm_id, self.founder)
        founder_envelope = await self.genuine(SWARMS_KEY, founder_slot)
        if founder_envelope is not None:
            evil = forged_config(msgpack.unpackb(founder_envelope["body"], raw=False))
            await self.store("config_unsigned", SWARMS_KEY, evil, far, subkey=self.swarm_id)
            await self.store(
                "config_edited", SWARMS_KEY, edited(founder_envelope, **evil), now + 100, subkey=founder_slot
            )
            own_slot = config_subkey(self.swarm_id, self.me.peer_id)
            own = seal(self.me, SWARMS_KEY, own_slot, evil, now + 100)
            await self.store(
                "config_forger_signed",
                SWARMS_KEY,
                signed_by(self.me, SWARMS_KEY, founder_slot, evil, now),
                now + 100,
                subkey=founder_slot,
            )
            await self.store(CONTROL, SWARMS_KEY, own, now + 100, subkey=own_slot)


async def main(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.max_seconds
    stop = asyncio.Event()  # SIGTERM: stop attacking and report (the test decides when it has seen enough)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    p2p = await P2P.create(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = await DHTNode.create(p2p=p2p, initial_peers=args.initial_peers, cache_locally=False, wait_timeout=5.0)
    try:
        forger = Forger(dht, args.swarm, args.victim, args.founder, set(args.only) if args.only else None)
        print(f"FORGER ID {forger.me.peer_id}", flush=True)
        for index in range(args.rounds):
            if time.monotonic() > deadline or stop.is_set():
                break
            await forger.round()
            if index == 0:
                print("FORGER READY", flush=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.period):
                    await stop.wait()
        print("FORGER DONE " + json.dumps({"attempts": forger.attempts, "accepted": forger.accepted}), flush=True)
        return 0
    finally:
        await dht.shutdown()
        await p2p.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--swarm", required=True)
    parser.add_argument("--victim", required=True, help="peer id of the stage-1 peer to pin as leaving")
    parser.add_argument("--founder", required=True, help="peer id of the swarm's founder")
    parser.add_argument("--only", nargs="*", help="forgery families to run: pin phantom event config bigvalue")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
