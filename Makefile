# The README's commands. Each sets the environment up first, so each works on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardlm-installed
SOURCES := pyproject.toml setup.py clients/python/pyproject.toml scripts/install.sh \
	$(wildcard csrc/*.h csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*/*.h)

.PHONY: install test test-fast check proto bench serve gpu-check gpu-wheels llama-server \
	llama-quantize

$(STAMP): $(SOURCES)
	bash scripts/install.sh
	touch $@

install: $(STAMP)

# The whole suite; what CI runs.
test: install
	bash scripts/test.sh

# The inner loop, under 2 minutes on 2 cores: the unit tests of the scheduler, KV, finish, sessions,
# text, config, workers' client, sampling and the kernels against their references. Chosen by path,
# so a new test elsewhere never slows it down; "not slow" keeps out a slow one placed among these.
FAST_TESTS := tests/gateway/batching tests/gateway/kv tests/gateway/text \
	tests/gateway/serve/test_config.py tests/gateway/serve/test_supervisor.py \
	tests/gateway/workers/test_worker_client.py tests/gateway/api/test_runtime.py \
	tests/gateway/test_errors.py tests/worker/ops tests/worker/test_sampling.py \
	tests/worker/test_decode_runner.py

test-fast: install
	bash scripts/test.sh -m "not slow" $(FAST_TESTS)

# Lint, contracts, generated-code freshness and the deployment manifests (CI runs this after
# the tests).
check: install
	$(PY) -m ruff check .
	bash scripts/buf_lint.sh
	$(PY) scripts/gen_proto.py --check
	bash scripts/validate_compose.sh
	$(PY) -m pytest -q tests/deploy/test_k8s.py

proto: install
	$(PY) scripts/gen_proto.py

bench: install
	$(PY) -m bench.run --device $(if $(DEVICE),$(DEVICE),cpu)

# Serve the default model (SmolLM2-135M-Instruct), or a checkpoint, on gRPC (127.0.0.1:50051) and
# OpenAI's HTTP API through SMG (http://127.0.0.1:$(OPENAI_PORT)/v1; OPENAI_PORT= turns it off):
#   make serve [MODEL=/path] [OPENAI_PORT=8000] [ARGS="--tp 2"]
OPENAI_PORT ?= 8000
serve: install
	$(VENV)/bin/shardlm serve $(if $(MODEL),--model $(MODEL)) \
		$(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT)) $(ARGS)

# llama.cpp's own server and quantizer into .bench/bin (git-ignored), for the full-stack
# comparison of `python -m bench.run --model FILE.gguf` and the K-quant files of
# `python -m bench.quantize`; optional, about 8 minutes on 2 cores. Either target builds both.
llama-server llama-quantize: install
	PYTHON=$(PY) bash scripts/build_llama_server.sh

# GPU verification (README, "GPU verification"): make gpu-check [PART=tests|bench|all] [ARGS=...]
# It builds the ops itself, against the torch of $(PY) when .venv exists, else of python3.
gpu-check:
	bash scripts/gpu_check.sh --part $(if $(PART),$(PART),tests) $(ARGS)

# The wheels the GPU machine lacks, into .whl/ (git-ignored), to carry with a device call.
gpu-wheels:
	bash scripts/gpu_wheels.sh
