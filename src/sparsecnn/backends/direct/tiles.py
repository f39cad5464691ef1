"""The program -> (channel, pixel tile) mapping shared by the one-channel-per-program direct kernels."""
import triton
import triton.language as tl


@triton.jit
def channel_pixel_coords(K, PQ, Q, BLOCK_PIX: tl.constexpr):
    """(k, group, pix, pix_ok, oh, ow) of this program in a 1-D grid ordered channels fastest, then
    pixel tiles, then image groups: output channel k, image group index, the BLOCK_PIX output pixels
    (flattened p*Q + q), which of them exist, and each pixel's output row and column ([BLOCK_PIX]
    int32). Pixels past the end are clamped to the last one for loading (no masks in the inner
    loops) and must be masked at the store with pix_ok."""
    pid = tl.program_id(0)
    k = pid % K
    tile = (pid // K) % tl.cdiv(PQ, BLOCK_PIX)
    group = pid // (K * tl.cdiv(PQ, BLOCK_PIX))
    pix = tile * BLOCK_PIX + tl.arange(0, BLOCK_PIX)
    pix_ok = pix < PQ
    pix_in = tl.minimum(pix, PQ - 1)
    oh = pix_in // Q
    return k, group, pix, pix_ok, oh, pix_in - oh * Q


@triton.jit
def channel_pixel_tile(K, PQ, Q, row_step, col_step, BLOCK_PIX: tl.constexpr):
    """(k, group, pix, pix_ok, x_pos): `channel_pixel_coords` with each pixel's top-left input
    position x_pos = oh * row_step + ow * col_step (row_step = stride_h * padded width, col_step =
    stride_w) instead of (oh, ow)."""
    k, group, pix, pix_ok, oh, ow = channel_pixel_coords(K, PQ, Q, BLOCK_PIX)
    return k, group, pix, pix_ok, oh * row_step + ow * col_step
