#!/usr/bin/env bash
# The web server, a Celery worker, Celery beat and the gateway, together in the foreground.
# Ctrl-C (or any one of them dying) stops all four.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
ADDR="${LLMGW_LISTEN:-127.0.0.1:8000}"
GATEWAY="${LLMGW_GATEWAY_LISTEN:-127.0.0.1:8080}"
# The web server names the gateway to the agents as where their wakeup long-poll is held (llmgw/settings.py).
export LLMGW_GATEWAY_LISTEN="$GATEWAY"
VAR="${LLMGW_VAR_DIR:-var}"
# The filesystem broker's folders (settings put them under LLMGW_VAR_DIR).
mkdir -p "$VAR/celery/broker" "$VAR/celery/processed" "$VAR/celery/control"

pids=()
cleanup() {
    trap - INT TERM EXIT
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT

$BIN/celery -A llmgw worker --loglevel=INFO --concurrency=2 &
pids+=($!)
$BIN/celery -A llmgw beat --loglevel=INFO &
pids+=($!)
if [ "${DEBUG:-0}" = "1" ]; then
    $BIN/python manage.py runserver --noreload "$ADDR" &
else
    ./scripts/serve.sh "$ADDR" &
fi
web=$!
pids+=("$web")
./scripts/gateway.sh "$GATEWAY" &
pids+=($!)

# "Up" means the web server answers, not that it was started: runserver takes
# seconds to import everything, and a port already taken kills it outright.
deadline=$((SECONDS + ${LLMGW_START_TIMEOUT:-120}))
until $BIN/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "http://$ADDR/admin/login/" 2>/dev/null; do
    if ! kill -0 "$web" 2>/dev/null; then
        echo "llmgw: the web server on $ADDR exited before it answered (see above)" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "llmgw: the web server on $ADDR did not answer within ${LLMGW_START_TIMEOUT:-120} s" >&2
        exit 1
    fi
    sleep 0.5
done
up="llmgw is up: http://$ADDR/admin/, the gateway at http://$GATEWAY/v1/  (Ctrl-C stops all four)"
# A login `manage.py ensure_admin --show-later` has just created: its password is the last thing
# printed before the log, where it is not lost among the migrations and the four servers' start.
if [ -f "$VAR/admin-password.show" ] && [ -f "$VAR/admin-password" ]; then
    { read -r user && read -r password; } <"$VAR/admin-password"
    up+=$'\n'"admin login created: user '$user', password '$password'"
    up+=$'\n'"(kept in $VAR/admin-password, readable by you alone)"
    rm -f "$VAR/admin-password.show"
fi
# One write: the login comes with the line that says the server answers, never apart from it.
printf '%s\n' "$up"
wait -n "${pids[@]}"
