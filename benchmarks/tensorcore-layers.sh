#!/usr/bin/env bash
# Issue 45 on a GPU machine: backend tensorcore's GPU tests, then the 16 DLMC ResNet-50 layers
# re-pruned into channel-run tiles of 64 rows x 32 channels in index order (0.9), every config, cuDNN in the same run,
# torch.sparse BSR beside it (fp16/bf16). One JSON-lines file per stage under $OUT.
# Usage: OUT=out SPARSECNN_COMMIT=<hash> [PATTERN=...] [CONFIGS=all|auto] bash benchmarks/tensorcore-layers.sh [STAGE...]
#   stages: tests fp16 bf16 tf32 fp16-n1 (default: all, in that order of importance: fp16 first)
source "$(dirname "$0")/../scripts/device-env.sh"
unset TRITON_INTERPRET
commit=${SPARSECNN_COMMIT:-unknown}
layers=$(python3 -c "from sparsecnn.layers.suites import DLMC_STUDY_LAYERS; print(','.join(DLMC_STUDY_LAYERS))")
pattern=${PATTERN:-tiles64x32i-dlmc-magnitude_pruning}

bench() {  # DTYPE BATCH PEERS TIMEOUT_S
    local out="$OUT/tensorcore-$1-n$2-$commit.jsonl"
    timeout "$4" python3 -m sparsecnn.cli bench layers --suite resnet50 --batch "$2" --sparsity 0.9 \
        --pattern "$pattern" --dtype "$1" --backends tensorcore --configs "${CONFIGS:-all}" --layers "$layers" \
        ${3:+--peers "$3"} --out "$out" >"$OUT/bench-$1-n$2.log" 2>&1
    echo "bench $1 N=$2 (exit $?): $(wc -l <"$out" 2>/dev/null) rows"
}

stage() {
    case $1 in
    tests) timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs -x tests/backends/test_tensorcore.py \
               tests/benchmarks/test_peers_torch_bsr.py >"$OUT/gpu-tests-tensorcore-$commit.log" 2>&1
           echo "tests (exit $?): $(tail -n 1 "$OUT/gpu-tests-tensorcore-$commit.log")" ;;
    fp16) bench fp16 32 torch_bsr "${STAGE_TIMEOUT_S:-180}" ;;
    bf16) bench bf16 32 torch_bsr "${STAGE_TIMEOUT_S:-140}" ;;
    tf32) bench tf32 32 "" "${STAGE_TIMEOUT_S:-150}" ;;
    fp16-n1) bench fp16 1 torch_bsr "${STAGE_TIMEOUT_S:-120}" ;;
    *) echo "unknown stage $1" >&2; return 1 ;;
    esac
}

for s in "${@:-fp16 tests bf16 tf32 fp16-n1}"; do for one in $s; do stage "$one"; done; done
