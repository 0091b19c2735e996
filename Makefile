# The two commands: `make run` and `make test`. Everything else supports them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test lint typecheck services test-postgres test-sqlite test-cluster bench docs clean

$(STAMP): pyproject.toml
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { \
	  [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv python3-pip; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## make run: install, migrate, and serve on the embedded default (SQLite file, local RabbitMQ)
run: install
	$(BIN)/queuekeeper migrate
	$(BIN)/queuekeeper serve

services:
	bash scripts/ensure-services.sh

lint: install
	$(BIN)/ruff check src tests migrations bench
	$(BIN)/ruff format --check src tests migrations bench

typecheck: install
	$(BIN)/mypy

test-postgres: install services
	$(BIN)/pytest -q

test-sqlite: install services
	QK_TEST_DB=sqlite $(BIN)/pytest -q

## make test: install, make sure PostgreSQL and RabbitMQ are up, lint, type-check, run the suite
## on PostgreSQL and again on SQLite.
test: install services lint typecheck test-postgres test-sqlite

## make test-cluster: not part of `make test`. Builds a 3-node RabbitMQ cluster on loopback
## beside the main broker (ports 57xx/157xx; needs root and the rabbitmq-server package), runs
## three replicas on PostgreSQL with quorum, then classic, queues while a node and a replica
## are killed; about 10 minutes. Figures: cluster-figures.json.
test-cluster: install services
	QK_CLUSTER=1 $(BIN)/pytest -q -s -p no:cacheprovider tests/cluster

bench: install services
	$(BIN)/python -m bench

## make docs: regenerate the configuration tables of README.md and docs/operations.md
docs: install
	$(BIN)/queuekeeper settings-table --write README.md --write docs/operations.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache queuekeeper.db*
