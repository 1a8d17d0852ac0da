"""Issue 41: a stage-0 peer without --data fetches the swarm's prepared data from the founder.

The founder starts with `--data DIR` (a directory `node prepare-data` makes here from a few KB of
text, vocabulary 300) cut in 4 KiB shards, so the config records the manifest's hash; a block peer
joins, then a stage-0 peer without --data: it fetches the manifest and every shard from the
founder, checks them, writes them into its cache (XDG_CACHE_HOME) and trains from them. A holder
that sends a wrong shard is covered in process (tests/unit/test_shards.py, two fake holders).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from node.local_swarm import Swarm, wait_for
from node.model.corpus import load_prepared, prepare_corpus
from node.model.shards import DataFile, build_manifest

WORDS = "the swarm trains a model while peers come and go every stage keeps its weights".split()
SHARD_BYTES = 4096


def stage0_steps(swarm: Swarm) -> int:
    peers = swarm.observe()["stages"][0]["peers"]
    return max((p["inner_step"] or 0 for p in peers if p["state"] == "online"), default=0)


@pytest.mark.timeout(150)
def test_a_stage0_peer_without_data_fetches_the_shards_and_trains(swarm: Swarm, tmp_path):
    started = time.monotonic()
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text("".join(" ".join(rng.choice(WORDS, 8)) + "\n" for _ in range(400)))
    data = tmp_path / "prepared"
    prepare_corpus([tmp_path / "corpus.txt"], data, vocab_size=300, val_fraction=0.1, progress=False)
    manifest = build_manifest(data, SHARD_BYTES)
    assert len(manifest.shards) > 4
    cache = tmp_path / "cache"
    swarm.env["XDG_CACHE_HOME"] = str(cache)  # every process of this swarm: never the user's cache

    founder = swarm.bootstrap(
        "--num-stages", "2", "--heartbeat-period", "1", "--heartbeat-ttl", "5",
        "--data", str(data), "--shard-size", str(SHARD_BYTES),
    )  # fmt: skip
    assert f"manifest {manifest.hash}" in founder.log()
    common = ("--threads", "1", "--quiet", "--join-jitter", "0")
    block = swarm.join("peer1", "--stage", "1", *common)
    fetcher = swarm.join("peer0", "--stage", "0", *common)
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
    print(
        f"fetched {manifest.total_bytes} bytes in {len(manifest.shards)} shards and trained; {time.monotonic() - started:.0f} s"
    )
