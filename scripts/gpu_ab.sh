#!/usr/bin/env bash
# A/B of the working tree against an earlier commit on the lent GPU, in one device call: device time is scarce
# and timings compare only within one machine, so both trees run there, alternately, in the same call.
#
# Here (the machine with git):
#   bash scripts/gpu_ab.sh prepare 5c98a33          # the base tree into .ab_base/ (ignored; ~2 MB)
# then the device tool, carrying .ab_base and .whl:
#   MSTAR_COMMIT=<head> bash scripts/gpu_ab.sh run "<command>" ["<command>" ...]
# Each command runs from the base tree and from this one (base first), with OUT set to its own folder
# ($OUT/<n>_base, $OUT/<n>_head), under a limit of AB_LIMIT seconds each (default 240). The summary
# ($OUT/ab.txt) lists every run's status, wall time and last lines; every output is packed into $OUT/ab.tar.gz
# (the device returns only a few files). e.g.
#   bash scripts/gpu_ab.sh run "python3 -m mstar.tools.emulate_rank --steps prefill --prefill 1024,8192 --reps 3 \
#       --warmup 1 --out \$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
prepare)
    base=${2:?usage: gpu_ab.sh prepare COMMIT}
    rm -rf .ab_base && mkdir .ab_base
    git archive "$base" mstar configs benchmarks scripts | tar x -C .ab_base
    git rev-parse --short "$base" > .ab_base/COMMIT
    echo "base $(cat .ab_base/COMMIT) in .ab_base/: carry it (and .whl) to the device"
    ;;
run)
    shift
    [ -d .ab_base ] || { echo ".ab_base/ is missing: run 'gpu_ab.sh prepare COMMIT' here and carry it"; exit 2; }
    OUT=${OUT:-/tmp/mstar-ab}
    mkdir -p "$OUT"
    # fla-core and humming (.whl/), the config's and server's dependencies (.whl/serve/: pydantic, ...), as
    # gpu_suite.sh installs them
    if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/gpu-site ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/*.whl
    fi
    if ls .whl/serve/*.whl >/dev/null 2>&1 && [ ! -d /tmp/serve-site ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/serve-site .whl/serve/*.whl
    fi
    export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_AUTOTUNING=1
    n=0
    for cmd in "$@"; do
        n=$((n + 1))
        for side in base head; do
            tree=$PWD
            commit=${MSTAR_COMMIT:-head}
            if [ $side = base ]; then tree=$PWD/.ab_base; commit=$(cat .ab_base/COMMIT); fi
            dir=$OUT/${n}_$side
            mkdir -p "$dir"
            start=$SECONDS
            (cd "$tree" && OUT=$dir MSTAR_COMMIT=$commit PYTHONPATH=$tree:/tmp/serve-site:/tmp/gpu-site \
                timeout "${AB_LIMIT:-240}" bash -c "$cmd") > "$dir/log.txt" 2>&1
            rc=$?
            { echo "== $n $side ($commit) rc=$rc $((SECONDS - start))s: $cmd"; tail -n "${AB_TAIL:-12}" "$dir/log.txt"; } \
                | tee -a "$OUT/ab.txt"
        done
    done
    tar czf /tmp/ab.tar.gz -C "$OUT" --exclude ab.txt . && mv /tmp/ab.tar.gz "$OUT/"
    ;;
*)
    echo "usage: gpu_ab.sh prepare COMMIT | gpu_ab.sh run COMMAND..."; exit 2
    ;;
esac
