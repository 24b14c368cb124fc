#!/usr/bin/env bash
# The serving sweep, with and without DSpark: for each draft count k in KS, start `mstar-serve` on CONFIG
# (k=0: speculation off), drive it over HTTP with `mstar-bench-serve` at every concurrency level, stop
# it; then compare the runs (`mstar-spec-schedule`: the best draft count per batch size, with a plot).
#   bash scripts/bench_sweep.sh CONFIG OUT_DIR [key=value ...]      (the keys override CONFIG, as mstar-serve's)
# e.g. one node of pruned75 with its DSpark draft (defaults: 1024 random tokens in, 512 out, 8 x C requests):
#   bash scripts/bench_sweep.sh configs/kimi_k3_pruned75_tp8_dspark_sched.yaml benchmarks/pruned75_h200
# the shipped mini pair on its held-out prompts, on the CPU:
#   PROMPTS=mstar/training/heldout_prompts.json OUTPUT_LEN=48 REQUESTS=2 KS="0 3 7" LEVELS=1,4,16,64 \
#       bash scripts/bench_sweep.sh configs/kimi_k3_mini.yaml benchmarks/mini_pair/cpu device=cpu dtype=float32
# Env: KS (draft counts, default "0 7"), LEVELS (default 1,2,4,8,16,32,64), INPUT_LEN (1024) or PROMPTS (a
#      JSON file of text prompts), OUTPUT_LEN (512), REQUESTS (requests per level = REQUESTS x C, default 8),
#      PORT (8123), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: bench_sweep.sh CONFIG OUT_DIR [key=value ...]}
OUT=${2:?usage: bench_sweep.sh CONFIG OUT_DIR [key=value ...]}
shift 2
KS=${KS:-0 7}
LEVELS=${LEVELS:-1,2,4,8,16,32,64}
PORT=${PORT:-8123}
URL=http://127.0.0.1:$PORT
PY=${PYTHON:-python3}
if [ -n "${PROMPTS:-}" ]; then
    workload=(--prompts "$PROMPTS")
    what="prompts from $PROMPTS"
else
    workload=(--input-len "${INPUT_LEN:-1024}")
    what="${INPUT_LEN:-1024} random tokens in"
fi
mkdir -p "$OUT"
name=$(basename "$CONFIG" .yaml)
for k in $KS; do
    $PY -m mstar.serve --config "$CONFIG" --port "$PORT" "$@" \
        model_kwargs.speculative_tokens="$k" "model_kwargs.speculative_schedule={}" >"$OUT/server_k$k.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 1200); do  # a real checkpoint takes minutes to load: the log shows how far it got
        curl -sf "$URL/health" >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || { echo "server for k=$k died:"; tail -20 "$OUT/server_k$k.log"; exit 1; }
        sleep 0.5
    done
    curl -sf "$URL/health" >/dev/null 2>&1 || { echo "server for k=$k not up after 10 minutes"; exit 1; }
    echo "== $name, k=$k, $what ($*)"
    $PY -m mstar.tools.bench_serve --url "$URL" "${workload[@]}" --output-len "${OUTPUT_LEN:-512}" \
        --requests-per-level "${REQUESTS:-8}" --concurrency "$LEVELS" \
        --out "$OUT" --name "k$k" --label "$name, k=$k $*"
    curl -sf "$URL/metrics" >"$OUT/metrics_k$k.txt" || true  # steps by shape, graph or eager; spec counters
    kill -TERM $server; wait $server || true
done
if [ "$(echo $KS | wc -w)" -gt 1 ]; then
    $PY -m mstar.tools.spec_schedule "$OUT" --title "$name + DSpark $*"
fi
