"""Direct links between two homes behind different NAT routers (node/p2p/relay.py, traversal.py), in
the namespace test bed (tests/helpers/netns.py), with the probe of tests/helpers/traversal_probe.py:
a relay on a public host, a peer behind router A that asks for links, peers behind router B.

- Both routers keep source ports (plain masquerade): the link is hole-punched, the relay carries
  none of it.
- Router B picks a random port per connection (symmetric): the punch fails, and the relay carries
  the link, within its budget.
- Router B restarts (its conntrack table flushed): the home behind it is reachable again.

Each case is a few seconds; they run in `make test`. The same with a whole swarm: test_two_homes.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.netns import TestBed, bed_with_hosts, require_namespaces

PROBE = [sys.executable, "-m", "tests.helpers.traversal_probe"]
MiB = 1 << 20


class Probe:
    """A probe process in a bed host, its JSON lines collected as they come."""

    def __init__(self, bed: TestBed, host: str, *args: object):
        self.process = bed.popen(host, [*PROBE, *map(str, args)], stdout=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_for(self, key: str, seconds: float, check=lambda value: True) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for line in reversed(self.lines):
                if key in line and check(line[key]):
                    return line
            if self.process.poll() is not None and not any(key in line for line in self.lines):
                break
            time.sleep(0.1)
        raise AssertionError(f"no {key!r} line within {seconds} s: {self.lines[-5:]}")


def ask(bed: TestBed, host: str, relay: dict, relay_host: str, home_id: str, size: int, *mode: str) -> dict:
    argv = [*PROBE, "ask", relay["peer_id"], bed.address(relay_host), relay["port"], home_id, size, *mode]
    done = bed.run(host, [str(a) for a in argv], timeout=90)
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def homes(bed: TestBed, relay: dict, *names: str) -> dict[str, str]:
    """Start a registering home peer on each host; their peer ids once registered."""
    probes = {name: Probe(bed, name, "home", relay["peer_id"], bed.address("pub"), relay["port"]) for name in names}
    return {
        name: probe.wait_for("peer_id", 30)["peer_id"]
        for name, probe in probes.items()
        if probe.wait_for("registered", 30, lambda relays: relays == [relay["peer_id"]])
    }


@pytest.mark.timeout(300)
def test_homes_behind_two_nats_punch_through_or_are_relayed_within_budget():
    require_namespaces()
    # home_b's router keeps source ports, home_c's is a symmetric NAT
    with bed_with_hosts(("pub",), ("home_a", "home_b", "home_c"), symmetric=("home_c",)) as bed:
        bed.shape("pub", delay_ms=10)
        relay_probe = Probe(bed, "pub", "relay", 24 * MiB, 100 * MiB)
        relay = relay_probe.wait_for("port", 30)
        ids = homes(bed, relay, "home_b", "home_c")

        punched = ask(bed, "home_a", relay, "pub", ids["home_b"], 4 * MiB)
        stats = relay_probe.wait_for("stats", 5, lambda s: s["introduced"] >= 1)["stats"]
        print(f"port-preserving NATs: {punched}; relay {stats}")
        assert punched.get("path") == "punched" and punched.get("echoed") == 4 * MiB, punched
        assert stats["spliced"] == 0 and stats["relayed_bytes"] == 0, stats

        relayed = ask(bed, "home_a", relay, "pub", ids["home_c"], 8 * MiB)
        stats = relay_probe.wait_for("stats", 5, lambda s: s["spliced"] >= 1)["stats"]
        print(f"symmetric NAT: {relayed}; relay {stats}")
        assert relayed.get("path") == "relayed" and relayed.get("echoed") == 8 * MiB, relayed
        assert stats["relayed_bytes"] >= 16 * MiB, stats  # both ways, sealed end to end

        # 16 MiB more each way would pass the 24 MiB budget: the link ends, the budget holds
        over = ask(bed, "home_a", relay, "pub", ids["home_c"], 16 * MiB, "relay")
        last = relay_probe.wait_for("stats", 5)
        print(f"over budget: {over}; relay {last}")
        assert "error" in over, over
        assert last["stats"]["relayed_bytes"] <= 24 * MiB and last["left"] >= 0, last


@pytest.mark.timeout(300)
def test_a_home_is_reachable_again_after_its_router_forgets_every_connection():
    require_namespaces()
    with bed_with_hosts(("pub",), ("home_a", "home_b")) as bed:
        relay = Probe(bed, "pub", "relay", 64 * MiB, 100 * MiB).wait_for("port", 30)
        ids = homes(bed, relay, "home_b")
        assert ask(bed, "home_a", relay, "pub", ids["home_b"], MiB).get("path") == "punched"
        bed.flush_nat("home_b-lan")  # a router restart: every mapping gone
        flushed, back = time.monotonic(), None
        for _ in range(12):  # bounded: a minute at most
            result = ask(bed, "home_a", relay, "pub", ids["home_b"], MiB)
            if result.get("echoed") == MiB:
                back = time.monotonic() - flushed
                break
            time.sleep(max(0.0, 5.0 - result.get("seconds", 0.0)))
        print(f"after the router of home_b forgot its connections: reachable again after {back} s")
        assert back is not None and back <= 60, back
