#!/usr/bin/env bash
# Session 19: paper 003 Table 8 (1-D CNN layer, kernels 2 and 3, N=128) with `direct` against cuDNN,
# at the paper's sparsities 0.77 / 0.83 / 0.875 and at 0.9, fp32 (TF32 off) and fp16, GPU time alone.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s19-table8.sh
source "$(dirname "$0")/../../scripts/device-env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for dtype in fp32 fp16; do
    for sparsity in 0.77 0.83 0.875 0.9; do
        timeout 100 python3 -m sparsecnn.cli bench layers --suite pietron-cnn1d --dtype "$dtype" --sparsity "$sparsity" \
            --backends direct --configs auto --out "$OUT/cnn1d.jsonl" >>"$OUT/cnn1d.log" 2>&1 \
            || echo "$dtype $sparsity: stopped (exit $?)"
        echo "$dtype $sparsity done at ${SECONDS}s"
    done
done
grep -E "^\| cnn1d|^###" "$OUT/cnn1d.log"
