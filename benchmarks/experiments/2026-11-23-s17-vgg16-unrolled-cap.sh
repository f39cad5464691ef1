# Session 17: VGG16 (fp32, N=32, 0.9) with the unrolled kernel's default non-zero limit (60k: none of
# its 28x28 / 14x14 layers qualifies, 118k-236k non-zeros) and with SPARSECNN_UNROLLED_MAX_NNZ=250000
# (they all may), one call, each tuned from an empty decision cache.
source scripts/device-env.sh
SPARSECNN_CACHE_DIR=/tmp/sc-vgg-default MODEL_ARGS="vgg16 32 fp32 --modes eager,cudagraph" \
    timeout 200 bash scripts/gpu-session.sh model
SPARSECNN_UNROLLED_MAX_NNZ=250000 SPARSECNN_CACHE_DIR=/tmp/sc-vgg-raised \
    MODEL_ARGS="vgg16 32 fp32 --modes eager,cudagraph" timeout 360 bash scripts/gpu-session.sh model
grep -E "^tuning time|^worker jobs|^\| (auto|cudnn)" "$OUT/models.log"
