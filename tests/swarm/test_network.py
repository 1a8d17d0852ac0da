"""Starting a peer's networking is cancellation-safe: a caller's timeout leaks no p2pd."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from node.p2p.network import start_network


def p2pd_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "p2pd" in p.name()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cancel_after", [0.05, 0.2, 0.5])
def test_cancelled_start_leaves_no_p2pd(cancel_after: float):
    async def main() -> None:
        try:
            network = await asyncio.wait_for(start_network(host="127.0.0.1"), cancel_after)
        except TimeoutError:
            pass
        else:  # a fast machine finished first: nothing was cancelled, shut it down normally
            await network.shutdown()
        deadline = time.monotonic() + 30
        while p2pd_children() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # the background clean-up runs on this loop

    before = {p.pid for p in p2pd_children()}
    asyncio.run(main())
    leaked = [p for p in p2pd_children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not leaked, f"p2pd left running: {[p.pid for p in leaked]}"


@pytest.mark.timeout(120)
def test_started_network_shuts_down_its_p2pd():
    async def main() -> None:
        network = await start_network(host="127.0.0.1")
        assert network.p2pd_pid in {p.pid for p in p2pd_children()}
        await network.shutdown()

    asyncio.run(main())
    assert not [p for p in p2pd_children() if p.status() != psutil.STATUS_ZOMBIE]
