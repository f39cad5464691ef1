#!/usr/bin/env bash
# Per-layer results of RESULTS.md: sparse backends (their auto configs) on the layer suites at
# sparsity 0.9 against cuDNN fp32 (TF32 off), TF32 and fp16 channels_last in the same run, GPU time
# alone (`bench layers --mode gpu`); first the measured ceilings (copy bandwidth, matmul rates).
#   fp32: DTYPE=fp32 BACKENDS=direct,staged  -> ...-s19-direct-staged-fp32-3b5c6d2.jsonl
#   fp16: DTYPE=fp16 BACKENDS=direct         -> ...-s19-direct-fp16-681e21a.jsonl (dong also at N=1)
# The timeouts fit one 10-minute device call; raise or drop them elsewhere.
# Usage (GPU machine): OUT=out SPARSECNN_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/layer-suites.sh DTYPE BACKENDS
source "$(dirname "$0")/../scripts/device-env.sh"
dtype=$1 backends=$2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "from sparsecnn.bench.roofline import measure_ceilings; import json; print(json.dumps(measure_ceilings('cuda')))" \
    | tee "$OUT/ceilings.json"
bench() {  # bench SECONDS SUITE BATCH [flags]
    local seconds=$1 suite=$2 batch=$3; shift 3
    timeout "$seconds" python3 -m sparsecnn.cli bench layers --suite "$suite" --batch "$batch" --dtype "$dtype" \
        --sparsity 0.9 --backends "$backends" --configs auto --warmup-ms 10 --rep-ms 40 \
        --out "$OUT/layers-$dtype.jsonl" "$@" >>"$OUT/layers-$dtype.log" 2>&1 || echo "$suite N=$batch: stopped (exit $?)"
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
