#!/usr/bin/env bash
# Session 19, third device call: `direct` and `staged` in fp32 (their auto configs) on the suites at N >= 32
# against cuDNN fp32 (TF32 off), GPU time alone; the measured ceilings (copy
# bandwidth, fp16 and fp32 matmul rates) classify each layer as memory- or compute-bound for cuDNN.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s19-device-call3.sh
source "$(dirname "$0")/../../scripts/device-env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "from sparsecnn.bench.roofline import measure_ceilings; import json; print(json.dumps(measure_ceilings('cuda')))" \
    | tee "$OUT/ceilings.json"
bench() {  # bench SECONDS SUITE BATCH [flags]
    local seconds=$1 suite=$2 batch=$3; shift 3
    timeout "$seconds" python3 -m sparsecnn.cli bench layers --suite "$suite" --batch "$batch" --dtype fp32 \
        --sparsity 0.9 --backends direct,staged --configs auto --warmup-ms 10 --rep-ms 40 --out "$OUT/direct-fp32.jsonl" "$@" \
        >>"$OUT/direct-fp32.log" 2>&1 || echo "$suite N=$batch: stopped (exit $?)"
    echo "$suite N=$batch done at ${SECONDS}s"
}
bench 70 dong 64
bench 40 pietron-r50-1x1 128
bench 60 optprune-resnet18-cifar 32
bench 200 resnet50 32 --pattern dlmc-magnitude_pruning
bench 200 pietron-vgg16 128
