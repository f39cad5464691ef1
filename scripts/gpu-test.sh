#!/usr/bin/env bash
# The whole `gpu` test suite on a GPU machine, in chunks that each fit one 10-minute device call.
# One log per chunk: $OUT/gpu-tests-<chunk>-<commit>.log, and one summary line per chunk on stdout.
# Usage: OUT=out SPARSECNN_COMMIT=<hash> bash scripts/gpu-test.sh CHUNK...
#   chunks: generated (codegen, staged, unrolled tests), triton (the other backends' tests), rest
#   (every other test folder), or all (the three in turn)
#   <hash>: `git rev-parse --short HEAD` of the tree sent (the device's copy of .git can be stale)
source "$(dirname "$0")/device-env.sh"
unset TRITON_INTERPRET
commit=${SPARSECNN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

chunk_paths() {
    case $1 in
    generated) echo tests/backends/test_{codegen,codegen_fp16,codegen_prefetch,staged,unrolled}.py ;;
    triton) echo "tests/backends --ignore=tests/backends/test_codegen.py --ignore=tests/backends/test_codegen_fp16.py" \
                 "--ignore=tests/backends/test_codegen_prefetch.py --ignore=tests/backends/test_staged.py" \
                 "--ignore=tests/backends/test_unrolled.py" ;;
    rest) echo "tests --ignore=tests/backends" ;;
    *) echo "unknown chunk $1 (generated, triton, rest, all)" >&2; return 1 ;;
    esac
}

run_chunk() {
    local chunk=$1 paths log start=$SECONDS
    paths=$(chunk_paths "$chunk") || return 1
    log="$OUT/gpu-tests-$chunk-$commit.log"
    # shellcheck disable=SC2086  # paths holds several words on purpose
    timeout "${CHUNK_TIMEOUT_S:-540}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=15 \
        -o faulthandler_timeout=120 $paths >"$log" 2>&1
    echo "chunk $chunk (exit $?, $((SECONDS - start)) s): $(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1)"
}

for chunk in "$@"; do
    if [ "$chunk" = all ]; then run_chunk generated; run_chunk triton; run_chunk rest; else run_chunk "$chunk"; fi
done
