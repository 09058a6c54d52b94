# llmgw: `make run` and `make test` are all the set-up a fresh machine needs.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
TEST_ENV := DJANGO_SETTINGS_MODULE=llmgw.settings_test
# makemigrations --check also checks the migration history recorded in the database it is
# given, and `make test` has none until pytest creates its own: handed the absent `llmgw`, the
# check's connection pool retried for its whole timeout, printing "database does not exist"
# warnings before passing. The server's maintenance database always exists and records no
# migrations, so the check of the files runs at once; one plain connection (no pool) for its
# one query. A server that does not answer is still reported.
MIGRATIONS_CHECK_DB ?= postgres://postgres@127.0.0.1:5432/postgres
# llama.cpp's llama-server, which the real-engine tests run: built once per machine into a cache
# outside the checkout (the script says where; see `make llama-server`).
LLAMA_SERVER := $(shell ./scripts/llama-server.sh --path 2>/dev/null)

# pytest-xdist workers for `make test`: the suite mostly waits on the processes it starts, so four
# keep two cores busy (docs/tests.md has the measurements). Each worker has its own test database,
# Redis database (REDIS_URL's + worker number: 12 to 15 by default), cache prefix and var/.
# `make test PYTEST_WORKERS=2` for fewer.
PYTEST_WORKERS := 4
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# OpenAI's JavaScript SDK, for tests/gateway/test_openai_sdk.py's Node smoke test.
OPENAI_JS := 7.59.0
JS_SDK := var/js-sdk

.PHONY: run test lint bench bench-peers faults demo services migrations clean browser prometheus js-sdk llama-server \
	record-llama-server image image-agent test-image podman-compose

# The install is quiet unless something fails: no recipe echoed, nothing printed on success.
$(PY):
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip

# The stamp is touched only once every module imports: an install missing a
# run-time dependency fails here, every time, instead of being marked done and
# failing later at `migrate` (where running `make run` again could not help).
$(VENV)/.installed: requirements.txt pyproject.toml scripts/check_imports.py | $(PY)
	@$(PY) -m pip install --quiet -r requirements.txt
	@PYTHONPATH=. $(PY) scripts/check_imports.py
	@touch $@

$(VENV)/.installed-dev: requirements-dev.txt $(VENV)/.installed
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The web server, a Celery worker, Celery beat and the gateway in the foreground; Ctrl-C stops all four.
run: $(VENV)/.installed
	DEBUG=$${DEBUG:-1} $(PY) manage.py migrate --noinput
	DEBUG=$${DEBUG:-1} $(PY) manage.py ensure_admin --show-later
	DEBUG=$${DEBUG:-1} ./scripts/run-all.sh

# The whole suite against PostgreSQL and Redis on localhost, its end-to-end subset on SQLite, and the linters.
test: $(VENV)/.installed-dev services browser prometheus js-sdk llama-server
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(TEST_ENV) $(PY) manage.py check
	$(TEST_ENV) DATABASE_URL=$(MIGRATIONS_CHECK_DB) DATABASE_POOL_MAX=0 $(PY) manage.py makemigrations --check --dry-run
	$(TEST_ENV) LLMGW_LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/pytest $(PYTEST_XDIST)
	# The end-to-end subset again on the embedded default (SQLite, the file cache; a folder per worker).
	DJANGO_SETTINGS_MODULE=llmgw.settings_test_sqlite LLMGW_LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/pytest $(PYTEST_XDIST) \
		-m e2e --ds=llmgw.settings_test_sqlite

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

services:
	./scripts/services.sh

# Debian's Chromium for the browser tests (Playwright drives it; no browser is ever downloaded).
browser:
	@test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# Debian's Prometheus (with promtool) and Alertmanager (with amtool) for the monitoring tests, installed
# as `browser` installs Chromium. The tests start their own Prometheus on a free port with their own
# configuration and storage; a system service the package may start is never used.
prometheus:
	@test -x /usr/bin/prometheus && test -x /usr/bin/promtool && test -x /usr/bin/amtool || { apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus prometheus-alertmanager; }

