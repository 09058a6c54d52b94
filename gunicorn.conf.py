"""gunicorn's settings for llmgw (read from the working directory by `gunicorn llmgw.wsgi`).

Sized for the agent heartbeat, the busiest request by far: short, CPU-bound
requests that wait on PostgreSQL and Redis for a few round trips each.
Overridable from the environment: GUNICORN_WORKERS (or WEB_CONCURRENCY),
GUNICORN_THREADS, GUNICORN_WORKER_CLASS, GUNICORN_KEEPALIVE. The figures
behind the defaults are in the README (make bench).
"""

import os

_cores = os.cpu_count() or 1

# One process per core, plus one: a process waiting on the database leaves its
# core to another. Threads overlap those waits inside a process.
workers = int(os.environ.get("GUNICORN_WORKERS") or os.environ.get("WEB_CONCURRENCY") or _cores + 1)
worker_class = os.environ.get("GUNICORN_WORKER_CLASS", "gthread")
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
# Agents keep their connection open between heartbeats (every few seconds):
# a new TCP connection per heartbeat would cost more than the heartbeat.
keepalive = int(os.environ.get("GUNICORN_KEEPALIVE", "30"))
# Far more connections than threads can be idle in keep-alive at once.
worker_connections = int(os.environ.get("GUNICORN_WORKER_CONNECTIONS", "10000"))
