#!/usr/bin/env bash
# One device call for the open issues: the codegen tables (fp32 and fp16), the re-pruning speed
# study through `blocks`, the end-to-end model benchmarks, and the `gpu` tests of TEST_FILES (the
# whole `gpu` suite: scripts/gpu-test.sh). Installs nothing.
# At most 8 files come back from $OUT, so each stage writes one log and one JSON-lines file.
# Usage: OUT=out SPARSECNN_COMMIT=<hash> bash scripts/gpu-session.sh STAGE...
#   <hash>: the commit as `git rev-parse --short HEAD` prints it on the machine that sent the tree,
#   written literally into the command (the device's copy of .git can be stale).
#   stages: model (MODEL_ARGS) models-sweep artefact load-profile tests-files (TEST_FILES) codegen codegen-r50 profile reprune models models-more
SELF=$(realpath "$0")
source "$(dirname "$0")/device-env.sh"
export SPARSECNN_CACHE_DIR=${SPARSECNN_CACHE_DIR:-/tmp/sparsecnn-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys; print('bytecode: dont_write', sys.dont_write_bytecode, 'prefix', sys.pycache_prefix)"

model() {  # model NAME BATCH DTYPE [extra bench-model flags]
    local name=$1 batch=$2 dtype=$3; shift 3
    python3 -m sparsecnn.cli bench model "$name" --batch "$batch" --dtype "$dtype" --out "$OUT/models.jsonl" "$@" \
        >>"$OUT/models.log" 2>&1 || echo "FAILED: bench model $name $batch $dtype $*"
}

for stage in "$@"; do
    [ "$stage" = models ] && { timeout "${MODELS_TIMEOUT_S:-900}" bash "$SELF" models-untimed; echo "stage models done"; continue; }
    [ "$stage" = models-more ] && { timeout "${MODELS_TIMEOUT_S:-900}" bash "$SELF" models-more-untimed; echo "stage models-more done"; continue; }
    [ "$stage" = models-untimed ] && stage=models
    [ "$stage" = models-more-untimed ] && stage=models-more-list
    start=$SECONDS
    case $stage in
    codegen)
        python3 scripts/bench_codegen.py --out "$OUT/codegen.jsonl" --budget-s "${CODEGEN_BUDGET_S:-200}" ${CODEGEN_ARGS:-} \
            >"$OUT/codegen.log" 2>&1 || echo "FAILED: bench_codegen"
        tail -n 40 "$OUT/codegen.log" ;;
    codegen-r50)  # codegen on the DLMC ResNet-50 layers, as far as compile time allows in the limit
        timeout "${CODEGEN_R50_TIMEOUT_S:-150}" python3 -m sparsecnn.cli bench layers --suite resnet50 --batch 32 \
            --pattern dlmc-magnitude_pruning --sparsity 0.9 --backends codegen --out "$OUT/codegen-r50.jsonl" \
            >"$OUT/codegen-r50.log" 2>&1 || echo "codegen-r50: stopped (exit $?)"
        tail -n 5 "$OUT/codegen-r50.log" ;;
    profile)  # where ResNet-50 tuning time goes: a cold Triton cache, then a warm one
        TRITON_CACHE_DIR=$(mktemp -d) timeout "${PROFILE_TIMEOUT_S:-400}" python3 scripts/profile_tuning.py resnet50 \
            --pattern dlmc-magnitude_pruning --batch 32 --runs "${PROFILE_RUNS:-2}" >"$OUT/profile.log" 2>&1 || echo "profile: stopped (exit $?)"
        grep "tuning run" "$OUT/profile.log" ;;
    reprune)
        python3 scripts/reprune_study.py --gpu --quick --seeds 0 --gpu-out "$OUT/reprune.jsonl" \
            >"$OUT/reprune.log" 2>&1 || echo "FAILED: reprune_study"
        tail -n 30 "$OUT/reprune.log" ;;
    models)  # dense torch.compile in its default mode: max-autotune spent ~90 s per conv shape here
        model resnet18-cifar 32 fp32 --modes eager,cudagraph,compile --compile-mode default
        model resnet18-cifar 32 fp16 --modes eager,cudagraph,compile --compile-mode default
        model resnet50 32 fp32 --pattern dlmc-magnitude_pruning --sparsity 0.9
        model resnet50 32 fp16 --pattern dlmc-magnitude_pruning --sparsity 0.9
        model alexnet-cifar 32 fp32
        model resnet50 32 fp32 --pattern dlmc-magnitude_pruning --sparsity 0.95 ;;
    models-more-list)  # the other models, batch sizes and precisions of the e2e issue, most wanted first
        model resnet50 32 fp16 --pattern dlmc-magnitude_pruning --sparsity 0.9
        model resnet50 32 fp32 --pattern dlmc-magnitude_pruning --sparsity 0.95
        model resnet18-cifar 128 fp32
        model resnet18-cifar 1 fp32
        model alexnet-cifar 32 fp32
        model vgg16 32 fp32
        model googlenet 32 fp32 ;;
    model)  # one model run: MODEL_ARGS="NAME BATCH DTYPE [bench-model flags]"
        model ${MODEL_ARGS:?set MODEL_ARGS} ;;
    models-sweep)  # "never slower than dense" at every sparsity: resnet18-cifar, N=32 (SWEEP_DTYPES, SWEEP_SPARSITIES)
        for sparsity in ${SWEEP_SPARSITIES:-0 0.5 0.7 0.8 0.9 0.95 0.98}; do
            for dtype in ${SWEEP_DTYPES:-fp32 fp16}; do
                model resnet18-cifar 32 "$dtype" --sparsity "$sparsity" --modes cudagraph
            done
        done ;;
    artefact)  # tune and write a DLMC ResNet-50 artefact, then load it in two fresh processes: the first under cProfile
        python3 -c "import sys, torch; from sparsecnn.models import build_model; from sparsecnn.prune import apply_dlmc_
