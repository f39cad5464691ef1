#!/usr/bin/env bash
# Session 19, second and third device calls: sparse backends (their auto configs) on the suites of
# issue 3 at sparsity 0.9 against cuDNN, GPU time alone; the measured ceilings (copy bandwidth, fp16
# and fp32 matmul rates) classify each layer as memory- or compute-bound for cuDNN.
#   call 2 (681e21a): DTYPE=fp16 BACKENDS=direct, every suite (dong also at N=1);
#   call 3 (3b5c6d2): DTYPE=fp32 BACKENDS=direct,staged, the suites at N >= 32.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s19-direct-suites.sh DTYPE BACKENDS
source "$(dirname "$0")/../../scripts/device-env.sh"
dtype=$1 backends=$2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "from sparsecnn.bench.roofline import measure_ceilings; import json; print(json.dumps(measure_ceilings('cuda')))" \
    | tee "$OUT/ceilings.json"
bench() {  # bench SECONDS SUITE BATCH [flags]
    local seconds=$1 suite=$2 batch=$3; shift 3
    timeout "$seconds" python3 -m sparsecnn.cli bench layers --suite "$suite" --batch "$batch" --dtype "$dtype" \
        --sparsity 0.9 --backends "$backends" --configs auto --warmup-ms 10 --rep-ms 40 \
        --out "$OUT/direct-$dtype.jsonl" "$@" >>"$OUT/direct-$dtype.log" 2>&1 || echo "$suite N=$batch: stopped (exit $?)"
    echo "$suite N=$batch done at ${SECONDS}s"
}
if [ "$dtype" = fp16 ]; then
    bench 60 dong 1
fi
bench 70 dong 64
bench 40 pietron-r50-1x1 128
bench 60 optprune-resnet18-cifar 32
bench 200 resnet50 32 --pattern dlmc-magnitude_pruning
bench 200 pietron-vgg16 128
