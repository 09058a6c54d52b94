#!/usr/bin/env bash
# The web server, a Celery worker, Celery beat and the gateway, together in the foreground.
# Ctrl-C stops all four. One that dies once the four are up is started again (after 1 s, doubling
# up to 30 s while it keeps dying young); one that dies before the web server first answers is a
# mistake to fix (a port taken, a bad setting): that stops all four, saying which.
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
# A port already held is refused before anything starts: the servers would share it
# (SO_REUSEPORT) or die, and the probe below could be answered by the other program.
$BIN/python scripts/port_free.py "$ADDR" "$GATEWAY" || exit 1

pids=()
# Present once all four are up: from then on, a child that dies is started again.
UP_FLAG="$(mktemp -d)/up"
cleanup() {
    trap - INT TERM EXIT
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$(dirname "$UP_FLAG")"
}
trap cleanup INT TERM EXIT

# supervise NAME COMMAND...: run COMMAND in the background, again whenever it exits once up.
supervise() {
    local name="$1"
    shift
    (
        stop() {
            # The child, or the pause before its next start.
            for job in $(jobs -p); do kill -TERM "$job" 2>/dev/null || true; done
            wait 2>/dev/null || true
            exit 0
        }
        trap stop INT TERM
        delay=1
        while true; do
            started=$SECONDS
            "$@" &
            child=$!
            rc=0
            wait "$child" || rc=$?
            if [ ! -e "$UP_FLAG" ]; then
                exit "$rc"
            fi
            # A child that ran a minute is not crash-looping: its next start is quick again.
            if [ $((SECONDS - started)) -ge 60 ]; then delay=1; fi
            echo "llmgw: the $name exited (status $rc); starting it again in $delay s" >&2
            sleep "$delay" &
            wait $! || true
            delay=$((delay * 2 > 30 ? 30 : delay * 2))
        done
    ) &
    pids+=($!)
}

supervise "Celery worker" $BIN/celery -A llmgw worker --loglevel=INFO --concurrency=2
supervise "Celery beat" $BIN/celery -A llmgw beat --loglevel=INFO
if [ "${DEBUG:-0}" = "1" ]; then
    supervise "web server" $BIN/python manage.py runserver --noreload "$ADDR"
else
    supervise "web server" ./scripts/serve.sh "$ADDR"
fi
web="${pids[-1]}"
supervise gateway ./scripts/gateway.sh "$GATEWAY"

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
touch "$UP_FLAG"
# A child that died between its start and now was not started again: it stops all four.
for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "llmgw: a process exited while starting (see above)" >&2
        exit 1
    fi
done
wait -n "${pids[@]}"
