#!/usr/bin/env bash
# llmgw's production web server on HOST:PORT, in the foreground (make run, the benchmark).
#   LLMGW_WEB_SERVER   granian (default), granian-wsgi (without the front) or gunicorn (gunicorn.conf.py)
#   WEB_CONCURRENCY    worker processes (default: one per core)
#   LLMGW_WEB_THREADS  threads per worker running the WSGI application (default 8)
#   LLMGW_BODY_TIMEOUT seconds a client has to send a body (default 10; then 408)
#   LLMGW_ACCESS_LOG   1: log every request (off by default)
#   DATABASE_POOL_MAX  default 0 here: persistent connections, one per thread
# Both servers run a fixed number of threads, so persistent connections are
# bounded (WEB_CONCURRENCY x LLMGW_WEB_THREADS) without the pool, whose
# checkout check is a round trip to PostgreSQL before every request; the
# persistent connection's check asks the socket instead (llmgw/db.py). On an
# agent's lease, one small statement, that round trip was as much again.
# Granian parses HTTP in Rust: on the agent heartbeat it costs the cores
# about a sixth less than gunicorn's gthread workers (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ADDR="${1:?usage: scripts/serve.sh HOST:PORT}"
PY="${PYTHON:-.venv/bin/python}"
# granian binds with SO_REUSEPORT: refuse a port another program already holds.
"$PY" scripts/port_free.py "$ADDR" || exit 1
# LLMGW_ACCESS_LOG=1 (or true, yes, on) turns granian's access log on; off, only what happened is logged.
case "${LLMGW_ACCESS_LOG:-}" in
1 | [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss] | [Oo][Nn]) access_log=--access-log ;;
*) access_log=--no-access-log ;;
esac
export WEB_CONCURRENCY="${WEB_CONCURRENCY:-$(nproc)}"
# Eight: a status spends most of its time waiting on PostgreSQL and Redis, not on the CPU. At ten
# thousand nodes, four a process left a scale-up's statuses queued for seconds, until live nodes
# were judged unreachable; eight served them (docs/benchmarks.md, the fleet at 10,000 nodes).
export LLMGW_WEB_THREADS="${LLMGW_WEB_THREADS:-8}"
export DATABASE_POOL_MAX="${DATABASE_POOL_MAX:-0}"
export DATABASE_CONN_MAX_AGE="${DATABASE_CONN_MAX_AGE:-600}"
# The listening socket is bound once, by a process that keeps it (llmgw/listen.py): a master or a
# worker that dies is replaced without a connection refused meanwhile.
HOLD=("$PY" -m llmgw.listen hold "$ADDR" --)
# granian's workers each get a socket of their own on the port (SO_REUSEPORT, still the holder's): on
# one socket they all accept on, a fleet's kept-alive connections piled onto one worker.
HOLD_EACH=("$PY" -m llmgw.listen hold "$ADDR" --sockets "$WEB_CONCURRENCY" --)
case "${LLMGW_WEB_SERVER:-granian}" in
granian)
    # ASGI in front of the WSGI application (llmgw/front.py): a body is read whole, within
    # LLMGW_BODY_TIMEOUT, before one of the LLMGW_WEB_THREADS threads is given to it. A worker
    # that dies is started again; one whose master died stops itself (llmgw/orphans.py).
    exec "${HOLD_EACH[@]}" "$PY" -m llmgw.listen serve --interface asgi llmgw.web:app \
        --workers "$WEB_CONCURRENCY" --no-ws --respawn-failed-workers --respawn-interval 1 \
        --log-level "${LLMGW_WEB_LOG_LEVEL:-info}" "$access_log"
    ;;
granian-wsgi)
    # granian serving the WSGI application itself, without the front: no body deadline, no
    # orphan watch. For measuring what the front costs (python -m bench heartbeat), or behind
    # a proxy that buffers request bodies.
    exec "${HOLD_EACH[@]}" "$PY" -m llmgw.listen serve --interface wsgi llmgw.wsgi:application \
        --workers "$WEB_CONCURRENCY" --blocking-threads "$LLMGW_WEB_THREADS" --no-ws \
        --respawn-failed-workers --respawn-interval 1 --log-level "${LLMGW_WEB_LOG_LEVEL:-info}" "$access_log"
    ;;
gunicorn)
    # gunicorn.conf.py binds to the held socket (LLMGW_LISTEN_FD).
    exec "${HOLD[@]}" "$PY" -m gunicorn llmgw.wsgi:application --config gunicorn.conf.py \
        --log-level "${LLMGW_WEB_LOG_LEVEL:-info}"
    ;;
*)
    echo "LLMGW_WEB_SERVER must be granian, granian-wsgi or gunicorn, not ${LLMGW_WEB_SERVER}" >&2
    exit 2
    ;;
esac
