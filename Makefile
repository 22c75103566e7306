# teamserve — the two commands are `make demo` and `make test` (README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export TESTBED_CACHE ?= /var/cache/teamserve-testbed
# default: the whole site.yml on one box, verify.yml, then playbooks/upgrade.yml to a broken engine image
# (rolls back) and to a healthy one; gpu_host: Debian 12 + 13, check mode, the driver upgrade path;
# caddy: key issue/rotate/revoke/expiry, server full; firewall: the traffic matrix across restarts.
# Lanes run side by side, the scenarios of a lane (comma-separated) one after the other. One lane by
# default: with the engine-free scenarios beside it, verify.yml's TTFT/TPOT check missed the testbed's
# targets (TPOT p95 0.168 s against 0.15 s, firewall running beside it). Logs: MOLECULE_LOG_DIR/<scenario>.log.
MOLECULE_LANES ?= default,gpu_host,caddy,firewall
comma := ,
MOLECULE_SCENARIOS = $(subst $(comma), ,$(MOLECULE_LANES))
export MOLECULE_LOG_DIR ?= $(CURDIR)/.cache/molecule-logs

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt pyproject.toml requirements.yml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python tests/check_collections.py requirements.yml
	touch $@

venv: $(VENV)/.installed ## Create the Python venv (pinned requirements, the planner, the collections)

testbed: venv ## Build or reuse the local testbed (Docker engine, images, stand-in repos, registry)
	tests/testbed/up.sh

demo: testbed ## Provision a testbed box with site.yml and print the gateway URL, a key, the plan and the cold start
	molecule converge -s default
	tests/testbed/report.sh

lint: venv ## yamllint, ansible-lint (production profile), ruff and mypy (config: pyproject.toml)
	yamllint --strict .
	ansible-lint --profile production
	ruff check .
	mypy

go-test: ## go test -race of the gateway's in-flight cap module (roles/caddy/files/inflight)
	cd roles/caddy/files/inflight && go test -race -count=1 ./...

unit: venv go-test ## Unit tests: the capacity planner, the roles' Python code, the Go module
	pytest -q tests/capacity tests/unit tests/gateway tests/firewall

molecule: testbed ## Molecule scenarios in lanes (MOLECULE_LANES="default gpu_host,caddy,firewall" runs two side by side)
	tests/molecule-lanes.sh $(MOLECULE_LANES)

test: lint unit molecule ## Every test: lint, unit, then the molecule scenarios on the testbed

clean: ## Destroy the testbed boxes (the caches stay)
	for s in $(MOLECULE_SCENARIOS); do molecule destroy -s $$s || true; done

.PHONY: help venv testbed demo lint go-test unit molecule test clean
