"""gunicorn's settings for llmgw, when LLMGW_WEB_SERVER=gunicorn (scripts/serve.sh).

Sized for the agent heartbeat, the busiest request by far: short, CPU-bound
requests that wait on PostgreSQL and Redis for a few round trips each.
WEB_CONCURRENCY (processes, default one per core) and LLMGW_WEB_THREADS
(threads per process, default 8: they overlap those waits) as for granian.
LLMGW_ACCESS_LOG=1 logs every request to stderr, as it does for granian.
"""

import os

workers = int(os.environ.get("WEB_CONCURRENCY") or os.cpu_count() or 1)
worker_class = "gthread"
threads = int(os.environ.get("LLMGW_WEB_THREADS") or 8)
# Agents keep their connection open between heartbeats (every few seconds):
# a new TCP connection per heartbeat would cost more than the heartbeat.
keepalive = 30
# Far more connections than threads can be idle in keep-alive at once.
worker_connections = 10000
# Off by default: an agent's lease every few seconds per node would bury what happened.
# scripts/serve.sh runs gunicorn on a socket held apart from it (llmgw/listen.py), which outlives its master.
if os.environ.get("LLMGW_LISTEN_FDS", "").count(",") > 0:
    # Held with --sockets N: gunicorn accepts on one, and the others' share of connections would wait for good.
    raise SystemExit("llmgw: gunicorn accepts on one listening socket: hold it without --sockets")
if os.environ.get("LLMGW_LISTEN_FD"):
    bind = [f"fd://{int(os.environ['LLMGW_LISTEN_FD'])}"]
accesslog = "-" if os.environ.get("LLMGW_ACCESS_LOG", "").strip().lower() in {"1", "true", "yes", "on"} else None
