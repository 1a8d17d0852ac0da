# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test slow bench lint format hostile test-private internet netns-deps chaos results \
	podman-deps docker-image docker-test gpu-check memory-table bench-hop-codec bench-hop-codec-text bench-hop-codec-text-15m \
	bench-wire experiments

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

# two pytest runs at once. The first: the tests that start swarms (tests/swarm, tests/netns) one after
# another, since a swarm keeps about 1.3 of the 2 cores busy and several of them measure rates or
# detection times. The second, beside it (its report printed at the end): every other test, then the
# swarm tests that only need their steps to happen within generous bounds (in-process swarms, a few
# processes, and the CPU gpu-check, whose figures are printed, not asserted), the short partition (its
# only bound: training resumes within 300 s of the heal) and two home replicas averaging (within 420 s)
BESIDE_SWARMS := $(addprefix tests/swarm/,test_channels.py test_dashboard_tmux.py test_data_shards.py test_doctor.py \
	test_gpu_check.py test_metrics.py test_network.py test_pipeline_correctness.py test_private_swarm.py \
	test_stage_fit_join.py test_state_transfer.py) tests/netns/test_swarm_links.py tests/netns/test_two_homes.py
test: $(STAMP) netns-deps
	@( $(PY) -m pytest -q -p no:cacheprovider --durations=10 --ignore=tests/swarm --ignore=tests/netns; others=$$?; \
		$(PY) -m pytest -q -p no:cacheprovider --durations=10 $(BESIDE_SWARMS); light=$$?; \
		exit $$(( others != 0 || light != 0 )) ) > .unit-tests.log 2>&1 & unit=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 tests/swarm tests/netns $(addprefix --ignore=,$(BESIDE_SWARMS)); \
	swarms=$$?; wait $$unit; units=$$?; echo "--- the other tests:"; cat .unit-tests.log; rm -f .unit-tests.log; \
	echo "swarm and netns tests: exit $$swarms; the other tests: exit $$units"; \
	test $$swarms -eq 0 -a $$units -eq 0

slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# the wide-area part runs a swarm in network namespaces: root and iproute2 (netns-deps), else it skips
bench: $(STAMP) netns-deps
	$(PY) tests/benchmarks/bench_all.py

# the wire at real size alone (tests/benchmarks/bench_wire.py, docs/benchmarks.md): the 15m preset per hop
# codec over 100 ms RTT / 50 Mbit/s namespace links, against its compute and link bounds, and its NoLoCo
# rounds; ends with the `wire:` line (about 14 minutes on 2 CPU cores; root and iproute2 for the swarms)
bench-wire: $(STAMP) netns-deps
	$(PY) tests/benchmarks/bench_wire.py

# the hop codecs' bytes per token and loss at equal tokens, 3 seeds (docs/wire.md; ~8 minutes on 2 CPU cores, 2 runs at a time)
bench-hop-codec: $(STAMP)
	$(PY) tests/benchmarks/bench_hop_codec.py --processes 2 --json docs/results/hop_codec.json
	$(PY) -m node.simulate.report --record docs/results hop_codec

# the same on real text, 3 seeds (docs/results.md, "Hop codecs on real text"): the CPython standard library
# prepared into build/corpus/stdlib as `make experiments` prepares it (once, for both), each codec trained
# and measured on it, then the page rendered (~25 minutes on 2 CPU cores, plus the corpus the first time)
bench-hop-codec-text: $(STAMP)
	$(PY) tests/benchmarks/bench_hop_codec.py --data build/corpus/stdlib --prepare-stdlib --seeds 0 1 2 \
		--processes 2 --json docs/results/hop_codec_real_text.json
	$(PY) -m node.simulate.report --record docs/results hop_codec_real_text
	$(PY) -m node.simulate.report docs/results docs/results.md

# the same at the 15m preset's width (288: rank 31), fp16 against the default codec and against fp16 hops with
# its anchors added (the projection's own cost), 3 seeds (~25 minutes on 2 CPU cores)
bench-hop-codec-text-15m: $(STAMP)
	$(PY) tests/benchmarks/bench_hop_codec.py --data build/corpus/stdlib --prepare-stdlib --seeds 0 1 2 \
		--width 288 --variants fp16 subspace8 fp16+anchors --processes 2 --json docs/results/hop_codec_real_text_15m.json
	$(PY) -m node.simulate.report --record docs/results hop_codec_real_text_15m
	$(PY) -m node.simulate.report docs/results docs/results.md

# the volunteer's real case end to end on one device (tests/benchmarks/gpu_check.py, docs/benchmarks.md
# "GPU check"): a 4-stage swarm at PRESET trains, a joiner downloads a stage, two replicas gossip, a
# killed stage is rebuilt by CheckFree, the model is exported; figures printed, exit 1 on any failure.
# `make test` runs DEVICE=cpu PRESET=15m. On a GPU machine, give it the Python that has your CUDA torch
# and pipeswarm installed (`pip install -e '.[export]'`): make gpu-check PY=python3
DEVICE ?= cuda
PRESET ?= 125m
gpu-check: $(if $(filter $(PY),$(VENV)/bin/python),$(STAMP))
	$(PY) tests/benchmarks/gpu_check.py --device $(DEVICE) --preset $(PRESET)

