#!/usr/bin/env bash
# The web server, a Celery worker, Celery beat and the gateway, together in the foreground.
# Ctrl-C (or any one of them dying) stops all four.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
ADDR="${LLMGW_LISTEN:-127.0.0.1:8000}"
GATEWAY="${LLMGW_GATEWAY_LISTEN:-127.0.0.1:8080}"
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
pids+=($!)
./scripts/gateway.sh "$GATEWAY" &
pids+=($!)
echo "llmgw is up: http://$ADDR/admin/, the gateway at http://$GATEWAY/v1/  (Ctrl-C stops all four)"
wait -n "${pids[@]}"
