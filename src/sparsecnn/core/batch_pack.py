"""The batch-innermost input of the "batch" kernels (direct "batch", staged, unrolled): an (N, C, H, W)
tensor in any layout written as a zero-padded (C, Hp, Wp, N) in one pass (a tiled transpose in Triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecnn.core.batch_inner import is_batch_inner
from sparsecnn.core.triton_launch import launch


# Specialised: N (aligned stores along n), sx_w (unit stride: coalesced loads along w) and step_w;
# the rest would give one compile per feature-map size and padding.
@triton.jit(do_not_specialize=["H", "W", "Hp", "Wp", "pad_h", "pad_w", "rows", "step_h", "sx_n", "sx_c", "sx_h"])
def _pack_batch_inner_kernel(x_ptr, xp_ptr, N, H, W, Hp, Wp, pad_h, pad_w, rows, step_h, step_w,
                             sx_n, sx_c, sx_h, sx_w, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """xp[c, hp, wp, n] = x[n, c, hp - pad_h, wp - pad_w] inside the image, 0 on the border, for hp
    a multiple of step_h and wp of step_w (rows = ceil(Hp / step_h) such hp per channel).

    One program: BLOCK_W written columns x BLOCK_N images of one written padded row (c, hp). x has
    any strides (sx_*); xp is contiguous (C, Hp, Wp, N). Triton stages the tile through shared
    memory, so the loads (along w) and the stores (along n) both coalesce.
    """
    row = tl.program_id(0)   # c * rows + hp // step_h
    c = row // rows
    hp = (row % rows) * step_h
    h = hp - pad_h
    wp = (tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)) * step_w
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = wp - pad_w
    in_row = (wp < Wp)[:, None] & (n < N)[None, :]
    inside = in_row & ((w >= 0) & (w < W))[:, None] & (h >= 0) & (h < H)
    src = x_ptr + n[None, :].to(tl.int64) * sx_n + c.to(tl.int64) * sx_c + h * sx_h + (w * sx_w)[:, None]
    values = tl.load(src, mask=inside, other=0.0)
    dst = ((c.to(tl.int64) * Hp + hp) * Wp + wp)[:, None] * N + n[None, :]
    tl.store(xp_ptr + dst, values, mask=in_row)


def padded_batch_inner(x: torch.Tensor, pad_h: int, pad_w: int, step=(1, 1)) -> torch.Tensor:
    """(N, C, H, W) in any layout -> contiguous (C, H + 2 pad_h, W + 2 pad_w, N) with a zero border.

    step (step_h, step_w): only padded rows that are multiples of step_h and columns of step_w are
    written, the others left uninitialised: what a 1x1 convolution of that stride reads. Its
    stride-2 layers (ResNet's downsampling) then read and write a quarter of the activation.
    """
    n, c, h, w = x.shape
    if pad_h == 0 and pad_w == 0 and is_batch_inner(x):
        return x.permute(1, 2, 3, 0)
    hp, wp = h + 2 * pad_h, w + 2 * pad_w
    padded = x.new_empty(c, hp, wp, n)
    if padded.numel():
        step_h, step_w = step
        rows, cols = triton.cdiv(hp, step_h), triton.cdiv(wp, step_w)
        block_w, block_n = 32, min(32, triton.next_power_of_2(n))
        grid = (c * rows, triton.cdiv(cols, block_w), triton.cdiv(n, block_n))
        launch(_pack_batch_inner_kernel, grid,
               (x, padded, n, h, w, hp, wp, pad_h, pad_w, rows, step_h, step_w, *x.stride()),
               BLOCK_W=block_w, BLOCK_N=block_n, num_warps=4)
    return padded
