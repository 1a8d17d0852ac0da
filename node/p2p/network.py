"""Starting and stopping a peer's networking: hivemind's libp2p daemon (p2pd) and a DHT node.

Both run inside the node's own event loop (DHTNode over an in-process P2P handle) rather than in
hivemind.DHT's extra process: one loop per process, and p2pd is the only child to clean up.

The peer's identity key is always held here, not only by p2pd: records are signed with it
(dht/identity_keys.py, dht/signing.py), and the peer id p2pd announces is derived from it, so anyone can check that a
record comes from the peer it describes. With `identity_path` the key is read from (or created
in) that file (`node bootstrap` and `node join` always pass one: `--identity FILE`, else a key
under the per-user state directory, node/p2p/identity_store.py); otherwise (observers, tests) a
fresh key is written to a private temporary file for p2pd to read at start-up, and that file is
removed as soon as p2pd runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID

from dht.identity_keys import Identity
from dht.signing import SignedRecordValidator
from node.p2p.bans import BanList
from node.p2p.dht_guard import DHT_MESSAGE_LIMIT, DHTRequestGuard, dht_conduct
from node.p2p.dialer import MAX_DIAL_ADDRS, p2pd_multiaddr
from node.p2p.direct import DirectLinks
from node.p2p.identity_store import IdentityError
from node.p2p.reachability import NatReachability, announced_addresses
from node.p2p.rejoin import RejoinBook, peer_id_of_maddr  # noqa: F401 (peer_id_of_maddr: imported from here)
from node.p2p.traversal import Traversal
from node.runtime.loop_watch import LoopWatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class NetworkError(RuntimeError):
    """The peer could not start its networking or reach the swarm."""


@dataclass
class Network:
    p2p: P2P
    dht: DHTNode
    identity: Identity
    # the multiaddrs this peer entered the DHT through: whose config to trust unless told otherwise
    initial_peers: list[str] = field(default_factory=list)
    reachability: NatReachability = NatReachability.AUTO
    dht_guard: DHTRequestGuard | None = None
    # the node's one ban store (node/p2p/bans.py): the DHT guard, and each stage service's stream
    # admission, routing, gossip and spot-checks read and write it
    bans: BanList = field(default_factory=BanList)
    # pipeline channels without p2pd where peers reach each other (node/p2p/direct.py); None: off
    direct: DirectLinks | None = None
    # links to peers behind NATs through relays, and registrations when behind one (node/p2p/traversal.py);
    # set once the swarm is known (`enable_traversal`); None: no direct links
    traversal: Traversal | None = None
    loop_watch: LoopWatch = field(default_factory=LoopWatch)
    # the peers to re-enter the DHT through after losing it (keep_joined); the swarm view adds to it
    rejoin: RejoinBook = field(default_factory=RejoinBook)
    _loop_watch_task: asyncio.Task | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.rejoin.initial_peers:
            self.rejoin.initial_peers = list(self.initial_peers)
        self._loop_watch_task = asyncio.get_running_loop().create_task(self.loop_watch.run(), name="loop-watch")

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    @property
    def direct_port(self) -> int | None:
        """The port this peer takes direct links on (its record announces it); None: it takes none."""
        return self.direct.port if self.direct is not None else None

    def enable_traversal(self, swarm_id: str) -> None:
        """NAT traversal for this peer's direct links in `swarm_id` (a no-op without direct links)."""
        if self.direct is not None and self.traversal is None:
            self.traversal = Traversal(self.direct, swarm_id)

    @property
    def validator(self) -> SignedRecordValidator:
        return self.dht.protocol.record_validator  # type: ignore[return-value]

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """Where others can dial this peer; `latest` asks p2pd again (relay addresses come later)."""
        return [str(addr) for addr in await self.p2p.get_visible_maddrs(latest=latest)]

    async def announced_addresses(self) -> list[str]:
        """What this peer's record says it can be dialed at (node/p2p/reachability.py)."""
        return announced_addresses(await self.visible_maddrs(latest=True), self.initial_peers, self.reachability)

    @property
    def p2pd_pid(self) -> int | None:
        child = getattr(self.p2p, "_child", None)
        return None if child is None else child.pid

    async def keep_joined(self, period: float = 20.0, isolated_period: float = 5.0, limit: int = 8) -> None:
        """Re-enter the DHT through any peer we know of that fell out of our routing table
        (node/p2p/rejoin.py): hivemind never re-bootstraps, so after a partition heals both sides
        would otherwise keep their own half of the DHT forever. Every `isolated_period` while the
        table is empty: a peer cut off can do nothing useful until it is back."""
        while True:
            await asyncio.sleep(isolated_period if not self.dht.protocol.routing_table.uid_to_peer_id else period)
            try:
                connected = {
                    info.peer_id.to_base58(): [str(addr) for addr in info.addrs] for info in await self.p2p.list_peers()
                }
            except Exception as e:  # p2pd busy or going away: the other candidates still count
                logger.debug(f"could not list p2pd's connections: {e!r}")
                connected = {}
            was_empty = not self.dht.protocol.routing_table.uid_to_peer_id
            candidates = self.rejoin.candidates(
                time.monotonic(), connected, self._in_table, self.peer_id, limit, isolated=was_empty
            )
            if not candidates:
                continue
            answers = await asyncio.gather(*(self._ping_at(peer_id, addrs) for peer_id, addrs in candidates))
            for (peer_id, _), answered in zip(candidates, answers):
                if answered:
                    self.rejoin.answered(peer_id)
                else:
                    self.rejoin.failed(peer_id, time.monotonic())
            if any(answers):
                # INFO when this peer had lost the DHT altogether; otherwise it only met a peer it lacked
                log = logger.info if was_empty else logger.debug
                log(f"re-entered the DHT through {sum(answers)} peer(s)")
                with contextlib.suppress(Exception):  # the table holds them now; a lookup only adds more
                    await self.dht.find_nearest_nodes([self.dht.node_id])

    def _in_table(self, peer_id: str) -> bool:
        return PeerID.from_base58(peer_id) in self.dht.protocol.routing_table

    async def _ping_at(self, peer_id: str, addrs: Sequence[str]) -> bool:
        """Dial `peer_id` at `addrs` (if any), then ping it over the DHT: whether it answered (a ping
        re-adds it to our routing table, and us to its table)."""
        peer = PeerID.from_base58(peer_id)
        try:
            maddrs = [p2pd_multiaddr(addr) for addr in addrs[:MAX_DIAL_ADDRS]]
            if maddrs:
                await asyncio.wait_for(self.p2p._client.connect(peer, maddrs), 10.0)
            return await self.dht.protocol.call_ping(peer) is not None
        except Exception as e:  # unparsable, unreachable or gone for now: its retry delay grows
            logger.debug(f"could not re-enter the DHT through {peer_id}: {e!r}")
            return False

    async def shutdown(self) -> None:
        if self._loop_watch_task is not None:
            self._loop_watch_task.cancel()
        if self.direct is not None:
            await self.direct.close()
        try:
            await self.dht.shutdown()
        finally:
            await self.p2p.shutdown()


