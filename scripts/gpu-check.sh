#!/usr/bin/env bash
# GPU check, in one call on a machine with an H100/H200: the `gpu`-marked tests, then the baseline
# benchmarks of the foundation issue. Needs torch, triton, tqdm, matplotlib, pytest; installs nothing.
# Results: $OUT/results.jsonl (schema in ARCHITECTURE.md), $OUT/report.md, $OUT/*.png, logs.
# DLMC masks are read from .carry/dlmc-rn50 (copy of ../shared/data/dlmc-rn50) when present.
# Usage: OUT=out SPARSECNN_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu-check.sh [tests|bench|all]
source "$(dirname "$0")/device-env.sh"
BACKENDS=${BACKENDS:-im2col-cublas,im2col-cusparse}
RESULTS=$OUT/results.jsonl
what=${1:-all}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)"

if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 25
fi

bench() { python3 -m sparsecnn.cli bench layers --backends "$BACKENDS" --out "$RESULTS" "$@" >>"$OUT/bench.log" 2>&1 \
          || echo "FAILED: bench layers $*"; }
if [ "$what" = bench ] || [ "$what" = all ]; then
    bench --suite dong --batch 64
    bench --suite dong --batch 1
    bench --suite pietron-vgg16 --batch 128
    bench --suite optprune-resnet18-cifar --batch 32
    bench --suite resnet50 --batch 32 --pattern dlmc-magnitude_pruning --sparsity 0.9
    python3 -m sparsecnn.cli bench model resnet18-cifar --batch 32 --out "$RESULTS" >>"$OUT/bench.log" 2>&1 \
        || echo "FAILED: bench model resnet18-cifar"
    python3 -m sparsecnn.cli bench model resnet50 --batch 32 --pattern dlmc-magnitude_pruning --out "$RESULTS" \
        >>"$OUT/bench.log" 2>&1 || echo "FAILED: bench model resnet50"
    python3 -m sparsecnn.cli demo 2>&1 | tail -n 4
    python3 -m sparsecnn.cli report "$RESULTS" --md "$OUT/report.md" --plot-dir "${PLOT_DIR:-$OUT}" | tail -n 1
    tail -n 60 "$OUT/report.md"
fi
