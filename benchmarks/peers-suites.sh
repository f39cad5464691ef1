#!/usr/bin/env bash
# RESULTS.md's peer tables (issue 33): our backends (their auto configs) beside the peers on a suite's
# layers, one process per layer so a timeout or a crash costs one layer, not the run; rows appended to
# $OUT/peers-SUITE-DTYPE-nBATCH.jsonl, then `python benchmarks/peers_summary.py FILES` for the tables.
# Peers: Sputnik always, SparseRT for fp32 (found through $SPARSECNN_SPUTNIK_LIB and
# $SPARSECNN_SPARSERT_COMPILE: benchmarks/peers/build_sputnik.sh and build_sparsert.sh).
# Usage (GPU machine): OUT=out bash benchmarks/peers-suites.sh END_S SUITE BATCH DTYPE [PATTERN [LAYER,...]]
#   END_S: seconds after the script's start at which no further layer starts (the last gets what is left)
#   e.g. 180 dong 64 fp32; 160 resnet50 1 fp16 dlmc-magnitude_pruning layer1.0.conv1,layer2.1.conv2
source "$(dirname "$0")/../scripts/device-env.sh"
unset TRITON_INTERPRET
end=$1 suite=$2 batch=$3 dtype=$4 pattern=${5:-random} only=${6:-}
peers=sputnik; [ "$dtype" = fp32 ] && peers=sputnik,sparsert
out="$OUT/peers-$suite-$dtype-n$batch.jsonl" log="$OUT/peers-$suite-$dtype-n$batch.log"
if [ -n "$only" ]; then names=${only//,/ }; else
    names=$(python3 -m sparsecnn.cli layers --suite "$suite" --batch "$batch" | awk -F'|' 'NR > 2 {gsub(/ /, "", $2); print $2}')
fi
for name in $names; do
    left=$((end - SECONDS))
    if [ $left -lt 15 ]; then echo "$suite $dtype N=$batch: $name not reached" | tee -a "$log"; continue; fi
    timeout $left python3 -m sparsecnn.cli bench layers --suite "$suite" --batch "$batch" --dtype "$dtype" \
        --pattern "$pattern" --backends codegen,direct,unrolled,staged --configs auto --peers "$peers" \
        --layers "$name" --out "$out" >>"$log" 2>&1 || echo "$suite $dtype N=$batch: $name exit $?" | tee -a "$log"
done
echo "$suite $dtype N=$batch done at ${SECONDS}s"