# docs/results.md and its plots in docs/results/: the default presets of `node simulate` (about half
# an hour on 2 busy CPU cores, minutes on an idle machine), the recovery run again with edge stages
# failing too, the N <= 8 NoLoCo rounds measured live on loopback, then the page rendered from the JSON
results: $(STAMP)
	$(PY) -m node simulate sync-scaling --out docs/results --no-progress
	$(PY) tests/benchmarks/bench_gossip_round.py --out docs/results
	$(PY) -m node simulate recovery --out docs/results
	$(PY) -m node simulate recovery --failing blocks --out docs/results/edges
	$(PY) -m node simulate gossip --out docs/results
	$(PY) -m node.simulate.report --record docs/results sync_scaling sync_scaling_live recovery edges/recovery gossip
	$(PY) -m node.simulate.report docs/results docs/results.md

# the papers' claims on real text, 3 seeds (node/simulate/real_text.py, docs/results.md "Real text"): the CPython
# standard library prepared into build/corpus/, every recovery strategy and outer step on it, then the page
# rendered; a seed is about 20 minutes of one core, and the seeds run in parallel processes, one a core
# (JOBS=N to change it): about 40 minutes on 2 CPU cores. QUICK=1: the short version `make test` runs, into
# build/ (a minute).
# DEVICE=cuda: the GPU scale (the 125m preset's model; about an hour on one GPU, an estimate) into
# docs/results/real_text_cuda, beside the CPU figures; as for gpu-check, PY=python3 runs it with your CUDA torch.
# DEVICE is gpu-check's too, whose default is cuda: here only a DEVICE given on the command line or in the
# environment counts, so that `make experiments` alone stays on the CPU
EXPERIMENTS_DEVICE = $(if $(filter file,$(origin DEVICE)),cpu,$(DEVICE))
REAL_TEXT = $(if $(filter cpu,$(EXPERIMENTS_DEVICE)),real_text,real_text_cuda)
experiments: $(if $(filter $(PY),$(VENV)/bin/python),$(STAMP))
	$(PY) -m node.simulate.real_text --device $(EXPERIMENTS_DEVICE) $(if $(JOBS),--jobs $(JOBS)) \
		$(if $(QUICK),--quick --seeds 0 1 --out build/experiments-quick,--out docs/results/$(REAL_TEXT))
	$(if $(QUICK),,$(PY) -m node.simulate.report --record docs/results $(REAL_TEXT))
	$(if $(QUICK),,$(PY) -m node.simulate.report docs/results docs/results.md)

# docs/model.md's preset and memory tables from the code, and the estimate against a real StageWorker's
# measured peak per preset and stage (about 15 minutes and 8 GB on 2 CPU cores; `--device cuda` on a GPU);
# `python tests/benchmarks/bench_memory.py --estimate-only` rewrites the tables without measuring
memory-table: $(STAMP)
	$(PY) tests/benchmarks/bench_memory.py

# ruff (lint + format check) with the rules in pyproject.toml; CI runs it before the tests
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# the long hostile-peer run (py-libp2p stranger against a training swarm) and the slow forged-record runs
# (each forgery in turn, big DHT values); the short ones are in `make test`. Then every request handler
# against arbitrary envelopes (tests/unit/test_hostile_handlers.py) with HOSTILE_EXAMPLES of them instead
# of make test's 200 (5000 take about a minute on 2 busy cores)
HOSTILE_EXAMPLES ?= 5000
hostile: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests/swarm/test_hostile_peer.py tests/swarm/test_forged_records.py
	PIPESWARM_HYPOTHESIS_EXAMPLES=$(HOSTILE_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/unit/test_hostile_handlers.py

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
# 10 minutes; a 65 s version runs in `make test`
chaos: $(STAMP)
	$(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/swarm/test_chaos.py

# Containers, with podman: Docker's engine does not run on these machines. The flags, measured here:
# runc (crun fails on this machine's cgroup v1 hierarchy), cgroupfs (no systemd to manage cgroups),
# events in a file (no journald). tests/container/image.py adds --network host to the build and the
# test adds explicit --ulimit values (runc cannot apply podman's defaults here).
PODMAN ?= podman --runtime runc --cgroup-manager cgroupfs --events-backend file
IMAGE ?= localhost/pipeswarm:cpu
# a folder holding the torch 2.13.0 CPU wheel for Python 3.11: mounted into the build, never downloaded
TORCH_WHEELS ?= /opt/wheels

# podman, runc and debootstrap (for a base image when no registry answers), installed where missing
# and possible (root with apt); otherwise make docker-test skips and says why
podman-deps:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc catatonit debootstrap >/dev/null; } || \
		echo "note: podman/runc/debootstrap not installed: make docker-test will skip"

# the image from the Dockerfile: python:3.11-slim when it can be pulled, else a debootstrapped Debian
# bookworm (docs/operations.md, "In a container"); prints the build time and the image size
docker-image: $(STAMP) podman-deps
	PIPESWARM_PODMAN="$(PODMAN)" $(PY) -m tests.container.image build --image $(IMAGE) --torch-wheels $(TORCH_WHEELS)

# the image, then a bootstrap and two joining containers train on loopback; every container removed
docker-test: $(STAMP) podman-deps
	@if command -v podman >/dev/null; then $(MAKE) --no-print-directory docker-image; fi
	PIPESWARM_PODMAN="$(PODMAN)" PIPESWARM_IMAGE=$(IMAGE) $(PY) -m pytest -q -s -p no:cacheprovider -m container tests/container
