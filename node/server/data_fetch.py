"""A stage-0 peer without `--data` fetches the swarm's prepared data from peers that serve it.

The swarm config's data.manifest_hash (signed by the founder) names the manifest
(node/model/shards.py). The fetcher asks holders (the founder, then any online stage-0 peer: a
peer without the data service answers "protocols not supported" and is avoided) for the manifest
until one sends bytes with that hash, then fetches every shard by sha256, several at a time, each
from a holder chosen at random, and checks each against the manifest before writing it. A holder
that sends a wrong shard or manifest is avoided for the rest of the download and the shard is
fetched from another; one that fails or times out is retried after a growing pause, and avoided
after MAX_FAILURES failures in a row. With no holder left to ask for `give_up_after` seconds the
download fails (DataUnavailable): the joiner refuses in one line (JoinRefused, exit code 3).

Downloads land in `$XDG_CACHE_HOME/pipeswarm/data/<manifest hash>/` (node/model/shards.py
`data_cache_root`), a prepared directory like one `node prepare-data` writes; a later join uses it
without a download, and the peer serves it to others. Every stage-0 peer downloads all of train.bin
and reads it from a stream of its own (node/model/data.py stream_id_from_peer), so peers still
draw different batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dht.announcer import PeerAnnouncer
from dht.records import short_peer_id
from dht.swarm_view import SwarmView
from node.config import DataConfig
from node.model.shards import (
    Manifest,
    ManifestError,
    Shard,
    ShardDirectory,
    ShardError,
    data_cache_root,
    load_cached,
    manifest_hash,
)
from node.p2p.network import Network
from node.p2p.transport import PEER_FAILURES, Transport
from node.runtime.byte_progress import ByteProgress
from node.runtime.meter import Meter
from node.server.daemon import JoinRefused
from node.server.data_service import DataStore, HolderBusy, WireShards, data_transport, local_store, serve_data

logger = logging.getLogger(__name__)

MAX_FAILURES = 3  # failures in a row (not wrong bytes: those avoid a holder at once)


class ShardSource(Protocol):
    """How the fetcher asks a holder (WireShards on the network, fakes in tests)."""

    async def manifest(self, peer_id: str) -> bytes: ...

    async def shard(self, peer_id: str, shard: Shard) -> bytes: ...


class DataUnavailable(RuntimeError):
    """The swarm's data could not be fetched: no holder answered, or only wrong ones did."""


@dataclass(frozen=True)
class FetchPolicy:
    parallel: int = 4  # shards in flight at once
    give_up_after: float = 60.0  # seconds with no holder left to ask
    pause: float = 1.0  # first wait after a failure or a BUSY; doubles per failure, at most 30 s


class _Holders:
    """Which holders may be asked now: avoided ones never, failed or busy ones after a pause."""

    def __init__(self, known: Callable[[], Sequence[str]], policy: FetchPolicy, rng: random.Random) -> None:
        self.known, self.policy, self.rng = known, policy, rng
        self.avoided: dict[str, str] = {}  # peer -> why
        self._failures: dict[str, int] = {}
        self._resting: dict[str, float] = {}  # peer -> monotonic time it may be asked again
        self._since_usable = time.monotonic()

    def pick(self) -> str | None:
        now = time.monotonic()
        usable = [p for p in dict.fromkeys(self.known()) if p not in self.avoided and self._resting.get(p, 0) <= now]
        if usable:
            self._since_usable = now
            return self.rng.choice(usable)
        if now - self._since_usable > self.policy.give_up_after:
            why = "; ".join(f"{short_peer_id(p)}: {reason}" for p, reason in list(self.avoided.items())[:4])
            raise DataUnavailable(
                f"no peer served the swarm's data for {self.policy.give_up_after:.0f} s"
                + (f" ({len(self.avoided)} avoided: {why})" if why else " (none known)")
            )
        return None

    def avoid(self, peer_id: str, why: str) -> None:
        if peer_id not in self.avoided:
            logger.warning(f"avoiding {short_peer_id(peer_id)} for the swarm's data: {why}")
        self.avoided[peer_id] = why

    def failed(self, peer_id: str, why: str, busy: bool = False) -> None:
        count = 0 if busy else self._failures.get(peer_id, 0) + 1
        if count >= MAX_FAILURES:
            self.avoid(peer_id, f"{count} failures, the last: {why}")
            return
        self._failures[peer_id] = count
        self._resting[peer_id] = time.monotonic() + min(30.0, self.policy.pause * 2 ** max(0, count - 1))

    def succeeded(self, peer_id: str) -> None:
        self._failures.pop(peer_id, None)


