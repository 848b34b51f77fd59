# attnserve — the two commands a newcomer runs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PRESET ?= small
CKPT ?= checkpoints/default
ARTIFACT ?= artifacts/default
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: run test venv model sample lint typecheck clean

## venv: create .venv and install attnserve with every extra the tests need
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## model: train the default model (stdlib corpus, `small` preset) unless it exists
model: $(CKPT)/config.json
$(CKPT)/config.json: | $(VENV)/.installed
	$(BIN)/attnserve train --data stdlib --preset $(PRESET) --out $(CKPT)

## run: the main job on a fresh machine
run: model
	$(BIN)/attnserve sample --ckpt $(CKPT) --prompt "Return the" --max-new-tokens 80

## test: the whole suite (CI runs exactly this)
test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check model export service tests

typecheck: venv
	$(BIN)/mypy model export service

clean:
	rm -rf $(CKPT) $(ARTIFACT) .pytest_cache .ruff_cache .mypy_cache
