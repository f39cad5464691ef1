# Session 17: the unrolled kernel compiled as modules of at most 32k non-zeros: ResNet-50 DLMC 0.9 (first, empty caches: cold tuning) at the default 60k limit and VGG16 with
# SPARSECNN_UNROLLED_MAX_NNZ=250000 (fp32, N=32), then the GPU tests of unrolled and layout.
source scripts/device-env.sh
SPARSECNN_CACHE_DIR=/tmp/sc-r50 MODEL_ARGS="resnet50 32 fp32 --pattern dlmc-magnitude_pruning --sparsity 0.9" \
    timeout 200 bash scripts/gpu-session.sh model >/dev/null
SPARSECNN_UNROLLED_MAX_NNZ=250000 SPARSECNN_CACHE_DIR=/tmp/sc-vgg MODEL_ARGS="vgg16 32 fp32" \
    timeout 230 bash scripts/gpu-session.sh model >/dev/null
TEST_FILES="tests/test_unrolled.py tests/test_layout.py" TESTS_TIMEOUT_S=150 bash scripts/gpu-session.sh tests-files
grep -E "^tuning time|^worker jobs|^\| (auto|cudnn)|^### " "$OUT/models.log"
