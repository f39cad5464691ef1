#!/usr/bin/env bash
# Issue benchmarks of backend `direct` on an H100/H200, through the harness (cuDNN fp32/tf32/fp16
# in the same run, every candidate config timed, L2 flushed): the suites at 90% sparsity in fp32 and
# fp16 (DLMC magnitude masks for resnet50, random elsewhere), then the sparsity sweep on five layers.
# Usage: OUT=out SPARSECNN_COMMIT=$(git rev-parse --short HEAD) bash scripts/bench-direct.sh [suites|sweep|all]
source "$(dirname "$0")/device-env.sh"
RESULTS=$OUT/direct.jsonl
TIMING="--warmup-ms 10 --rep-ms 30"
what=${1:-all}

bench() { python3 -m sparsecnn.cli bench layers --backends direct --configs all $TIMING --out "$RESULTS" "$@" \
          >>"$OUT/bench-direct.log" 2>&1 || echo "FAILED: bench layers $*"; }

if [ "$what" = suites ] || [ "$what" = all ]; then
    for dtype in fp32 fp16; do
        bench --suite dong --batch 64 --dtype $dtype
        bench --suite dong --batch 1 --dtype $dtype
        bench --suite pietron-vgg16 --batch 128 --dtype $dtype
        bench --suite pietron-r50-1x1 --batch 128 --dtype $dtype
        bench --suite optprune-resnet18-cifar --batch 32 --dtype $dtype
        bench --suite resnet50 --batch 32 --dtype $dtype --pattern dlmc-magnitude_pruning
    done
fi
if [ "$what" = sweep ] || [ "$what" = all ]; then
    for sparsity in 0.5 0.7 0.8 0.9 0.95 0.98; do
        bench --suite dong --batch 64 --layers resnet-conv1,vgg-conv2 --sparsity $sparsity
        bench --suite pietron-vgg16 --batch 128 --layers vgg-512x14-512 --sparsity $sparsity
        bench --suite pietron-r50-1x1 --batch 128 --layers r50-1x1-256-64 --sparsity $sparsity
        bench --suite resnet50 --batch 32 --layers layer3.1.conv2 --sparsity $sparsity --pattern dlmc-magnitude_pruning
    done
fi
grep -h "Geomean" "$OUT/bench-direct.log" | head -n 40
