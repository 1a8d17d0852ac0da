"""What a hop's encoding is chosen from (node/p2p/link_capacity.py, node/pipeline/link_compression.py),
measured on real shaped links between network namespaces: a 50 Mbit/s link reads about 50 Mbit/s even
when the sender uses only part of it, an unshaped one reads far more, and the choice follows: int8
while fp16 would keep the link busy, fp16 on a fast link or a quiet one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.netns import TCP_SINK, TestBed, namespaces_supported

ROOT = Path(__file__).resolve().parents[2]

# bursts of 128 KiB (a default microbatch's fp16 traffic out of a block stage) every `period` seconds
# for `seconds`, each passed through the hop encoder first, then the link's estimate and the encoding
PROBE = r"""
import json, socket, sys, time
import torch
from node.p2p.link_capacity import LinkCapacity
from node.pipeline.link_compression import LinkCompression
from protocol import Compression
host, port, period, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
conn = socket.create_connection((host, port), timeout=30)
capacity = LinkCapacity(conn)
encoder = LinkCompression(Compression.FP16, Compression.INT8, lambda peer_id, service: capacity.bytes_per_second())
hidden = {"hidden": torch.zeros(64 * 1024)}
burst, sent, start = b"x" * (128 * 1024), 0, time.monotonic()
while time.monotonic() - start < seconds:
    chosen = encoder.for_hop("b", "forward", hidden)
    conn.sendall(burst)
    sent += len(burst)
    time.sleep(period)
rate = capacity.bytes_per_second()
print(json.dumps({"sent_mbit_s": sent * 8 / (time.monotonic() - start) / 1e6,
                  "rate_mbit_s": rate and rate * 8 / 1e6, "chosen": str(chosen)}))
"""


@pytest.fixture(autouse=True)
def _namespaces_or_skip() -> None:
    ok, why = namespaces_supported()
    if not ok:
        pytest.skip(why)


def _probe(bed: TestBed, period: float, seconds: float = 7.5) -> dict:
    out = bed.run(
        "a",
        [sys.executable, "-c", PROBE, bed.address("b"), "7300", str(period), str(seconds)],
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_shaped_link_reads_its_rate_and_hops_that_would_fill_it_go_in_int8() -> None:
    with TestBed(seed=7, grace=1.0, offload=True) as bed:
        bed.add_public_host("a")
        bed.add_public_host("b")
        sink = bed.popen("b", [sys.executable, "-S", "-c", TCP_SINK, "7300"], stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        unshaped = _probe(bed, period=0.005)
        for host in ("a", "b"):
            bed.shape(host, delay_ms=10, rate_mbit=50)
        saturated = _probe(bed, period=0.0)
        # the sender idles between bursts (~70 % of the link): each burst still crosses at link rate
        most = _probe(bed, period=0.025)
        quiet = _probe(bed, period=0.2)  # ~10 %
    print(f"unshaped {unshaped}, 50 Mbit/s: saturated {saturated}, mostly used {most}, quiet {quiet}")
    assert unshaped["rate_mbit_s"] > 400 and unshaped["chosen"] == "fp16"
    for measured in (saturated, most):
        assert 35 < measured["rate_mbit_s"] < 70, measured  # tbf lets a burst through a little faster
    assert saturated["chosen"] == most["chosen"] == "int8"
    # idle for 200 ms between bursts, TCP restarts slow start (tcp_slow_start_after_idle): the link
    # reads slower than it is, but carries too little for that to matter
    assert quiet["rate_mbit_s"] < 60 and quiet["chosen"] == "fp16"
    assert most["sent_mbit_s"] < 45  # it was not saturating the link
