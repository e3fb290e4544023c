# Two commands for a fresh machine (README): `make demo` and `make test`.
# The matching pair torch==2.14.1 / torchvision==0.29.1 (PyPI's default build, which runs on
# CPUs too) is installed first so torchvision's compiled ops load; the package itself only asks
# for torch>=2.4 and torchvision>=0.19, so GPU users keep the builds they have.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lgvit-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,viz,export]"
	touch $(STAMP)

# Trains lsa_micro_cifar on scikit-learn's handwritten digits, then evaluates it: the last line
# printed is the test top-1 accuracy.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/lgvit train --config digits_lsa_micro_demo --out runs/demo
	$(VENV)/bin/lgvit eval --checkpoint runs/demo/last --data digits

# One worker per core, one thread each (tests/conftest.py): 12 min instead of 21 on 2 cores,
# where a single worker leaves about 40% of the CPU idle (imports, subprocesses, small ops).
test: $(STAMP)
	$(PY) -m pytest -n auto --maxprocesses 4

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_lsa.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
