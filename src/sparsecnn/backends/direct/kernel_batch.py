"""Direct sparse convolution with the batch innermost (variant "batch" of `direct_conv`).

Why. The NCHW direct kernel gathers, per non-zero, consecutive output pixels of a row from input
positions shifted by the tap (r, s): the loads are 4-byte, start at any alignment and a warp's 32
of them span two 128-byte L1 lines, so the kernel is bound by L1 wavefronts (~16 fp32 FMAs per
clock per SM). Here the input is padded and laid out (C, Hp, Wp, N): for one non-zero the same
input position of BLOCK_N consecutive images is contiguous and aligned (N % BLOCK_N == 0 and, when
N is a multiple of 16, Triton knows it), so each thread issues 128-bit loads and a warp's load
covers whole lines: about twice the multiply-adds per L1 wavefront.

Algorithm. One program: one output channel k, BLOCK_PIX output pixels, BLOCK_N images. It walks
row k of a `ChunkedCSRWeight` CHUNK non-zeros per step (unrolled, so the step's CHUNK gathers are
in flight together):
    acc[p, n] += w[k, j] * x_padded[base[p] + offset[k, j], n]
The offsets are the NCHW ones (c*Hp*Wp + r*Wp + s): in this layout they count positions of N
elements. Accumulation is float32; output dtype = input dtype.

Layouts. From NCHW or any other layout the launcher writes the padded (C, Hp, Wp, N) input in one
pass (`_pack_batch_inner_kernel`: a tiled transpose, faster than torch's permuted copy). A batch-innermost
input, the view `(N, C, H, W)` with strides (1, H*W*N, W*N, N) that this kernel can write, is read
where it is: without padding as it is, with padding through the masked path (MASKED). There the
offsets are the weight's `masked_codes` (the tap's offset into the unpadded input, with r and s in
its low 6 bits), each program computes per pixel which of the rows and columns r, s < 8 around it
lie in the image (two bitmasks), and each gather is masked by its tap's two bits: taps outside the
image load 0, as the padding would give, with the same FMAs in the same order (bitwise the same
output). Why: the pack is a full read and write of the activation (a noticeable share of a
ResNet-50 forward, where every padded layer's input comes batch-innermost from a 1x1 "batch"
layer), while the mask costs a few integer ops per non-zero (decode, two shifts, an and, a
compare) in a loop bound by L2, not by instructions (see Bound). Where the codes do not fit
(R or S > 8, or an image too large for int32 codes) the input is packed. The output is
(N, K, P, Q), either contiguous NCHW or that batch-innermost view (`DirectConfig.out_layout`),
which a following batch layer reads as it is (packs it only where the codes do not fit); the
residual is read in the output's layout.
Grid: 1-D, channels fastest (programs that run together read the same input tile from L2), then
pixel tiles, then image blocks.

Bound: L2 throughput, with a low L1 hit rate; warps wait on L1TEX loads. Tried and dropped:
programs of 2-8 channels of similar length (one warp each, stepping together) raised the L1 hit
rate but made the kernel L1-throughput bound and no faster. Loading a chunk's weights and offsets
as two vectors instead of CHUNK scalars was never faster. A persistent grid whose programs on one
SM share pixel tiles (per-SM queues via %smid) was mostly slower than this grid.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from sparsecnn.backends.direct.tiles import channel_pixel_coords, channel_pixel_tile
from sparsecnn.core.triton_epilogue import store_epilogue
from sparsecnn.core.triton_launch import launch


@triton.jit
def _tap_bits(top, pad, size):
    """[PIX] int32: bit t (0..7) set iff input row (or column) top + t - pad lies in 0..size-1."""
    lo = tl.minimum(tl.maximum(pad - top, 0), 8)
    hi = tl.minimum(tl.maximum(size + pad - top, lo), 8)
    return (1 << hi) - (1 << lo)


# Only N is specialised (its divisibility by 16 makes the gathers 128-bit): Triton would otherwise
# compile a kernel per combination of the other integers' divisibility and ones (output strides of
# both layouts, feature-map sizes, stride 1 or 2), which the loop does not use, and tuning would
# spend much of its time compiling them.
@triton.jit(do_not_specialize=["K", "PQ", "Q", "row_step", "col_step", "y_stride_n", "y_stride_k", "y_stride_pix",
                               "H", "W", "stride_h", "pad_h", "pad_w"])
def _direct_batch_kernel(
    x_ptr, val_ptr, off_ptr, row_ptr_ptr, bias_ptr, res_ptr, y_ptr,
    N, K, PQ, Q, row_step, col_step, y_stride_n, y_stride_k, y_stride_pix, H, W, stride_h, pad_h, pad_w,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_PIX: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """y[n, k, p] = act(bias[k] + sum_j w[j] * x[pix_base[p] + off[j], n] + residual[n, k, p]).

    Not MASKED: x_ptr is the padded contiguous (C, Hp, Wp, N), off_ptr its offsets; H, W,
    stride_h, pad_h and pad_w are unused. MASKED: x_ptr is the unpadded contiguous (C, H, W, N),
    off_ptr the codes of `ChunkedCSRWeight.masked_codes` for it and (pad_h, pad_w); taps outside
    the image load 0. N % BLOCK_N == 0. y and residual: (N, K, P, Q) at strides (y_stride_n,
    y_stride_k, y_stride_pix). row_step = stride_h * (width of x), col_step = stride_w (in
    positions). val/off/row_ptr: a `ChunkedCSRWeight` (rows padded to multiples of CHUNK).
    """
    if MASKED:
        k, n_block, pix, pix_ok, oh, ow = channel_pixel_coords(K, PQ, Q, BLOCK_PIX)
        x_pos = oh * row_step + ow * col_step   # input position of tap (pad_h, pad_w)
        row_bits = _tap_bits(oh * stride_h, pad_h, H)
        col_bits = _tap_bits(ow * col_step, pad_w, W)
    else:
        k, n_block, pix, pix_ok, x_pos = channel_pixel_tile(K, PQ, Q, row_step, col_step, BLOCK_PIX)
    img = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    x_tile = x_ptr + (x_pos * N)[:, None] + img[None, :]   # [PIX, N] pointers, contiguous along N
    start = tl.load(row_ptr_ptr + k)
    end = tl.load(row_ptr_ptr + k + 1)
    acc = tl.zeros([BLOCK_PIX, BLOCK_N], dtype=tl.float32)
    for j in range(start, end, CHUNK):
        for c in tl.static_range(CHUNK):
            w = tl.load(val_ptr + j + c)
            off = tl.load(off_ptr + j + c)
            if MASKED:  # off holds off * 64 + r * 8 + s; the mask is uniform along N (loads stay 128-bit)
                ok = ((row_bits >> ((off >> 3) & 7)) & (col_bits >> (off & 7)) & 1) != 0
                xv = tl.load(x_tile + (off >> 6) * N, mask=ok[:, None], other=0.0)
            else:
                xv = tl.load(x_tile + off * N)
            acc = tl.fma(xv.to(tl.float32), w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k).to(tl.float32)
    y_offs = pix[:, None] * y_stride_pix + img[None, :].to(tl.int64) * y_stride_n + k * y_stride_k
    mask = pix_ok[:, None] & (img < N)[None, :]
    store_epilogue(acc, y_ptr, res_ptr, y_offs, mask, HAS_RESIDUAL, RELU)


def launch_batch(xp: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, row_ptr: torch.Tensor,
                 bias, residual, out: torch.Tensor, stride, relu: bool,
                 block_pix: int, block_n: int, chunk: int, num_warps: int, padding=(0, 0)) -> None:
    """Launch on the contiguous (C, Hp, Wp, N) input `xp`, writing `out` (N, K, P, Q) at its strides.

    padding (0, 0): xp is padded already and offsets are the weight's offsets for (Hp, Wp). Else
    the masked path: xp is the unpadded (C, H, W, N) input and offsets are the weight's
    `masked_codes` for (H, W) and this padding. residual: None or a tensor with out's strides;
    bias: (K,) contiguous or None. The caller has checked shapes, dtypes and that N % block_n == 0.
    """
    operands = (xp, values, offsets, row_ptr, bias if bias is not None else out,
                residual if residual is not None else out, out)
    grid, args, meta = batch_launch(operands, xp.shape, out.shape, out.stride(), stride, padding, bias is not None,
                                    residual is not None, relu, (block_pix, block_n, chunk, num_warps))
    launch(_direct_batch_kernel, grid, args, **meta)


def batch_launch(operands: tuple, input_shape, out_shape, out_strides, stride, padding, has_bias: bool,
                 has_residual: bool, relu: bool, tile: tuple) -> Tuple[tuple, tuple, dict]:
    """(grid, args, meta) of `_direct_batch_kernel` on the (C, Hp, Wp, N) input of `input_shape`,
    writing an output of `out_shape` (N, K, P, Q) at `out_strides`; padding as in `launch_batch`.

    operands: (xp, values, offsets, row_ptr, bias, residual, out), bias and residual standing in
    as `out` when absent; tensors, or their dtypes for a compile without launch (`compile_ahead`).
    tile: (block_pix, block_n, chunk, num_warps)."""
    _, hp, wp, n = input_shape
    _, k, p, q = out_shape
    stride_n, stride_k, _, stride_pix = out_strides
    block_pix, block_n, chunk, num_warps = tile
    grid = (k * triton.cdiv(p * q, block_pix) * (n // block_n),)
    args = (*operands, n, k, p * q, q, stride[0] * wp, stride[1], stride_n, stride_k, stride_pix, hp, wp, stride[0],
            *padding)
    meta = dict(HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, RELU=relu, MASKED=tuple(padding) != (0, 0),
                BLOCK_PIX=block_pix, BLOCK_N=block_n, CHUNK=chunk, num_warps=num_warps, num_stages=1)
    return grid, args, meta
