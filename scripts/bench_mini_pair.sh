#!/usr/bin/env bash
# Serving sweeps of the shipped kimi_k3_mini pair at several DSpark draft counts (k=0: no speculation),
# on the held-out prompts, then the best speculative_schedule (mstar-spec-schedule) with a plot:
#   bash scripts/bench_mini_pair.sh OUT_DIR [device] [dtype]      e.g. benchmarks/mini_pair/cpu cpu float32
# Env: CONFIG (default configs/kimi_k3_mini.yaml), KS (draft counts, default "0 2 4 7"), LEVELS (default 1,2,4,8,16,32,64), OUTPUT_LEN (64),
#      REQUESTS (requests per level = REQUESTS x C, default 2), PORT (8123).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench_mini_pair.sh OUT_DIR [device] [dtype]}
DEVICE=${2:-auto}
DTYPE=${3:-float32}
KS=${KS:-0 2 4 7}
LEVELS=${LEVELS:-1,2,4,8,16,32,64}
PORT=${PORT:-8123}
CONFIG=${CONFIG:-configs/kimi_k3_mini.yaml}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
PY=${PYTHON:-python3}
for k in $KS; do
    $PY -m mstar.serve --config "$CONFIG" --port "$PORT" device="$DEVICE" dtype="$DTYPE" \
        model_kwargs.speculative_tokens="$k" "model_kwargs.speculative_schedule={}" >"$OUT/server_k$k.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        curl -sf "$URL/health" >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || { echo "server for k=$k died:"; tail -20 "$OUT/server_k$k.log"; exit 1; }
        sleep 0.5
    done
    echo "== k=$k ($DEVICE, $DTYPE)"
    $PY -m mstar.tools.bench_serve --url "$URL" --prompts mstar/training/heldout_prompts.json \
        --output-len "${OUTPUT_LEN:-64}" --requests-per-level "${REQUESTS:-2}" --concurrency "$LEVELS" \
        --out "$OUT" --name "k$k" --label "kimi_k3_mini, k=$k, $DEVICE $DTYPE"
    kill -TERM $server; wait $server || true
done
$PY -m mstar.tools.spec_schedule "$OUT" --title "kimi_k3_mini + DSpark, $DEVICE $DTYPE"
