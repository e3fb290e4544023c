# Two commands for a fresh machine (README): `make demo` and `make test`.
# torch==2.13.0 is installed first so pip takes the local CPU build here; the package itself
# only asks for torch>=2.4, so GPU users keep their CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lgvit-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,viz,export]"
	touch $(STAMP)

# Trains lsa_micro_cifar on scikit-learn's handwritten digits, then evaluates it: the last line
# printed is the test top-1 accuracy.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/lgvit train --config configs/digits_lsa_micro_demo.yaml --out runs/demo
	$(VENV)/bin/lgvit eval --checkpoint runs/demo/last --data digits

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_lsa.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
