# The two set-up commands: `make demo` and `make test`. Both create or update .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.astate-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml $(wildcard setup.py native/*.c native/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "setuptools>=68" wheel "libucx-cu12>=1.18"
	# No build isolation: the C extension compiles against the venv's libucx headers.
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m astate_store.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_scale.py
	$(BIN)/python benchmarks/sync_bench.py

clean:
	rm -rf $(VENV) build *.egg-info astate_store/_ucx*.so
