#!/usr/bin/env bash
# The whole `gpu` test suite on a GPU machine, in chunks that each fit one 10-minute device call.
# Each chunk runs in two passes: the tests that time nothing in parallel ($GPU_TEST_WORKERS pytest-xdist
# workers, default 4, sharing the GPU; 0 or no xdist: serially), then the `timing` ones serially, so
# that no other test runs on the GPU while they measure. Both passes share the chunk's time limit.
# One log per chunk: $OUT/gpu-tests-<chunk>-<commit>.log, and one summary line per pass on stdout.
# Usage: OUT=out SPARSECNN_COMMIT=<hash> bash scripts/gpu-test.sh CHUNK...
#   chunks: generated (codegen, staged, unrolled tests), triton (the other backends' tests), rest
#   (every other test folder), all (the three in turn), or one (every test folder at once: one
#   parallel pass and one timing pass, for a machine whose call can take the whole suite)
#   <hash>: `git rev-parse --short HEAD` of the tree sent (the device's copy of .git can be stale); each
#   log's first line also holds `scripts/tree-digest.sh` of the tree it ran on
source "$(dirname "$0")/device-env.sh"
unset TRITON_INTERPRET
commit=${SPARSECNN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
workers=${GPU_TEST_WORKERS:-4}
if [ "$workers" != 0 ] && ! python3 -c "import xdist" 2>/dev/null; then
    echo "pytest-xdist is not installed: the parallel passes run serially"
    workers=0
fi

chunk_paths() {
    case $1 in
    generated) echo tests/backends/test_{codegen,codegen_fp16,codegen_prefetch,staged,unrolled}.py ;;
    triton) echo "tests/backends --ignore=tests/backends/test_codegen.py --ignore=tests/backends/test_codegen_fp16.py" \
                 "--ignore=tests/backends/test_codegen_prefetch.py --ignore=tests/backends/test_staged.py" \
                 "--ignore=tests/backends/test_unrolled.py" ;;
    rest) echo "tests --ignore=tests/backends" ;;
    one) echo tests ;;
    *) echo "unknown chunk $1 (generated, triton, rest, all, one)" >&2; return 1 ;;
    esac
}

# run_pass CHUNK MARKERS [XDIST OPTIONS...]: one pytest call over $paths, appended to $log, until $deadline.
run_pass() {
    local chunk=$1 markers=$2 start=$SECONDS left=$((deadline - SECONDS)) lines status
    shift 2
    if [ "$left" -le 0 ]; then
        echo "chunk $chunk, $markers: not run (the chunk's ${CHUNK_TIMEOUT_S:-540} s were spent)" | tee -a "$log"
        return
    fi
    lines=$(wc -l <"$log")
    echo "=== $markers${1:+ ($*)}" >>"$log"
    # shellcheck disable=SC2086  # paths holds several words on purpose
    timeout "$left" python3 -m pytest -m "$markers" "$@" -p no:cacheprovider -p no:randomly -q -rfEs \
        --durations=15 -o faulthandler_timeout=120 $paths >>"$log" 2>&1
    status=$?
    echo "chunk $chunk, $markers (exit $status, $((SECONDS - start)) s):" \
        "$(tail -n +"$((lines + 1))" "$log" | grep -E '(passed|failed|error|deselected).* in [0-9.]+s' | tail -n 1)"
}

run_chunk() {
    local chunk=$1 paths log deadline
    paths=$(chunk_paths "$chunk") || return 1
    log="$OUT/gpu-tests-$chunk-$commit.log"
    deadline=$((SECONDS + ${CHUNK_TIMEOUT_S:-540}))
    echo "tree: commit $commit, src/ and tests/ digest $(bash "$(dirname "$0")/tree-digest.sh")" >"$log"
    if [ "$workers" = 0 ]; then
        run_pass "$chunk" "gpu and not timing"
    else
        run_pass "$chunk" "gpu and not timing" -n "$workers"
    fi
    run_pass "$chunk" "gpu and timing"
}

for chunk in "$@"; do
    if [ "$chunk" = all ]; then run_chunk generated; run_chunk triton; run_chunk rest; else run_chunk "$chunk"; fi
done
