#!/usr/bin/env bash
# Locust smoke run: start `pagedserve serve` (demo model, private redis-server) on a free
# port, wait for /ready, stream 16-token chat completions for ~25 s with 2 users, and fail
# when any request failed or none succeeded. The server is always stopped (trap).
set -euo pipefail
cd "$(dirname "$0")/.."

READY_TIMEOUT_S="${READY_TIMEOUT_S:-180}"
RUN_TIME="${LOCUST_SMOKE_RUN_TIME:-25s}"
work="$(mktemp -d)"
port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
url="http://127.0.0.1:$port"
server_pid=""

stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    # serve runs redis-server, a worker and a gateway: stop its whole process group.
    kill -TERM -- "-$server_pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap stop_server EXIT
trap 'exit 143' INT TERM  # so that the EXIT trap runs on interruption too

is_ready() {
  python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$url/ready" 2>/dev/null
}

# Compile the kernels first (cached), so the /ready timeout does not include a cold build.
python -m cuda_ext.build | sed 's/^/   /'
echo "   starting pagedserve serve on $url"
# A small KV pool: the default takes half of the free memory, too much for a shared CI machine.
setsid pagedserve serve --host 127.0.0.1 --port "$port" --kv-cache-memory-bytes 268435456 \
  > "$work/server.log" 2>&1 &
server_pid=$!

SECONDS=0
next_note=0
until is_ready; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "!! pagedserve serve exited before it was ready:"; tail -n 40 "$work/server.log"; exit 1
  fi
  if [ "$SECONDS" -ge "$READY_TIMEOUT_S" ]; then
    echo "!! not ready after ${READY_TIMEOUT_S}s:"; tail -n 40 "$work/server.log"; exit 1
  fi
  if [ "$SECONDS" -ge "$next_note" ]; then
    echo "   waiting for $url/ready (${SECONDS}s)"; next_note=$((SECONDS + 10))
  fi
  sleep 1
done
echo "   ready after ${SECONDS}s; locust: 2 users for $RUN_TIME"

status=0
locust -f loadtest/locustfile.py --headless --only-summary -H "$url" -u 2 -r 2 -t "$RUN_TIME" \
  --stop-timeout 30 --max-tokens 16 --ignore-eos --prompt-words 16 --think-time-max 0.2 \
  --csv "$work/smoke" < /dev/null || status=$?  # CI may close stdin, which locust's key listener reads
# Independent of locust's exit code: read its CSV and demand chat requests, none failed, and
# streamed content (a TTFT sample).
python - "$work/smoke_stats.csv" <<'PY' || status=1
import csv, sys
rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(sys.argv[1]))}
def count(kind, column="Request Count"):
    row = rows.get((kind, "/v1/chat/completions"))
    return int(row[column]) if row else 0
requests, failures, first_tokens = count("POST"), count("POST", "Failure Count"), count("TTFT")
print(f"   smoke: {requests} chat completions streamed, {failures} failed, {first_tokens} with content")
sys.exit(0 if requests > 0 and failures == 0 and first_tokens > 0 else 1)
PY
if [ "$status" -ne 0 ]; then
  echo "!! locust smoke run failed; server log tail:"; tail -n 40 "$work/server.log"
fi
exit "$status"
