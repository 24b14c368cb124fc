#!/usr/bin/env bash
# The one command for the GPU machine: GPU tests, the served gate and the micro-benchmarks, then a
# summary table. Run there from the repo root (the device tool carries .whl/ with the wheels the
# machine lacks: ../shared/tools/gpu-wheels fla-core==0.6.0 compressed-tensors ...):
#   bash scripts/gpu_suite.sh
# gpu-wheels' serve set lacks what the served path also imports (fastapi >= 0.16x imports opentelemetry at the
# top); add it to .whl/serve once:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl/serve \
#     llguidance==1.9.1 tiktoken prometheus-client httpx httpcore h11 anyio sniffio idna certifi regex click \
#     opentelemetry-api
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mstar-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/*.whl \
        && export PYTHONPATH=/tmp/gpu-site:${PYTHONPATH:-}
fi
# The server's own dependencies (fastapi, uvicorn, pydantic, ...) are not on the image: .whl/serve/.
if ls .whl/serve/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/serve-site .whl/serve/*.whl
fi
BASE_PYTHONPATH=$PWD:/tmp/serve-site
export PYTHONPATH=$PWD:/tmp/serve-site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# fla's chunk_kda autotunes per process (~100 s at a TP8 rank's shapes): later processes reuse the result
export TRITON_CACHE_AUTOTUNING=1
# SUITE picks sections (default: kernels served emulate benches mini; also opt-in: multinode prefix)
# PACK=1 leaves $OUT as summary.txt + suite.tar.gz of everything (the lent device returns only a few files).
# MSTAR_COMMIT=<hash>: the commit the results name where the copy's git metadata lags (the lent device's does).
SUITE=${SUITE:-kernels served emulate benches mini}
want() { [[ " $SUITE " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

declare -a rows
run() {  # run NAME CMD...: record pass/fail and wall time
    local name=$1; shift
    local t0=$(date +%s.%N)
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local dt=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
    rows+=("$(printf '%-28s %-6s %8ss' "$name" "$([ $rc = 0 ] && echo PASS || echo FAIL)" "$dt")")
    tail -n 5 "$OUT/$name.log"
}

want kernels && run gpu-kernel-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kda.py tests/models/kimi_k3/test_gpu_real_dims.py tests/models/kimi_k3/test_packed_experts.py \
    tests/runner/test_gpu_cuda_graphs.py tests/engine/test_gpu_async_scheduling.py tests/engine/test_gpu_structured_output.py \
    tests/speculative/test_gpu_draft_graphs.py tests/resources/test_gpu_transfer.py \
    tests/engine/test_gpu_prompt_logprobs.py \
    tests/training/test_gpu_mini_pair.py \
    $(ls tests/kernels/test_kernel_*.py 2>/dev/null)
want served && run gpu-served-gate python3 -m pytest -q -p no:cacheprovider tests/serve/test_gpu_serving.py
# One TP8 rank of pruned75 (93 layers, random weights) on this GPU: decode (CUDA graphs), verify and
# prefill step times against their floors. EMULATE_ARGS narrows it (e.g. "--steps decode").
want emulate && run emulate-pruned75-rank python3 -m mstar.tools.emulate_rank --out "$OUT/emulate" ${EMULATE_ARGS:-}
want benches && for bench in benchmarks/kernels/bench_*.py; do
    [ -e "$bench" ] && run "$(basename "$bench" .py)" python3 "$bench"
done
# The trained mini pair served over HTTP at DSpark k=0 and 7 (bf16, CUDA graphs: MLA, KDA (fla-core) and the
# MXFP4 experts all take their kernels at the mini's dims; tests/training/test_gpu_mini_pair.py checks it).
want mini && run mini-pair-sweep env KS="${MINI_KS:-0 7}" \
    LEVELS="${MINI_LEVELS:-1,4,16,64}" OUTPUT_LEN=48 REQUESTS=2 PROMPTS=mstar/training/heldout_prompts.json \
    bash scripts/bench_sweep.sh configs/kimi_k3_mini.yaml "$OUT/mini_pair" device=cuda dtype=bfloat16 \
    model_kwargs.cuda_graphs=true
# Opt-in: rank 0 of the full K3 at TP16/EP2 with inter-node collective costs, and one TP8xPP2 stage (47 layers),
# for docs/multi_node.md section 6 (~100 s each to build the weights).
want multinode && run emulate-k3-tp16-ep2 python3 -m mstar.tools.emulate_rank --config kimi_k3_config.json --tp 16 \
    --ep 2 --batch 1,64 --steps decode --comm-latency-us 25 --comm-gb-per-s 50 --reps 5 --warmup 2 --out "$OUT/tp16_ep2"
want multinode && run emulate-k3-tp8-stage python3 -m mstar.tools.emulate_rank --config kimi_k3_config.json --tp 8 \
    --layers 47 --batch 1,64 --steps decode --reps 5 --warmup 2 --out "$OUT/tp8_stage"
# Opt-in: the prefix cache over multi-turn chats with the mini pair (benchmarks/prefix_cache_h200_mini.md).
want prefix && run prefix-cache-multi-turn python3 benchmarks/prefix_cache_multi_turn.py --config configs/kimi_k3_mini.yaml \
    --set dtype=bfloat16 max_seq_len=4096 scheduler.max_num_batched_tokens=512 prefix_cache.kda_snapshot_interval=64 \
    --conversations 2 --turns 5 --first 1024 --message 256 --answer 16 --out "$OUT/prefix_cache_multi_turn.md"

echo
echo "== summary =="
{ printf '%-28s %-6s %9s\n' check result wall; for r in "${rows[@]}"; do echo "$r"; done; } | tee "$OUT/summary.txt"
if [ "${PACK:-0}" = 1 ]; then
    tar czf /tmp/suite.tar.gz -C "$OUT" --exclude summary.txt . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
        && mv /tmp/suite.tar.gz "$OUT/"
fi
