#!/usr/bin/env bash
# The entry point of llmgw's image: its first argument is the role this container plays.
#   web                 the web server (scripts/serve.sh) on LLMGW_LISTEN (default 0.0.0.0:8000)
#   gateway             the gateway (scripts/gateway.sh) on LLMGW_GATEWAY_LISTEN (default 0.0.0.0:8080)
#   worker              a Celery worker, LLMGW_WORKER_CONCURRENCY children (default 2), named
#                       LLMGW_WORKER_NAME (default celery@ the container's host name: workers sharing
#                       the host's network, and so its name, each need their own)
#   beat                Celery beat (every beat waits for the cluster's beat lock: start any number)
#   migrate             apply the database migrations, then exit (a job run before each upgrade)
#   manage ARGS...      any manage.py command (django-admin with llmgw's settings) (ensure_admin, doctor, simulate, ...)
#   health ROLE         exit 0 when this container's ROLE is live: web and gateway ask their own
#                       /readyz, a worker answers Celery's ping; for a probe that runs a command
# Configuration comes from the environment alone (docs/configuration.md). A secret may come from a
# file instead: SECRET_KEY_FILE, SECRET_KEY_FALLBACKS_FILE, DATABASE_URL_FILE, REDIS_URL_FILE, CELERY_BROKER_URL_FILE,
# LLMGW_JOIN_TOKEN_FILE and LLMGW_METRICS_TOKEN_FILE name a file whose content (less a final newline)
# is the variable's value, so secrets need not sit in the container's environment description.
set -euo pipefail
cd "$(dirname "$0")/.."
export DJANGO_SETTINGS_MODULE="${DJANGO_SETTINGS_MODULE:-llmgw.settings}"
PY="${PYTHON:-python}"

from_file() {
    local name=$1 file=$2
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "llmgw: ${name}_FILE names $file, which cannot be read" >&2
            exit 2
        fi
        export "$name=$(cat "$file")"
    fi
}
from_file SECRET_KEY "${SECRET_KEY_FILE:-}"
from_file SECRET_KEY_FALLBACKS "${SECRET_KEY_FALLBACKS_FILE:-}"
from_file DATABASE_URL "${DATABASE_URL_FILE:-}"
from_file REDIS_URL "${REDIS_URL_FILE:-}"
from_file CELERY_BROKER_URL "${CELERY_BROKER_URL_FILE:-}"
from_file LLMGW_JOIN_TOKEN "${LLMGW_JOIN_TOKEN_FILE:-}"
from_file LLMGW_METRICS_TOKEN "${LLMGW_METRICS_TOKEN_FILE:-}"

WEB="${LLMGW_LISTEN:-0.0.0.0:8000}"
GATEWAY="${LLMGW_GATEWAY_LISTEN:-0.0.0.0:8080}"
WORKER="${LLMGW_WORKER_NAME:-celery@$(hostname)}"

# A server's own readiness, asked on the loopback whatever address it listens on.
ready() {
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
        "http://127.0.0.1:${1##*:}/readyz"
}

role="${1:-web}"
shift || true
case "$role" in
web) exec ./scripts/serve.sh "$WEB" ;;
gateway) exec ./scripts/gateway.sh "$GATEWAY" ;;
worker) exec "$PY" -m celery -A llmgw worker --loglevel=INFO --concurrency="${LLMGW_WORKER_CONCURRENCY:-2}" \
    --hostname "$WORKER" "$@" ;;
beat) exec "$PY" -m celery -A llmgw beat --loglevel=INFO "$@" ;;
migrate) exec "$PY" -m django migrate --noinput "$@" ;;
manage) exec "$PY" -m django "$@" ;;
health)
    case "${1:-}" in
    web) ready "$WEB" ;;
    gateway) ready "$GATEWAY" ;;
    worker) exec "$PY" -m celery -A llmgw inspect ping --destination "$WORKER" --timeout 10 >/dev/null ;;
    *)
        echo "usage: health web|gateway|worker" >&2
        exit 2
        ;;
    esac
    ;;
*)
    echo "llmgw: unknown role '$role': web, gateway, worker, beat, migrate, manage ARGS..., health ROLE" >&2
    exit 2
    ;;
esac
