#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck) over one small layer of each backend and dtype
# (scripts/sanitize_layers.py: fp32, and fp16 where the backend offers it), on a GPU machine.
# One log per tool: $OUT/sanitize-<tool>-<commit>.log, and one summary line per tool on stdout;
# exit 1 if any tool found an error or a layer failed its own check.
# Usage: OUT=out SPARSECNN_COMMIT=<hash> bash scripts/sanitize.sh [TOOL...] [-- BACKEND...]
#   tools: memcheck racecheck initcheck (default: all three); backends: default every registered one.
#   TOOL_TIMEOUT_S (default 540): each tool's run is killed after that many seconds.
source "$(dirname "$0")/device-env.sh"
unset TRITON_INTERPRET
commit=${SPARSECNN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tools=() backends=()
while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; backends=("$@"); break; fi
    tools+=("$1"); shift
done
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck)
# Compile in-process (no worker pools), and keep the generated kernels' disk cache away from the user's.
export SPARSECNN_COMPILE_WORKERS=0 SPARSECNN_BLOCKS_WORKERS=0
export SPARSECNN_CACHE=${SPARSECNN_CACHE:-$(mktemp -d /tmp/sanitize-cache-XXXXXX)}
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
timeout 60 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 60 "$SANITIZER" --version | tail -n 1

# Compile every kernel once outside the sanitizer (warm caches: the sanitized runs time kernels, not nvcc).
timeout "${TOOL_TIMEOUT_S:-540}" python3 scripts/sanitize_layers.py "${backends[@]}" >"$OUT/sanitize-plain-$commit.log" 2>&1
echo "plain (exit $?): $(tail -n 1 "$OUT/sanitize-plain-$commit.log")"

status=0
for tool in "${tools[@]}"; do
    log="$OUT/sanitize-$tool-$commit.log" start=$SECONDS
    case $tool in
    memcheck) args=(--tool memcheck --leak-check no) ;;
    racecheck) args=(--tool racecheck --racecheck-report all) ;;
    # Kernels' reads only: PyTorch's own resize copies (e.g. in unfold) copy uninitialised bytes.
    initcheck) args=(--tool initcheck --check-api-memory-access no) ;;
    *) echo "unknown tool $tool (memcheck, racecheck, initcheck)" >&2; status=1; continue ;;
    esac
    # memcheck and initcheck: one cudaMalloc per tensor (PyTorch's caching allocator off), so an
    # access past a tensor is past its allocation, and an output element left unwritten is an
    # uninitialised read when the check reads it back. racecheck keeps the allocator (poisoned outputs).
    envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); [ "$tool" = racecheck ] && envs=()
    # API errors off: the driver probes (cuGetProcAddress) report harmless ones; ours raise in Python.
    env "${envs[@]}" timeout "${TOOL_TIMEOUT_S:-540}" "$SANITIZER" "${args[@]}" --report-api-errors no --error-exitcode 3 --print-limit 100 \
        python3 scripts/sanitize_layers.py "${backends[@]}" >"$log" 2>&1
    rc=$?
    [ $rc = 0 ] || status=1
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
    echo "$tool (exit $rc, $((SECONDS - start)) s): ${summary:-no sanitizer summary} | $(grep '^sanitize_layers:' "$log" | tail -n 1)"
done
exit $status