m = build_model('resnet50'); apply_dlmc_(m, 'magnitude_pruning-0.9', 0); torch.save(m.state_dict(), sys.argv[1])" \
            /tmp/r50-dlmc.pt >"$OUT/artefact.log" 2>&1
        { python3 -m sparsecnn.cli compile /tmp/r50-dlmc.pt --model resnet50 --input-shape 32,3,224,224 \
            -o /tmp/r50-artefact && echo "first load (cProfile):" \
            && python3 -m cProfile -o /tmp/load-first.prof -m sparsecnn.cli load /tmp/r50-artefact \
            && load_start=$(date +%s.%N) && python3 -m sparsecnn.cli load /tmp/r50-artefact \
            && echo "second load process wall: $(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 2))" "$load_start") s (imports included)"; } \
            >>"$OUT/artefact.log" 2>&1 || echo "artefact: failed"
        python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(70)" \
            /tmp/load-first.prof >"$OUT/load-profile.txt" 2>&1
        grep -E "^(loaded|load time|tuning time|worker jobs|second load|first load)|Error" "$OUT/artefact.log" ;;
    tests-files)  # the gpu tests of TEST_FILES
        timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -v -m gpu -p no:cacheprovider --durations=10 \
            -o faulthandler_timeout=120 ${TEST_FILES:?set TEST_FILES} >"$OUT/gpu-tests.log" 2>&1
        grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -n 20 ;;
    load-profile)  # where loading the artefact of stage `artefact` goes (cProfile; run after `artefact`)
        python3 -m cProfile -o /tmp/load.prof -m sparsecnn.cli load /tmp/r50-artefact >/dev/null 2>&1 \
            || echo "load-profile: load failed"
        python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(60)" \
            /tmp/load.prof >"$OUT/load-profile.txt" 2>&1
        head -n 40 "$OUT/load-profile.txt" | tail -n 30 ;;
    *) echo "unknown stage $stage" ;;
    esac
    echo "stage $stage: $((SECONDS - start)) s"
done
[ -f "$OUT/models.jsonl" ] && python3 -m sparsecnn.cli report "$OUT/models.jsonl" --md "$OUT/models.md" \
    --plot-dir /tmp/plots >/dev/null 2>&1 && cat "$OUT/models.md"
