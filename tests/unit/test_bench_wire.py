"""The wire benchmark's own arithmetic (tests/benchmarks/bench_wire.py), apart from its swarms.

The swarms run in `make bench-wire`; here: the hop bytes it reports are those of real messages, the
line it parses is the line a replica logs, and its summary line has the form scripts read.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from node.averaging.outer_replica import RoundOutcome, RoundStatus
from node.averaging.round_context import RoundContext
from node.cli import LOG_DATE_FORMAT, LOG_FORMAT
from tests.benchmarks import bench_wire

SUMMARY = re.compile(
    r"^wire: codec (\w+) ([\d.]+)x fewer bytes than fp16, tokens/s ([\d.]+x|\(not measured\)) of the limit, "
    r"NoLoCo round (?:([\d.]+) bytes/param in ([\d.]+) s|\(none applied\))$"
)


def test_the_default_codec_moves_sixteen_times_fewer_bytes_a_token_a_hop_than_fp16_at_both_shapes() -> None:
    for preset in (bench_wire.PRESET, bench_wire.HOP_SHAPE_ONLY):
        rows = {r["codec"]: r for r in bench_wire.hop_table(preset, rate_mbit=50)}
        default = str(bench_wire.preset_config(preset).training.wire_compression)
        assert default == "subspace8"
        assert rows["fp16"]["fewer_than_fp16"] == 1.0
        assert rows[default]["fewer_than_fp16"] >= bench_wire.TARGET_FEWER
        assert 1.9 < rows["int8"]["fewer_than_fp16"] < 2.0  # int8 carries a scale a row
        # the link bound is the rate over what one uplink carries a token: a hop out and a gradient out
        fp16 = rows["fp16"]
        per_token = fp16["forward_bytes_per_token"] + fp16["backward_bytes_per_token"]
        assert fp16["link_bound_tokens_per_s"] == pytest.approx(50e6 / 8 / per_token)


def test_the_hop_bytes_are_those_of_the_framed_message_not_of_the_tensor_alone() -> None:
    row = next(r for r in bench_wire.hop_table(bench_wire.PRESET, 50) if r["codec"] == "fp16")
    assert row["forward_bytes_per_token"] > 2 * row["width"]  # fp16 values, plus meta, ids and framing
    assert row["forward_bytes_per_token"] < 2 * row["width"] + 1  # ... which a 2048-token hop amortizes


def logged_round(caplog: pytest.LogCaptureFixture, outcome: RoundOutcome) -> str:
    """The line RoundContext.record logs for `outcome` (the recording state is all it touches), in
    the format a node writes its log in."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="node.averaging.round_context"):
        RoundContext.record(SimpleNamespace(history=[], outcomes=Counter()), outcome)  # type: ignore[arg-type]
    formatter = logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT)
    return "".join(formatter.format(record) + "\n" for record in caplog.records)


def test_the_bench_reads_the_round_line_replicas_log(caplog: pytest.LogCaptureFixture) -> None:
    a = logged_round(caplog, RoundOutcome(RoundStatus.APPLIED, 3, ("12D3KooWpartnerB",), "", 0.0123, 2_814_585, 4.19))
    b = logged_round(caplog, RoundOutcome(RoundStatus.APPLIED, 3, ("12D3KooWpartnerA",), "", None, 2_814_649, 4.31))
    lone = logged_round(caplog, RoundOutcome(RoundStatus.LONE, 4))
    rounds = bench_wire.rounds_of({"s1a": a + lone, "s1b": b}, parameters=2_987_712)
    assert len(rounds) == 1  # a lone step moved nothing
    (round_,) = rounds
    assert round_["round"] == 3
    assert [s["sent_bytes"] for s in round_["sides"]] == [2_814_585, 2_814_649]
    assert round_["bytes_per_parameter"] == pytest.approx((2_814_585 + 2_814_649) / 2_987_712)
    assert round_["seconds"] == 4.31
    # one side alone: both sides send the same layout, so twice its bytes
    (one_side,) = bench_wire.rounds_of({"s1a": a}, parameters=2_987_712)
    assert one_side["bytes_per_parameter"] == pytest.approx(2 * 2_814_585 / 2_987_712)


def test_the_summary_line_has_the_form_scripts_read() -> None:
    hops = {bench_wire.PRESET: bench_wire.hop_table(bench_wire.PRESET, 50)}
    rounds = [{"round": 0, "sides": [], "bytes_per_parameter": 1.88, "seconds": 4.3}]
    measured = {
        "default_codec": "subspace8",
        "hops": hops,
        "runs": [{"codec": "subspace8", "ratio": 0.91, "rounds": rounds}],
    }
    found = SUMMARY.match(bench_wire.summary_line(measured))
    assert found is not None, bench_wire.summary_line(measured)
    assert found.group(1) == "subspace8" and float(found.group(2)) >= 16
    assert (found.group(3), found.group(4), found.group(5)) == ("0.91x", "1.88", "4.3")
    unmeasured = {"default_codec": "subspace8", "hops": hops, "runs": []}
    assert SUMMARY.match(bench_wire.summary_line(unmeasured)).group(3) == "(not measured)"