# OpenAI's JavaScript SDK from the npm registry into var/, once per version; Node and npm from
# Debian's packages when missing (as `browser` installs Chromium).
js-sdk:
	@command -v node >/dev/null && command -v npm >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm; }
	@if [ ! -f $(JS_SDK)/.installed-$(OPENAI_JS) ]; then \
		mkdir -p $(JS_SDK) && npm install --prefix $(JS_SDK) --no-audit --no-fund --silent openai@$(OPENAI_JS) \
			&& touch $(JS_SDK)/.installed-$(OPENAI_JS); \
	fi

# llama.cpp's llama-server from pinned source (a few minutes the first time, then nothing to do).
# Its build tools are installed the way `browser` installs Chromium, only when missing.
llama-server: | $(PY)
	PYTHON=$(PY) ./scripts/llama-server.sh

# Redo tests/fixtures/engines/llamacpp-11434-*: what this build prints and serves.
record-llama-server: $(VENV)/.installed-dev llama-server
	LLMGW_LLAMA_SERVER=$(LLAMA_SERVER) $(PY) scripts/record_llama_server.py tests/fixtures/engines

migrations: $(VENV)/.installed-dev
	$(TEST_ENV) $(PY) manage.py makemigrations

# Simulated GPU nodes (real agent processes in fixture mode) against `make run`'s server; Ctrl-C stops them.
demo: $(VENV)/.installed
	DEBUG=$${DEBUG:-1} $(PY) manage.py gateway_demo --gateway http://$${LLMGW_GATEWAY_LISTEN:-127.0.0.1:8080}
	DEBUG=$${DEBUG:-1} $(PY) manage.py simulate --nodes $${NODES:-6} --control-plane http://$${LLMGW_LISTEN:-127.0.0.1:8000}

bench: $(VENV)/.installed-dev services
	$(TEST_ENV) $(PY) -m bench

# The gateway beside vLLM's router and LiteLLM's proxy on the same echo replicas; each peer is
# installed from PyPI into a venv of its own under var/peers/ (never the project's). Not needed by make test.
bench-peers: $(VENV)/.installed-dev services
	$(TEST_ENV) $(PY) -m bench peers

# The fault suite (bench/faults.py): a throwaway stack of its own (PostgreSQL, two Redis, make run's
# four processes, simulated nodes) broken in each way docs/operations.md lists, one line each: what
# was done, what was lost. Minutes; not part of make test.
faults: $(VENV)/.installed-dev
	$(TEST_ENV) $(PY) -m bench faults

# The control plane's image (web, gateway, worker, beat, migrate) and the node agent's, built with
# podman from a Debian base made here by debootstrap (scripts/image.sh installs the tools when missing).
image: | $(PY)
	PYTHON=$(PY) ./scripts/image.sh server

image-agent: | $(PY)
	PYTHON=$(PY) ./scripts/image.sh agent

# podman-compose from PyPI into a virtualenv of its own under var/ (Debian bookworm's 1.0.3 gives
# services with network_mode: host a network of their own too, which podman refuses).
PODMAN_COMPOSE := 1.6.0
podman-compose:
	@if [ ! -f var/tools/.installed-podman-compose-$(PODMAN_COMPOSE) ]; then \
		$(PYTHON) -m venv var/tools && var/tools/bin/pip install --quiet podman-compose==$(PODMAN_COMPOSE) \
			&& touch var/tools/.installed-podman-compose-$(PODMAN_COMPOSE); \
	fi

# deploy/compose/compose.yaml started from the image, a simulated fleet, a request through a gateway,
# a kill of each role, and nothing lost (scripts/compose_test.py; a few minutes: not part of make test).
test-image: image podman-compose services $(VENV)/.installed
	$(PY) scripts/compose_test.py

clean:
	rm -rf $(VENV) var test-artifacts
