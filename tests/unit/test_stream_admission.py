"""A p2pd stream handler's task never ends cancelled: Python 3.11's asyncio streams call
task.exception() on a finished handler task, which raises for a cancelled one, and the loop logs a
traceback (seen in a node's log when a spot check's compute was cut at shutdown)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from node.p2p.peer_conduct import PeerConduct
from node.p2p.stream_admission import StreamAdmission
from node.runtime.meter import Meter

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class Writer:
    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_work_cancelled_under_a_stream_leaves_its_task_finished_not_cancelled():
    async def cut_at_shutdown(sender, reader, writer) -> None:
        raise asyncio.CancelledError  # as a compute future cancelled by the stage's executor closing

    async def scenario() -> tuple[bool, BaseException | None, bool, int]:
        conduct = PeerConduct()

        async def refuse(writer, reason):
            raise AssertionError(f"refused: {reason}")

        handler = StreamAdmission(conduct, Meter(), refuse).handler("forward", cut_at_shutdown)
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: PEER_ID))
        writer = Writer()
        task = asyncio.ensure_future(handler(info, asyncio.StreamReader(), writer))
        await asyncio.wait([task])
        return task.cancelled(), task.exception() if not task.cancelled() else None, writer.closed, conduct._open_total

    cancelled, error, closed, still_open = asyncio.run(scenario())
    assert not cancelled and error is None
    assert closed and still_open == 0  # the stream was closed and its slot given back
