#!/usr/bin/env bash
# Session 18, fourth device call: the other fp16 models against dense torch.compile (reduce-overhead)
# at this commit, then ResNet-50 DLMC fp32 (eager, CUDA graphs) for the 2.5x target after the bias move.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s18-device-call4.sh
session="$(dirname "$0")/../../scripts/gpu-session.sh"
for args in "googlenet 32 fp16" "vgg16 32 fp16" "alexnet-cifar 32 fp16"; do
    MODEL_ARGS="$args --modes cudagraph,compile --compile-mode reduce-overhead" timeout 170 bash "$session" model
done
MODEL_ARGS="resnet50 32 fp32 --pattern dlmc-magnitude_pruning --sparsity 0.9" timeout 200 bash "$session" model
tail -n 60 "${OUT:-out}/models.log" | grep "^|"
