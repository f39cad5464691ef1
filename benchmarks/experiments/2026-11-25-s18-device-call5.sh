#!/usr/bin/env bash
# Session 18, fifth device call: the batch sizes the end-to-end matrix still lacked (resnet50 DLMC 0.95
# at N=1 and 128, fp32 and fp16; googlenet and vgg16 fp16 at N=1), eager and CUDA graphs, cheapest first.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s18-device-call5.sh
session="$(dirname "$0")/../../scripts/gpu-session.sh"
r50="resnet50 --pattern dlmc-magnitude_pruning --sparsity 0.95"
for args in "1 fp32 $r50" "1 fp16 $r50" "1 fp16 googlenet" "1 fp16 vgg16" "128 fp32 $r50" "128 fp16 $r50"; do
    set -- $args
    batch=$1 dtype=$2 name=$3; shift 3
    MODEL_ARGS="$name $batch $dtype --modes eager,cudagraph $*" timeout 150 bash "$session" model | grep -v "^|"
done
grep -E "^(###|\| (auto|cudnn))" "${OUT:-out}/models.md"
