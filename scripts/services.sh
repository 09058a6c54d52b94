#!/usr/bin/env bash
# Start PostgreSQL and Redis on localhost if they are installed but stopped,
# then wait until both answer. Used by `make test` and `make bench`.
set -euo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
    if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
        for version in $(ls /etc/postgresql); do
            echo "starting PostgreSQL $version"
            pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
        done
    else
        echo "PostgreSQL is not running on 127.0.0.1:5432 and is not installed here" >&2
        exit 1
    fi
fi
if ! redis_up; then
    if command -v redis-server >/dev/null; then
        echo "starting Redis"
        mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
        redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
            --dir "$(test -w /var/lib/redis && echo /var/lib/redis || echo /tmp)" \
            --logfile "$(test -w /var/log/redis && echo /var/log/redis/llmgw.log || echo /tmp/redis-llmgw.log)"
    else
        echo "Redis is not running on 127.0.0.1:6379 and is not installed here" >&2
        exit 1
    fi
fi
for _ in $(seq 1 30); do
    if pg_up && redis_up; then
        exit 0
    fi
    sleep 1
done
echo "PostgreSQL or Redis did not come up" >&2
exit 1
