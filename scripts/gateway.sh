#!/usr/bin/env bash
# The gateway's data plane (granian) on HOST:PORT, in the foreground (make run, the benchmark).
# It also answers the agents' wakeup long-poll, GET /api/v1/agent/wait (agents/wakeup.py).
#   LLMGW_GATEWAY_WORKERS    data plane processes (default 1; they agree through Redis)
#   LLMGW_GATEWAY_INTERFACE  native (default, gateway/native.py: the gateway's own HTTP/1.1 server on
#                            each worker's event loop, about half granian's CPU a request), asgi
#                            (granian: gateway/asgi.py) or rsgi (granian's own interface, gateway/rsgi.py);
#                            the same application and paths on each
#   LLMGW_ACCESS_LOG       1: log every request (off by default)
# A worker or a master that dies is started again, the socket kept open meanwhile (llmgw/listen.py);
# a worker whose master died stops itself (llmgw/orphans.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ADDR="${1:?usage: scripts/gateway.sh HOST:PORT}"
PY="${PYTHON:-.venv/bin/python}"
# granian binds with SO_REUSEPORT: a second gateway on this port would share it with the first
# (traffic split between two control planes). Refuse a port already held instead.
"$PY" scripts/port_free.py "$ADDR" || exit 1
# LLMGW_ACCESS_LOG=1 (or true, yes, on) turns granian's access log on; off, only what happened is logged.
case "${LLMGW_ACCESS_LOG:-}" in
1 | [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss] | [Oo][Nn]) access_log=--access-log ;;
*) access_log=--no-access-log ;;
esac
case "${LLMGW_GATEWAY_INTERFACE:-native}" in
asgi) target=(--interface asgi gateway.asgi:app) ;;
rsgi) target=(--interface rsgi gateway.rsgi:app) ;;
native) ;;
*)
    echo "scripts/gateway.sh: LLMGW_GATEWAY_INTERFACE must be native, asgi or rsgi, not '$LLMGW_GATEWAY_INTERFACE'" >&2
    exit 2
    ;;
esac
# The listening socket is bound once, by a process that keeps it (llmgw/listen.py): a master or a
# worker that dies is replaced without a connection refused meanwhile.
if [ "${LLMGW_GATEWAY_INTERFACE:-native}" = native ]; then
    # Its master starts a worker that died again after a second, as granian's does below.
    [ "$access_log" = --access-log ] || access_log=
    exec "$PY" -m llmgw.listen hold "$ADDR" -- "$PY" -m gateway.native \
        --workers "${LLMGW_GATEWAY_WORKERS:-1}" --log-level "${LLMGW_WEB_LOG_LEVEL:-info}" $access_log
fi
# granian's workers: a socket of their own each (llmgw/listen.py --sockets), as the web's.
exec "$PY" -m llmgw.listen hold "$ADDR" --sockets "${LLMGW_GATEWAY_WORKERS:-1}" -- "$PY" -m llmgw.listen serve "${target[@]}" \
    --workers "${LLMGW_GATEWAY_WORKERS:-1}" --no-ws --respawn-failed-workers --respawn-interval 1 \
    --log-level "${LLMGW_WEB_LOG_LEVEL:-info}" "$access_log"
