#!/usr/bin/env bash
# Session 18, third device call: fp16 end to end against dense torch.compile (reduce-overhead) after
# the residual-bias move and the shared input layout (resnet18-cifar twice, resnet50 DLMC once),
# then the GPU tests of the layers the change touches.
# Usage (device): OUT=out SPARSECNN_COMMIT=<hash> bash benchmarks/experiments/2026-11-25-s18-device-call3.sh
here=$(dirname "$0")
SETTINGS=off RUN_TIMEOUT_S=200 bash "$here/2026-11-25-s18-cudnn-benchmark.sh" resnet18-cifar resnet50 resnet18-cifar
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-220} TEST_FILES="tests/test_fuse.py tests/test_nn.py tests/test_autotune.py tests/test_artifact.py" \
    bash "$here/../../scripts/gpu-session.sh" tests-files
