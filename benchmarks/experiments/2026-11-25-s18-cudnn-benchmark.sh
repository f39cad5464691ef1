#!/usr/bin/env bash
# Session 18: does cudnn.benchmark (cuDNN times its engines per shape instead of taking its
# heuristics' first) change the fp16 margin over dense torch.compile? Each setting in its own process
# (aten's plan cache ignores the flag: a plan found once is reused) with its own decision cache.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s18-cudnn-benchmark.sh MODEL...
source "$(dirname "$0")/../../scripts/device-env.sh"
export SPARSECNN_CACHE=${SPARSECNN_CACHE:-/tmp/sparsecnn-codegen}
run() {  # run SETTING NAME [bench-model flags]
    local setting=$1 name=$2; shift 2
    local flag=""; [ "$setting" = on ] && flag=--cudnn-benchmark
    SPARSECNN_CACHE_DIR=/tmp/decisions-$setting timeout "${RUN_TIMEOUT_S:-280}" python3 -m sparsecnn.cli bench model \
        "$name" --batch 32 --dtype fp16 --modes cudagraph,compile --compile-mode reduce-overhead $flag \
        --out "$OUT/models.jsonl" "$@" >>"$OUT/models.log" 2>&1 || echo "FAILED ($?): $setting $name $*"
    tail -n 8 "$OUT/models.log"
}
for model in "$@"; do
    extra=""; [ "$model" = resnet50 ] && extra="--pattern dlmc-magnitude_pruning"
    for setting in ${SETTINGS:-off on}; do run "$setting" "$model" $extra; done
done
