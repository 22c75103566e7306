# teamserve — the two commands are `make demo` and `make test` (README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export TESTBED_CACHE ?= /var/cache/teamserve-testbed
# default: the whole site.yml, then verify.yml and its tests (the engine, the gateway, admission under a
# flood, upgrade.yml's rollback and switch); check: site.yml in check mode on a fresh box and front;
# gpu_host: Debian 12 + 13, the driver upgrade path; caddy: keys, expiry, server full; firewall: the traffic
# matrix across restarts.
# Lanes run side by side, the items of a lane one after the other; "--" waits for every lane before it.
# The first lane of a phase is the one it waits for (default's); the lanes beside it run at nice 10
# (LANES_NICE) and their boxes at Docker CPU weight 128 (LANES_CPU_SHARES), so they use the CPU it leaves
# idle rather than half of it.
# Three phases: default's converge beside gpu_host (the two longest); verify.yml alone (its TTFT/TPOT check
# missed the testbed's targets with gpu_host beside it); then default's testinfra beside the engine-free
# scenarios, which are light next to gpu_host's package installs. `make test` runs lint and unit as a third
# lane of the first phase (TEST_LANES). On 2 cores every phase is CPU-bound: in the last phase they slowed
# the upgrade tests by what they saved the first (docs/timings.md, run Y), and the last phase's timed checks
# (the fair-share bound, the upgrades' load tests) are better off without them.
# Logs: MOLECULE_LOG_DIR/<scenario>.log (make.log for lint and unit).
# default's lane leaves molecule's syntax step out: ansible-lint's syntax-check rule runs
# `ansible-playbook --syntax-check` on site.yml (the scenario's converge playbook) in the lint lane beside it.
MOLECULE_LANES ?= default:destroy+converge+idempotence gpu_host -- default:side-effect -- default:verify+destroy caddy,firewall,check
TEST_LANES ?= $(subst gpu_host --,gpu_host make:lint+unit --,$(MOLECULE_LANES))
MOLECULE_SCENARIOS = $(notdir $(patsubst %/,%,$(dir $(wildcard molecule/*/molecule.yml))))
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
	tools/role_docs.sh --check

# aar-doc writes each role README's part between <!-- BEGIN_ANSIBLE_DOCS --> and <!-- END_ANSIBLE_DOCS -->
# (tools/role_docs.sh, tools/role_variables.md.j2); `lint` fails when a README is not current.
docs: venv ## Regenerate the variable reference in each role's README from meta/argument_specs.yml
	tools/role_docs.sh
.PHONY: docs

# prometheus, promtool, amtool and mtail for the monitoring role's unit tests: the pinned Debian packages, unpacked.
MONITORING_TOOLS := $(CURDIR)/.cache/monitoring-tools
export MONITORING_TOOLS
$(MONITORING_TOOLS)/versions: roles/monitoring/defaults/main.yml tests/tools/monitoring-tools.sh
	tests/tools/monitoring-tools.sh $(MONITORING_TOOLS)

# The second pass runs the cases built only without -race (retry_unbuffered_test.go says why). Then a bounded
# fuzz run of each parser of what clients send (the body's JSON) and of what the engine answers (a JSON
# answer's usage, the event stream): GO_FUZZ_TIME inputs each on one core (-parallel 1: it runs beside
# molecule's first phase), new failures kept in testdata/fuzz/ as Go does. A count, not a duration: with a
# duration, go test fails with "context deadline exceeded" when replaying the cached corpus takes longer
# than the duration (seen with 8s and one worker), which a slow machine and a growing corpus would make red.
GO_FUZZ_TARGETS := FuzzUsageScanner FuzzUsageEvents FuzzRequestCost FuzzWithMember
GO_FUZZ_TIME ?= 5000x
go-test: ## go test -race of the gateway's own Caddy modules (roles/caddy/files/gateway), then a bounded fuzz run
	cd roles/caddy/files/gateway && go test -race -count=1 ./... && go test -count=1 -run 'WithoutRequestBuffers' ./...
	cd roles/caddy/files/gateway && for target in $(GO_FUZZ_TARGETS); do \
	  go test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(GO_FUZZ_TIME) -parallel 1 . | tail -20; done

unit: venv go-test $(MONITORING_TOOLS)/versions ## Unit tests: the planner, the roles' Python code and rules, the gateway's Go modules
	pytest -q tests/capacity tests/unit tests/gateway tests/firewall

molecule: testbed ## Molecule scenarios in lanes and phases (MOLECULE_LANES="caddy" runs one scenario)
	tests/molecule-lanes.sh $(MOLECULE_LANES)

# lint and unit are single-threaded Python for the most part: side by side (make -j2) they use both cores.
# They run as a lane of molecule's first phase (TEST_LANES); their output comes after molecule's, from
# MOLECULE_LOG_DIR/make.log, and a failed item's summary comes once more after it (CI keeps the last lines).
test: venv testbed $(MONITORING_TOOLS)/versions ## Every test: the molecule scenarios on the testbed, lint and unit beside them
	@start=$$SECONDS; tests/molecule-lanes.sh $(TEST_LANES) && rc=0 || rc=$$?; \
	  echo "=== lint and unit (beside molecule's first phase)"; cat "$(MOLECULE_LOG_DIR)/make.log" || true; \
	  [ "$$rc" -eq 0 ] || tests/molecule-lanes.sh --summary || true; \
	  echo "make test: exit $$rc after $$((SECONDS - start)) s"; \
	  exit $$rc

clean: ## Destroy the testbed boxes (the caches stay)
	for s in $(MOLECULE_SCENARIOS); do molecule destroy -s $$s || true; done

.PHONY: help venv testbed demo lint go-test unit molecule test clean
