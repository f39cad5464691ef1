# Session 17, device call 1: GPU tests of the loader / new_output / Backend-hook refactor, then the
# max-autotune probe (single process with a profile, then autotuning in a subprocess).
source scripts/device-env.sh
TEST_FILES="tests/test_staged.py tests/test_unrolled.py tests/test_layout.py tests/test_artifact.py \
    tests/test_codegen.py" TESTS_TIMEOUT_S=280 bash scripts/gpu-session.sh tests-files
probe=benchmarks/experiments/2026-11-23-s17-maxautotune-probe.py
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout 130 python3 $probe --start 4 --shapes 2 \
    --profile >"$OUT/probe-single.txt" 2>&1; echo "single: exit $?"
TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout 130 \
    python3 $probe --start 4 --shapes 2 >"$OUT/probe-subproc.txt" 2>&1; echo "subproc: exit $?"
grep -E "s$|shapes" "$OUT"/probe-*.txt