class ShardFetcher:
    """One download of the manifest `expected_hash` and its shards."""

    def __init__(
        self,
        source: ShardSource,
        expected_hash: str,
        holders: Callable[[], Sequence[str]],
        policy: FetchPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.source, self.expected_hash = source, expected_hash
        self.policy = policy or FetchPolicy()
        self.holders = _Holders(holders, self.policy, rng or random.Random())

    async def _next_holder(self) -> str:
        while (peer := self.holders.pick()) is None:  # bounded: pick raises after give_up_after
            await asyncio.sleep(min(1.0, self.policy.pause))
        return peer

    async def manifest(self) -> Manifest:
        """The manifest whose hash the swarm config records, from the first holder that has it."""
        while True:
            peer = await self._next_holder()
            try:
                encoded = await self.source.manifest(peer)
            except HolderBusy as e:
                self.holders.failed(peer, str(e), busy=True)
                continue
            except PEER_FAILURES as e:
                self.holders.failed(peer, f"{e}"[:200])
                continue
            if manifest_hash(encoded) != self.expected_hash:
                self.holders.avoid(peer, "sent a manifest with another hash")
                continue
            try:  # the hash matched: only a founder's own bug could make it malformed
                manifest = await asyncio.to_thread(Manifest.decode, encoded)
            except ManifestError as e:
                raise DataUnavailable(f"the swarm's manifest is unusable: {e}") from None
            self.holders.succeeded(peer)
            return manifest

    async def shards(self, directory: ShardDirectory, shards: Sequence[Shard], on_bytes: Callable[[int], None]) -> None:
        """Fetch, check and write `shards` into `directory`, `policy.parallel` at a time."""
        queue: asyncio.Queue[Shard] = asyncio.Queue()
        for shard in shards:
            queue.put_nowait(shard)

        async def worker() -> None:
            while not queue.empty():
                shard = queue.get_nowait()
                peer = await self._next_holder()
                try:
                    data = await self.source.shard(peer, shard)
                    await asyncio.to_thread(directory.write, shard, data)  # checks size and sha256 first
                except ShardError as e:
                    self.holders.avoid(peer, f"sent a wrong shard ({e})")
                    queue.put_nowait(shard)
                except HolderBusy as e:
                    self.holders.failed(peer, str(e), busy=True)
                    queue.put_nowait(shard)
                except PEER_FAILURES as e:
                    self.holders.failed(peer, f"{e}"[:200])
                    queue.put_nowait(shard)
                else:
                    self.holders.succeeded(peer)
                    on_bytes(shard.size)

        # a worker that finds the queue empty ends while another may still put a failed shard
        # back: go round until nothing is left (each round ends: every worker's loop is bounded
        # by the holders' give_up_after)
        while not queue.empty():
            try:
                async with asyncio.TaskGroup() as group:  # one worker failing (DataUnavailable) ends them all
                    for _ in range(self.policy.parallel):
                        group.create_task(worker())
            except* DataUnavailable as errors:
                raise errors.exceptions[0] from None


async def fetch_data(
    source: ShardSource,
    expected_hash: str,
    holders: Callable[[], Sequence[str]],
    root: Path,
    *,
    policy: FetchPolicy | None = None,
    quiet: bool = True,
    rng: random.Random | None = None,
) -> DataStore:
    """The prepared data of manifest `expected_hash` under `root`: cached, or fetched now."""
    cached = await asyncio.to_thread(load_cached, root / expected_hash, expected_hash)
    if cached is not None:
        logger.info(f"using the swarm's data cached in {root / expected_hash}")
        return DataStore(root / expected_hash, cached[0])
    fetcher = ShardFetcher(source, expected_hash, holders, policy, rng)
    manifest = await fetcher.manifest()
    try:
        directory = await asyncio.to_thread(ShardDirectory, root, manifest)
    except OSError as e:
        raise DataUnavailable(f"cannot store the swarm's data: {e}") from None
    try:
        missing = await asyncio.to_thread(directory.missing)
        size = sum(shard.size for shard in missing)
        logger.info(
            f"fetching the swarm's data: {len(missing)} of {len(manifest.shards)} shards, {size:,} bytes "
            f"into {directory.path}"
        )
        with ByteProgress(bar=not quiet) as progress:
            await fetcher.shards(directory, missing, progress.advancer("swarm data", size))
        try:
            prepared = await asyncio.to_thread(directory.complete)
        except (OSError, ValueError) as e:
            raise DataUnavailable(f"the fetched data is not usable: {e}") from None
    finally:
        directory.close()
    return DataStore(prepared.directory, manifest)


@contextlib.asynccontextmanager
async def stage0_data(
    network: Network,
    swarm_id: str,
    data: DataConfig,
    view: SwarmView,
    me: PeerAnnouncer,
    data_path: str | None,
    *,
    founders: Sequence[str] = (),
    quiet: bool = True,
    meter: Meter | None = None,
) -> AsyncIterator[str | None]:
    """The data path a stage-0 peer trains on (`data_path`, or the swarm's data fetched now when
    there is none and the swarm offers a manifest), served to other peers while the block runs.
    Another stage, or a swarm without a manifest: `data_path` as it is, nothing served."""
    if me.stage != 0 or not data.manifest_hash:
        yield data_path
        return
    expected = data.manifest_hash
    transport = data_transport(network, swarm_id, me.stage, meter)
    serving: asyncio.Task | None = None
    try:
        if data_path is None:

            def holders() -> list[str]:
                return [*founders, *(p.peer_id for p in view.online(0, exclude=me.peer_id))]

            try:
                store = await fetch_data(
                    WireShards(transport, expected), expected, holders, data_cache_root(), quiet=quiet
                )
            except DataUnavailable as e:
                raise JoinRefused(f"stage 0 has no --data and cannot fetch the swarm's: {e}") from None
            await serve_data(transport, store)
            data_path = str(store.directory)
        else:
            serving = asyncio.create_task(_serve_local(transport, data_path, expected), name="data-service")
        yield data_path
    finally:
        if serving is not None:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        await transport.close()


async def _serve_local(transport: Transport, data_path: str, expected: str) -> None:
    """Serve `--data DIR` when it is the swarm's data (hashing it takes a while: in a thread)."""
    try:
        store = await asyncio.to_thread(local_store, data_path, expected)
    except (OSError, ValueError) as e:
        logger.info(f"not serving {data_path} to other peers: {e}")
        return
    if store is None:
        logger.info(f"not serving {data_path} to other peers: its manifest is not the swarm's {expected[:16]}")
        return
    await serve_data(transport, store)
