"""Issue 41: a stage-0 peer without --data fetches the swarm's prepared data from the founder.

The founder starts with `--data DIR` (a directory `node prepare-data` makes here from ~90 KB of
text, vocabulary 300) cut in 4 KiB shards, so the config records the manifest's hash; a block peer
joins, then a stage-0 peer without --data: it fetches the manifest and every shard from the
founder, checks them, writes them into its cache (XDG_CACHE_HOME) and trains from them.

That peer then lies: its data service serves every shard with one bit flipped (the real node with
`read_shard` patched, as a bad disk or a malicious holder would). A second stage-0 peer without
--data picks holders at random among the founder and the liar, refuses the liar's first wrong
shard, avoids it, and gets everything from the founder (with 20-odd shards, the chance it never
asks the liar is about 2^-20). Other holder failures are covered in process (tests/unit/test_shards.py).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from node.local_swarm import Swarm, wait_for
from node.model.corpus import load_prepared, prepare_corpus
from node.model.shards import DataFile, build_manifest
from tests.helpers.swarms import join_peer

WORDS = "the swarm trains a model while peers come and go every stage keeps its weights".split()
SHARD_BYTES = 4096
# `python -c` instead of `python -m node`: the same CLI, with the data service's shard reader
# flipping one bit of every shard it serves (the liar still fetched and trains on the right bytes)
LYING_HOLDER = [
    "-c",
    "import runpy, node.server.data_service as service; honest = service.read_shard; "
    "service.read_shard = lambda directory, shard: bytes([honest(directory, shard)[0] ^ 1]) + honest(directory, shard)[1:]; "
    "runpy.run_module('node', run_name='__main__', alter_sys=True)",
]


def stage0_steps(swarm: Swarm) -> int:
    peers = swarm.observe()["stages"][0]["peers"]
    return max((p["inner_step"] or 0 for p in peers if p["state"] == "online"), default=0)


def peer_id_of(log: str) -> str | None:
    match = re.search(r"peer (\S+) serves stage", log)
    return match.group(1) if match else None


def own_steps(swarm: Swarm, peer_id: str) -> int:
    peers = swarm.observe()["stages"][0]["peers"]
    return max((p["inner_step"] or 0 for p in peers if p["peer_id"] == peer_id and p["state"] == "online"), default=0)


@pytest.mark.timeout(240)
def test_a_stage0_peer_without_data_fetches_the_shards_and_trains(swarm: Swarm, tmp_path):
    started = time.monotonic()
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text("".join(" ".join(rng.choice(WORDS, 8)) + "\n" for _ in range(2400)))
    data = tmp_path / "prepared"
    prepare_corpus([tmp_path / "corpus.txt"], data, vocab_size=300, val_fraction=0.1, progress=False)
    manifest = build_manifest(data, SHARD_BYTES)
    assert len(manifest.shards) >= 20
    cache = tmp_path / "cache"
    swarm.env["XDG_CACHE_HOME"] = str(cache)  # every process of this swarm: never the user's cache

    founder = swarm.bootstrap(
        "--num-stages", "2", "--heartbeat-period", "1", "--heartbeat-ttl", "5",
        "--data", str(data), "--shard-size", str(SHARD_BYTES),
    )  # fmt: skip
    assert f"manifest {manifest.hash}" in founder.log()
    block = join_peer(swarm, "peer1", 1, "--join-jitter", "0")
    fetcher = join_peer(swarm, "peer0", 0, "--join-jitter", "0", python_prefix=LYING_HOLDER)
    nodes = [founder, block, fetcher]

    def logs() -> str:
        return "\n".join(f"--- {n.name}\n{n.log()[-2500:]}" for n in nodes)

    wait_for(
        lambda: "swarm data:" in fetcher.log() and (cache / "pipeswarm" / "data" / manifest.hash).is_dir(),
        60,
        lambda: "the stage-0 peer fetched no data:\n" + logs(),
    )
    fetched = cache / "pipeswarm" / "data" / manifest.hash
    for file in DataFile:
        assert (fetched / file.value).read_bytes() == (data / file.value).read_bytes(), file
    assert load_prepared(fetched).tokenizer_hash == load_prepared(data).tokenizer_hash
    assert re.search(
        rf"fetching the swarm's data: {len(manifest.shards)} of {len(manifest.shards)} shards", fetcher.log()
    )
    wait_for(lambda: stage0_steps(swarm) >= 3, 60, lambda: "the stage-0 peer did not train:\n" + logs())
    # it serves what it fetched to the stage-0 peers after it
    assert f"serving the swarm's data: manifest {manifest.hash[:16]}" in fetcher.log()
    assert "Traceback" not in fetcher.log() and fetcher.process.poll() is None
    fetched_at = time.monotonic() - started

    # a second stage-0 peer without --data: the liar's wrong shards are refused and fetched elsewhere
    liar = peer_id_of(fetcher.log())
    assert liar is not None
    second_cache = tmp_path / "cache2"
    swarm.env["XDG_CACHE_HOME"] = str(second_cache)
    second = join_peer(swarm, "peer2", 0, "--join-jitter", "0")
    nodes.append(second)
    wait_for(lambda: "swarm data:" in second.log(), 60, lambda: "the second stage-0 peer fetched no data:\n" + logs())
    assert f"avoiding {liar[-8:]} for the swarm's data: sent a wrong shard" in second.log(), logs()
    refetched = second_cache / "pipeswarm" / "data" / manifest.hash
    for file in DataFile:
        assert (refetched / file.value).read_bytes() == (data / file.value).read_bytes(), file
    second_id = peer_id_of(second.log())
    assert second_id is not None
    wait_for(lambda: own_steps(swarm, second_id) >= 2, 60, lambda: "the second stage-0 peer did not train:\n" + logs())
    assert "Traceback" not in second.log() and second.process.poll() is None
    print(
        f"fetched {manifest.total_bytes} bytes in {len(manifest.shards)} shards and trained in {fetched_at:.0f} s; "
        f"a second peer refused the lying holder's shards and fetched from the founder; {time.monotonic() - started:.0f} s"
    )
