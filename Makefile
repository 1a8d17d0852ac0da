# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test slow bench

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

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

bench: $(STAMP)
	$(PY) tests/benchmarks/bench_all.py
