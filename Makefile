# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test slow bench lint format hostile test-private internet netns-deps chaos results

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	# torch first, pinned: on these machines it is a local CPU wheel (never a CUDA download)
	$(PY) -m pip install torch==2.13.0

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m node.demo

test: $(STAMP) netns-deps
	$(PY) -m pytest -q -p no:cacheprovider

slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

bench: $(STAMP)
	$(PY) tests/benchmarks/bench_all.py

# docs/results.md and its plots in docs/results/: the default presets of `node simulate` (about half
# an hour on 2 busy CPU cores, minutes on an idle machine), then the page rendered from their JSON
results: $(STAMP)
	$(PY) -m node simulate sync-scaling --out docs/results --no-progress
	$(PY) -m node simulate recovery --out docs/results
	$(PY) -m node simulate gossip --out docs/results
	$(PY) -m node.simulate.report docs/results docs/results.md

# ruff (lint + format check) with the rules in pyproject.toml; CI runs it before the tests
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# the long hostile-peer run (py-libp2p stranger against a training swarm); a short one is in `make test`
hostile: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests/swarm/test_hostile_peer.py

# every multi-process swarm test again, each swarm private (a fresh `node keygen` key in
# PIPESWARM_SWARM_KEY_FILE): a private swarm must behave as an open one for its members
test-private: $(STAMP)
	PIPESWARM_TEST_PRIVATE=1 $(PY) -m pytest -q -p no:cacheprovider tests/swarm

# the namespace test bed (tests/helpers/netns.py) needs iproute2, and nftables for NAT'ed home hosts;
# installed where missing and possible (root with apt), otherwise those tests skip and say why
netns-deps:
	@command -v ip >/dev/null && command -v nft >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null; } || \
		echo "note: iproute2/nftables not installed: the namespace tests will skip"

# swarms across network namespaces: public and NAT'ed home hosts, shaped links, a partition
internet: $(STAMP) netns-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/netns

# churn: peers of a 4-stage swarm SIGKILLed at random (sometimes a whole stage) and replaced for
# 10 minutes; a 90 s version runs in `make test`
chaos: $(STAMP)
	$(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/swarm/test_chaos.py