_CLEANUPS: set[asyncio.Future] = set()


async def _finish_or_clean_up(creation: Awaitable[T], shutdown: Callable[[T], Awaitable[None]]) -> T:
    """Await `creation`; if we are cancelled meanwhile (a caller's timeout), let it finish in the
    background and shut the result down, instead of leaking a p2pd that nobody owns."""
    task = asyncio.ensure_future(creation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def clean_up(finished: asyncio.Future) -> None:
            if not finished.cancelled() and finished.exception() is None:
                cleanup = asyncio.ensure_future(shutdown(finished.result()))
                _CLEANUPS.add(cleanup)  # held until done: asyncio keeps only weak references
                cleanup.add_done_callback(_CLEANUPS.discard)

        task.add_done_callback(clean_up)
        raise


def load_identity(identity_path: str | None) -> tuple[Identity, str, str | None, bool]:
    """(identity, key file for p2pd, temporary directory to remove once p2pd runs or None, whether
    the key is new).

    A file given by the user is read, or created there if it does not exist yet; without one the
    key is fresh and lives on disk only until p2pd has read it. IdentityError (one line, with the
    fix) when the file cannot be read or holds no usable key: a peer must not silently change id."""
    if identity_path is not None:
        if os.path.exists(identity_path):
            try:
                return Identity.from_file(identity_path), identity_path, None, False
            except OSError as e:
                raise IdentityError(
                    f"cannot read identity file {identity_path}: {e.strerror or e} (fix its permissions, "
                    "or give another file with --identity FILE)"
                ) from None
            except ValueError as e:
                raise IdentityError(
                    f"identity file {identity_path} is unusable: {e} (remove it for a new peer id, "
                    "or give another file with --identity FILE)"
                ) from None
        identity = Identity.generate()
        try:
            identity.save(identity_path)
        except OSError as e:
            raise IdentityError(f"cannot write identity file {identity_path}: {e.strerror or e}") from None
        logger.info(f"new identity {identity.peer_id} saved to {identity_path}")
        return identity, identity_path, None, True
    identity = Identity.generate()
    directory, path = identity.save_temporary()
    return identity, path, directory, True


def listen_maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


async def start_network(
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    initial_peers: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    announce_maddrs: Sequence[str] = (),
    startup_timeout: float = 30.0,
    swarm_key: bytes | None = None,
    reachability: NatReachability = NatReachability.AUTO,
    direct_port: int | None = None,
) -> Network:
    """Start p2pd and a DHT node joined to `initial_peers` (none: this peer starts a new DHT). The DHT
    node accepts only signed pipeswarm records (dht/signing.py) and signs with this peer's identity.
    With `direct_port` (0: any free one) it also listens for direct links on `host` (node/p2p/direct.py)."""
    identity, key_file, temporary, fresh = load_identity(identity_path)
    try:
        p2p = await _finish_or_clean_up(
            P2P.create(
                initial_peers=list(initial_peers),
                host_maddrs=[] if client_mode else [listen_maddr(host, port)],
                announce_maddrs=list(announce_maddrs) or None,
                identity_path=key_file,
                # a key we just generated cannot be in use elsewhere: skip hivemind's check, which
                # starts a second p2pd to look for it
                check_if_identity_free=not fresh,
                dht_mode="client" if client_mode else "server",
                startup_timeout=startup_timeout,
                # a stranger's LAN gateway is none of our business; tests run on loopback
                nat_port_map=False,
                no_listen=client_mode,
                # p2pd refuses larger DHT messages before Python decodes them (node/p2p/dht_guard.py)
                persistent_conn_max_msg_size=DHT_MESSAGE_LIMIT,
                **(reachability.p2p_options() if not client_mode else {}),
            ),
            P2P.shutdown,
        )
    except Exception as e:
        raise NetworkError(f"could not start the libp2p daemon: {e}") from e
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    if p2p.peer_id.to_base58() != identity.peer_id:
        await asyncio.shield(p2p.shutdown())
        raise NetworkError(
            f"p2pd runs as {p2p.peer_id.to_base58()}, not as the identity {identity.peer_id} "
            "it was given: records could not be signed"
        )
    try:
        dht = await _finish_or_clean_up(
            DHTNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers),
                client_mode=client_mode,
                num_workers=4,
                wait_timeout=5.0,
                cache_locally=False,
                record_validator=SignedRecordValidator(identity, swarm_key),
            ),
            DHTNode.shutdown,
        )
    except BaseException as e:
        await asyncio.shield(p2p.shutdown())
        if not isinstance(e, Exception):
            raise
        where = ", ".join(initial_peers) or "(none)"
        raise NetworkError(f"could not join the DHT through initial peers {where}: {e}") from e
    guard, direct, bans = None, None, BanList()
    if not client_mode:
        try:
            guard = await DHTRequestGuard.install(dht.protocol, p2p, dht_conduct(bans))
            if direct_port is not None:
                direct = DirectLinks(identity, swarm_key)
                await direct.listen(host, direct_port)
        except BaseException as e:
            await asyncio.shield(dht.shutdown())
            await asyncio.shield(p2p.shutdown())
            if isinstance(e, OSError):  # the port is taken or the host is not ours: one line for the user
                raise NetworkError(f"cannot listen for direct links on {host}:{direct_port}: {e.strerror or e}") from e
            raise
    return Network(
        p2p=p2p,
        dht=dht,
        identity=identity,
        initial_peers=list(initial_peers),
        reachability=NatReachability.AUTO if client_mode else reachability,
        dht_guard=guard,
        bans=bans,
        direct=direct,
    )
