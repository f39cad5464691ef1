"""Direct sparse convolution (UnSparse-Opt, paper 003 Algorithm 4) in Triton.

Algorithm. Each program computes a [BLOCK_PIX output pixels, SUB_BATCH images, BLOCK_K channels]
tile. It walks the channels' non-zeros; per step it loads each channel's weight and precomputed
input offset once and reuses them for SUB_BATCH images (the paper's sbS) and BLOCK_PIX pixels:
    acc[p, n, k] += w[k, j] * x_padded[n, base[p] + offset[k, j]]
The per-pixel base (top-left input of the output pixel) and the per-image pointers are computed once
per program, so the inner loop is one address computation, one load and one FMA per multiply-add
(sm_90 SASS: ~3.3-3.5 instructions per FMA for ELL in fp32, one more for fp16/bf16 conversion).

Expected bound. Each load of a warp reads 32 consecutive inputs at an arbitrary alignment, which
spans two 128-byte L1 lines: about two L1 wavefronts per 32 multiply-adds, i.e. ~16 fp32 FMAs per
clock per SM, well below the FMA units: the kernel is L1-throughput bound. In fp16 a warp's load
is 64 bytes, one line about half the time (~1.5 wavefronts).

Input layout. The kernel reads a zero-padded, contiguous NCHW input: for one non-zero, consecutive
output pixels of a row read consecutive inputs (stride 1 when stride_w = 1), so loads coalesce. In
channels_last the same pixels are C elements apart (one 32-byte sector per 4-byte load, 8x the
traffic). So the launcher converts any other layout (channels_last, non-contiguous) to padded
NCHW; with padding > 0 this is the same single copy that pads the input (see backends/direct/format.py for
why padding beats bounds checks). The output is always contiguous NCHW.

L1 reuse. Rows are stored in increasing column (c, r, s) order, so the BLOCK_K channels of a
program advance through the input channels roughly together: at any step they read a narrow window
of input channels of the same pixel tile, which stays in L1 and serves ~BLOCK_K * R * S * density
loads per fetch. BLOCK_K = 1 (the paper's layout) leaves that reuse to L2.

Grid order: 1-D, channel blocks fastest, then pixel tiles, then image groups. Programs with
consecutive ids start together and read the same input tile, so it comes from DRAM once and from
L2 for the other channel blocks; neighbouring pixel tiles share their halo rows next.

Variants: "ell" (`UniformELLWeight`: one loop bound L, weights of a step contiguous across channels)
and "csr" (`OffsetCSRWeight`: channels in decreasing-nnz order, each block runs to its longest
row, shorter rows masked). Accumulation is float32; output dtype = input dtype. Offsets within
an image are int32 (the launcher checks C*Hp*Wp and K*P*Q fit); image base offsets are int64.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparsecnn.backends.direct.format import (
    ChunkedCSRWeight,
    OffsetCSRWeight,
    UniformELLWeight,
)
from sparsecnn.backends.direct.kernel_batch import launch_batch
from sparsecnn.backends.direct.tiles import channel_pixel_tile
from sparsecnn.core import device
from sparsecnn.core.batch_inner import is_batch_inner, new_output
from sparsecnn.core.batch_pack import padded_batch_inner
from sparsecnn.core.checks import (
    check_kernel_shape,
    check_pow2_field,
    check_residual,
    check_triton_input,
    config_from_dict,
    current_device,
    launch_spec,
    pow2_at_least,
    stride_padding,
)
from sparsecnn.core.offsets import INT32_MAX
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_epilogue import store_epilogue
from sparsecnn.core.triton_launch import launch

DirectWeight = Union[ChunkedCSRWeight, UniformELLWeight, OffsetCSRWeight]
VARIANTS = ("chunk", "ell", "csr", "batch")
OUT_LAYOUTS = ("nchw", "batch_inner")
_CHUNKED_VARIANTS = ("chunk", "batch")  # one channel per program, on a `ChunkedCSRWeight`
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ACC_PER_THREAD = 128  # beyond this the accumulators alone spill registers


@triton.jit
def _direct_conv_kernel(
    x_ptr, val_ptr, off_ptr, row_ptr_ptr, row_order_ptr, bias_ptr, res_ptr, y_ptr,
    N, K, PQ, Q, row_step, col_step, x_img_stride, y_img_stride,
    ell_width, ell_stride_k, ell_stride_j,
    CSR: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    RELU: tl.constexpr,
    BLOCK_PIX: tl.constexpr, BLOCK_K: tl.constexpr, SUB_BATCH: tl.constexpr,
):
    """y[n, k, p] = act(bias[k] + sum_j w[k, j] * x[n, pix_base[p] + off[k, j]] + residual[n, k, p]).

    One program: a [BLOCK_PIX, SUB_BATCH, BLOCK_K] tile of (pixel, image, channel).

    x_ptr: padded contiguous (N, C, Hp, Wp); y_ptr and res_ptr: contiguous (N, K, P, Q); act is
    ReLU when RELU, else the identity.
    ELL: val/off are (K, ell_width) with strides (ell_stride_k, ell_stride_j).
    CSR: val/off are (nnz,), rows delimited by row_ptr (K + 1,), processed in row_order (K,).
    EVEN_K: K % BLOCK_K == 0 (no channel masks).
    row_step = stride_h * Wp and col_step = stride_w: input distance between output rows / columns.
    """
    pid = tl.program_id(0)
    num_kb = tl.cdiv(K, BLOCK_K)
    num_tiles = tl.cdiv(PQ, BLOCK_PIX)
    kb = pid % num_kb
    tile = (pid // num_kb) % num_tiles
    group = pid // (num_kb * num_tiles)

    # Pixels and images past the end are clamped to valid ones for loading (no masks in the inner
    # loop) and masked only at the store.
    pix = tile * BLOCK_PIX + tl.arange(0, BLOCK_PIX)
    pix_ok = pix < PQ
    pix_in = tl.minimum(pix, PQ - 1)
    oh = pix_in // Q
    x_pix = oh * row_step + (pix_in - oh * Q) * col_step                  # [PIX] int32
    img = group * SUB_BATCH + tl.arange(0, SUB_BATCH)
    img_ok = img < N
    img_in = tl.minimum(img, N - 1).to(tl.int64)
    x_tile = x_ptr + x_pix[:, None] + (img_in * x_img_stride)[None, :]   # [PIX, SB] pointers

    slot = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    slot_ok = slot < K
    if CSR:
        chan = tl.load(row_order_ptr + tl.minimum(slot, K - 1))
        start = tl.load(row_ptr_ptr + chan)
        nnz = tl.where(slot_ok, tl.load(row_ptr_ptr + chan + 1) - start, 0)
        n_steps = tl.max(nnz, axis=0)
    else:
        chan = slot
        start = slot * ell_stride_k
        n_steps = ell_width

    # Pixels are dim 0: Triton orders a layout by pointer contiguity and, on ties (the gathered
    # offsets hide it), by dimension index, so this keeps consecutive lanes on consecutive pixels
    # (coalesced loads) and gives the store the same layout (no shared-memory conversion). With
    # channels first, Triton 3.6 put lanes across channels: uncoalesced gathers.
    acc = tl.zeros([BLOCK_PIX, SUB_BATCH, BLOCK_K], dtype=tl.float32)
    for j in range(0, n_steps):
        if CSR:
            step_ok = j < nnz
            w = tl.load(val_ptr + (start + j), mask=step_ok, other=0.0)
            off = tl.load(off_ptr + (start + j), mask=step_ok, other=0)
        elif EVEN_K:  # no mask: the predicated loads would need their registers zeroed every step
            w = tl.load(val_ptr + start + j * ell_stride_j)
            off = tl.load(off_ptr + start + j * ell_stride_j)
        else:
            w = tl.load(val_ptr + start + j * ell_stride_j, mask=slot_ok, other=0.0)
            off = tl.load(off_ptr + start + j * ell_stride_j, mask=slot_ok, other=0)
        # Masked slots load offset 0: a valid address, multiplied by weight 0.
        xv = tl.load(x_tile[:, :, None] + off[None, None, :])
        acc = tl.fma(w[None, None, :], xv.to(tl.float32), acc)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + chan, mask=slot_ok, other=0.0).to(tl.float32)[None, None, :]
    y_offs = pix[:, None, None] + (img_in * y_img_stride)[None, :, None] + (chan * PQ)[None, None, :]
    mask = pix_ok[:, None, None] & img_ok[None, :, None] & slot_ok[None, None, :]
    store_epilogue(acc, y_ptr, res_ptr, y_offs, mask, HAS_RESIDUAL, RELU)


# PQ and y_img_stride stay specialised (their divisibility by 16 lets the store of consecutive
# pixels vectorise); the other integers only feed address arithmetic of gathers, and specialising
# them would compile one kernel per layer shape.
@triton.jit(do_not_specialize=["N", "K", "Q", "row_step", "col_step", "x_img_stride"])
def _direct_chunk_kernel(
    x_ptr, val_ptr, off_ptr, row_ptr_ptr, bias_ptr, res_ptr, y_ptr,
    N, K, PQ, Q, row_step, col_step, x_img_stride, y_img_stride,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr,
    BLOCK_PIX: tl.constexpr, SUB_BATCH: tl.constexpr, CHUNK: tl.constexpr,
):
    """Variant "chunk": one channel per program, non-zeros consumed CHUNK at a time.

    y[n, k, p] = act(bias[k] + sum_j w[j] * x[n, pix_base[p] + off[j]] + residual[n, k, p]) over
    row k of a `ChunkedCSRWeight` (rows padded to multiples of CHUNK). Each step loads CHUNK weights and
    offsets with one vector load each and gathers a [BLOCK_PIX, SUB_BATCH, CHUNK] input tile, so
    CHUNK independent loads per thread are in flight instead of one load that waits on the
    previous step's offset load (what limits the one-non-zero-per-step loop).
    """
    k, group, pix, pix_ok, x_pix = channel_pixel_tile(K, PQ, Q, row_step, col_step, BLOCK_PIX)
    img = group * SUB_BATCH + tl.arange(0, SUB_BATCH)
    img_ok = img < N
    img_in = tl.minimum(img, N - 1).to(tl.int64)
    x_tile = x_ptr + x_pix[:, None] + (img_in * x_img_stride)[None, :]   # [PIX, SB] pointers
    start = tl.load(row_ptr_ptr + k)
    end = tl.load(row_ptr_ptr + k + 1)
    acc = tl.zeros([BLOCK_PIX, SUB_BATCH], dtype=tl.float32)
    for j in range(start, end, CHUNK):
        w = tl.load(val_ptr + j + tl.arange(0, CHUNK))
        off = tl.load(off_ptr + j + tl.arange(0, CHUNK))
        xv = tl.load(x_tile[:, :, None] + off[None, None, :]).to(tl.float32)
        acc += tl.sum(xv * w[None, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k).to(tl.float32)
    y_offs = pix[:, None] + (img_in * y_img_stride)[None, :] + k * PQ
    mask = pix_ok[:, None] & img_ok[None, :]
    store_epilogue(acc, y_ptr, res_ptr, y_offs, mask, HAS_RESIDUAL, RELU)


@dataclasses.dataclass(frozen=True)
class DirectConfig:
    """Launch parameters of the direct kernel.

    block_pix: output pixels per program (power of two, 16..1024); block_k: output channels per
    program (power of two, 1..64); sub_batch: images per program (the paper's sbS: 1, 2, 4, 8);
    num_warps: 1, 2, 4, 8; num_stages: Triton software-pipelining depth (1..4; the loop has no
    tl.dot, so Triton does not pipeline it and 1 is the expected choice); variant: "chunk", "ell"
    or "csr", or "batch" (`kernel_batch`: batch-innermost input, sub_batch = images per program,
    1..64, a divisor of N, and block_pix from 1); chunk: non-zeros per step of "chunk" and "batch"
    (power of two, 4..32; the other variants ignore it). "chunk" and "batch" compute one channel per
    program, so they need block_k = 1. out_layout: the layout of a new output, "nchw" (contiguous)
    or, for "batch" only, "batch_inner" ((N, K, P, Q) stored as (K, P, Q, N), which a following
    "batch" layer reads without a transpose); not tuned: `tuning.layout` sets it between batch layers.
    """

    block_pix: int = 128
    block_k: int = 16
    sub_batch: int = 2
    num_warps: int = 4
    num_stages: int = 1
    variant: str = "ell"
    chunk: int = 8
    out_layout: str = "nchw"

    def __post_init__(self):
        batch = self.variant == "batch"
        check_pow2_field("DirectConfig", "block_pix", self.block_pix, 1 if batch else 16, 1024)
        check_pow2_field("DirectConfig", "block_k", self.block_k, 1, 64)
        check_pow2_field("DirectConfig", "sub_batch", self.sub_batch, 1, 64 if batch else 8)
        check_pow2_field("DirectConfig", "num_warps", self.num_warps, 1, 8)
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 4:
            raise ValueError(f"DirectConfig.num_stages must be an int in 1..4, got {self.num_stages!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"DirectConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        check_pow2_field("DirectConfig", "chunk", self.chunk, 4, 32)
        if self.out_layout not in OUT_LAYOUTS or (self.out_layout != "nchw" and not batch):
            raise ValueError(f"DirectConfig.out_layout must be one of {OUT_LAYOUTS} ('batch_inner' only for variant "
                             f"'batch'), got {self.out_layout!r} with variant {self.variant!r}")
        if self.variant in _CHUNKED_VARIANTS and self.block_k != 1:
            raise ValueError(f"DirectConfig.block_k must be 1 for variant {self.variant!r}, got {self.block_k}")
        per_thread = self.block_k * self.sub_batch * self.block_pix // (32 * self.num_warps)
        if per_thread > _MAX_ACC_PER_THREAD:
            raise ValueError(f"DirectConfig.num_warps={self.num_warps} too few: block_k * sub_batch * block_pix"
                             f" = {self.block_k * self.sub_batch * self.block_pix} gives {per_thread} "
                             f"accumulators per thread (max {_MAX_ACC_PER_THREAD})")

    @classmethod
    def from_dict(cls, saved: dict) -> "DirectConfig":
        """Rebuild from `dataclasses.asdict` output (unknown keys are an error)."""
        return config_from_dict(cls, saved)


_PROGRAMS_PER_SM = 8  # fills the machine, evens out the tail


def target_programs(props=None) -> int:
    """Programs the default config aims for on `props` (`device.resolve`: None is the current GPU,
    an H100 without one): `_PROGRAMS_PER_SM` per SM rounded down to a power of two (1056 -> 1024
    on a 132-SM H100/H200, 864 -> 512 on a 108-SM A100)."""
    wanted = _PROGRAMS_PER_SM * device.resolve(props).sm_count
    return 1 << (wanted.bit_length() - 1)


def _warps_for(tile: int, block_k: int, acc_per_thread: int) -> int:
    """num_warps giving ~acc_per_thread accumulators per thread, with block_k < 32 * num_warps.

    The latter keeps Triton loading a step's block_k weights in the broadcast layout (each thread
    holds all of them); a vector as large as the thread count goes through shared memory instead.
    """
    return min(8, max(1, tile // (32 * acc_per_thread), pow2_at_least(block_k) // 16))


def _sized(spec: ConvSpec, block_pix: int, block_k: int, sub_batch: int, variant: str,
           acc_per_thread: int = 32) -> DirectConfig:
    """A valid config near the given sizes: clamped to the layer, with num_warps from `_warps_for`."""
    block_pix = min(max(block_pix, 16), 1024, max(16, pow2_at_least(spec.P * spec.Q)))
    block_k = min(max(block_k, 1), 64, pow2_at_least(spec.K))
    sub_batch = min(max(sub_batch, 1), 8, pow2_at_least(max(spec.N, 1)))
    while block_pix * block_k * sub_batch > 32 * 8 * _MAX_ACC_PER_THREAD:  # too big even at 8 warps
        if sub_batch > 1:
            sub_batch //= 2
        else:
            block_pix //= 2
    num_warps = _warps_for(block_pix * block_k * sub_batch, block_k, acc_per_thread)
    return DirectConfig(block_pix, block_k, sub_batch, num_warps, 1, variant)


def _num_programs(spec: ConvSpec, block_pix: int, block_k: int, sub_batch: int) -> int:
    return (triton.cdiv(spec.K, block_k) * triton.cdiv(spec.P * spec.Q, block_pix)
            * triton.cdiv(max(spec.N, 1), sub_batch))


def _default_sizes(spec: ConvSpec, props=None) -> Tuple[int, int, int]:
    """(block_pix, block_k, sub_batch) of the default config.

    A tile of up to 128 pixels; enough images that a small feature map still gives 256 (pixel,
    image) lanes; 16 channels (L1 reuse of the input tile, see the module docstring). Layers too
    small to give `target_programs(props)` programs shrink the channel block (to 4), then the
    sub-batch.
    """
    wanted = target_programs(props)
    block_pix = min(128, max(16, pow2_at_least(spec.P * spec.Q)))
    sub_batch = min(8, max(1, 256 // block_pix), pow2_at_least(max(spec.N, 1)))
    block_k = min(16, pow2_at_least(spec.K))
    while block_k > 4 and _num_programs(spec, block_pix, block_k, sub_batch) < wanted:
        block_k //= 2
    while sub_batch > 1 and _num_programs(spec, block_pix, block_k, sub_batch) < wanted:
        sub_batch //= 2
    return block_pix, block_k, sub_batch


def _chunked(spec: ConvSpec, block_pix: int, sub_batch: int, chunk: int, acc_per_thread: int) -> DirectConfig:
    """A valid "chunk" config: tile clamped to the layer, num_warps for ~acc_per_thread accumulators."""
    block_pix = min(max(block_pix, 16), 1024, max(16, pow2_at_least(spec.P * spec.Q)))
    sub_batch = min(max(sub_batch, 1), 8, pow2_at_least(max(spec.N, 1)))
    num_warps = min(8, max(1, block_pix * sub_batch // (32 * acc_per_thread)))
    return DirectConfig(block_pix, 1, sub_batch, num_warps, 1, "chunk", chunk)


def candidate_configs(spec: ConvSpec, dtype: torch.dtype = torch.float32, props=None) -> List[DirectConfig]:
    """Configs for the autotuner, heuristic default first; <= 14, distinct.

    First the "chunk" variant, faster than the one-step loop on the ResNet layers measured: one
    warp per 128-256 (pixel, image) lanes won everywhere measured, with chunks of 8 or 16. Then the
    uniform-ELL default (`_default_sizes`), CSR with a small channel block, and the paper's layout
    (one channel, sbS = 4) for comparison;
    last the batch-innermost variant (`_batch_configs`) where the batch allows it.
    `dtype` does not change the list today (the kernel's cost is per load rather than per byte).
    props: the GPU sized for (`target_programs`).
    """
    pix, bk, sb = _default_sizes(spec, props)
    configs = [
        _chunked(spec, 128, 2, 8, 8),
        _chunked(spec, 64, 2, 8, 4),
        _chunked(spec, 128, 1, 16, 4),
        _chunked(spec, 128, 2, 16, 8),
        _chunked(spec, 256, 2, 16, 8),
        _sized(spec, pix, bk, sb, "ell"),
        _sized(spec, pix, min(bk, 4), 2 * sb, "csr", acc_per_thread=64),
        _sized(spec, pix, 1, 4, "ell"),
        _sized(spec, pix, 1, 4, "csr"),
        *_batch_configs(spec),
    ]
    return list(dict.fromkeys(configs))


def _batch_configs(spec: ConvSpec) -> List[DirectConfig]:
    """Variant "batch" when N has a power-of-two divisor >= 4 (below that a thread's images are too
    few for vector loads): BLOCK_N = that divisor up to 32, one warp on 64-512 (pixel, image)
    lanes, i.e. 2-16 accumulators per thread. On ResNet-50's layers (both layouts) 128 or 256
    lanes won every case; 512 and 64 lanes (2 pixels x 32 images) never won."""
    block_n = min(32, spec.N & -spec.N) if spec.N > 0 else 0
    if block_n < 4:
        return []
    max_pix = max(1, pow2_at_least(spec.P * spec.Q))
    shapes = ((256, 1, 8), (256, 1, 16), (128, 1, 8), (512, 1, 8), (64, 1, 8))  # (lanes, warps, chunk)
    return [DirectConfig(min(max(lanes // block_n, 1), max_pix), 1, block_n, warps, 1, "batch", chunk)
            for lanes, warps, chunk in shapes]


def auto_configs(spec: ConvSpec, dtype: torch.dtype = torch.float32) -> List[DirectConfig]:
    """The candidates `backend="auto"` tries: `candidate_configs` without the uniform-ELL layouts
    and the 256-pixel chunked one, which never won a layer of any model tuned (fp32 and fp16), nor
    the 128 x 2 x 16 chunked one, nor the "batch" tiles of 64 or 512 lanes, nor "csr" (almost
    never won); each costs a compile and a timed run per layer."""
    return [config for config in candidate_configs(spec, dtype) if _auto(config)]


def _auto(config: DirectConfig) -> bool:
    if config.variant == "batch":  # 128-256 lanes won every layer x layout case (see _batch_configs)
        return 128 <= config.block_pix * config.sub_batch <= 256
    if config.variant == "chunk":  # 128 pixels x 2 images x 16 won 7 of 748 direct layers before "batch" existed
        return config.block_pix < 128 or (config.block_pix == 128 and (config.sub_batch, config.chunk) != (2, 16))
    return False  # "csr" won 1 of 199 layers once "batch" existed; "ell" never won


def check_weight_variant(weight: DirectWeight, config: DirectConfig) -> None:
    """TypeError unless `weight` is the format of config.variant."""
    expected = {"chunk": ChunkedCSRWeight, "batch": ChunkedCSRWeight, "ell": UniformELLWeight,
                "csr": OffsetCSRWeight}[config.variant]
    if not isinstance(weight, expected):
        raise TypeError(f"config.variant={config.variant!r} needs a {expected.__name__} weight, "
                        f"got {type(weight).__name__}")


def _check_arrays(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, row_ptr: Optional[torch.Tensor],
                  row_order: Optional[torch.Tensor], codes: Optional[torch.Tensor], kernel_k: int,
                  config: DirectConfig) -> None:
    """The packed tensors `weight_arrays` gives for config.variant, on x's device."""
    if values.dtype != torch.float32 or offsets.dtype != torch.int32 or values.shape != offsets.shape:
        raise ValueError(f"values must be float32 and offsets int32 of one shape, got {values.dtype} "
                         f"{tuple(values.shape)} and {offsets.dtype} {tuple(offsets.shape)}")
    if codes is not None and (config.variant != "batch" or codes.dtype != torch.int32 or codes.shape != values.shape
                              or codes.device != x.device):
        raise ValueError(f"codes are for variant 'batch' only, int32 of the values' shape {tuple(values.shape)} on "
                         f"{x.device}, got {codes.dtype} {tuple(codes.shape)} on {codes.device} with variant "
                         f"{config.variant!r}")
    ell = config.variant == "ell"
    if values.dim() != (2 if ell else 1) or (ell and values.shape[0] != kernel_k):
        raise ValueError(f"variant {config.variant!r} needs {'(K, L)' if ell else '1-D'} values with K={kernel_k}, "
                         f"got shape {tuple(values.shape)}")
    needed = {"row_ptr": (row_ptr, kernel_k + 1)} if not ell else {}
    if config.variant == "csr":
        needed["row_order"] = (row_order, kernel_k)
    for name, (tensor, size) in needed.items():
        if tensor is None or tensor.dtype != torch.int32 or tensor.shape != (size,):
            raise ValueError(f"variant {config.variant!r} needs {name} as an int32 ({size},) tensor, got "
                             f"{None if tensor is None else (tensor.dtype, tuple(tensor.shape))}")
    for name, tensor in (("values", values), ("offsets", offsets), *((n, t) for n, (t, _) in needed.items())):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")


def _check_bias(bias: Optional[torch.Tensor], kernel_k: int, x: torch.Tensor) -> None:
    if bias is not None and (bias.shape != (kernel_k,) or bias.device != x.device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating ({kernel_k},) tensor on {x.device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")


def _check_out(out: torch.Tensor, shape: Tuple[int, ...], x: torch.Tensor, variant: str) -> None:
    """NCHW-contiguous out (or, for variant "batch", also batch-innermost) of x's dtype and device."""
    layout_ok = out.is_contiguous() or (variant == "batch" and is_batch_inner(out))
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device or not layout_ok:
        layouts = "contiguous or batch-innermost" if variant == "batch" else "contiguous"
        raise ValueError(f"out must be a {layouts} {x.dtype} tensor of shape {shape} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")


def for_batch(config: DirectConfig, batch: int) -> DirectConfig:
    """`config` for inputs of `batch` images: variant "batch" with sub_batch halved until it divides
    the batch (a layer tuned at N=8 with 8 images per program runs N=4 with 4, N=6 with 2); other
    configs as they are."""
    if config.variant != "batch" or batch <= 0:
        return config
    sub_batch = config.sub_batch
    while batch % sub_batch:
        sub_batch //= 2
    return config if sub_batch == config.sub_batch else dataclasses.replace(config, sub_batch=sub_batch)


def _check_batch_variant(spec: ConvSpec, config: DirectConfig) -> None:
    """Variant "batch": sub_batch divides N, and offsets over the padded input fit int32."""
    if spec.N % config.sub_batch:
        raise ValueError(f"config.sub_batch={config.sub_batch} must divide the batch size N={spec.N} "
                         f"(variant 'batch')")
    padded = spec.C * (spec.H + 2 * spec.padding[0]) * (spec.W + 2 * spec.padding[1]) * spec.N
    if padded > INT32_MAX:
        raise ValueError(f"variant 'batch': the padded input of {padded} elements exceeds int32 offsets")


def _padded_nchw(x: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    """(N, C, H, W) in any layout -> contiguous (N, C, H + 2 pad_h, W + 2 pad_w) with a zero border.

    One pass over the input at most (none when x is contiguous and unpadded).
    """
    if pad_h == 0 and pad_w == 0:
        return x.contiguous()
    if x.is_contiguous():
        return F.pad(x, (pad_w, pad_w, pad_h, pad_h))
    n, c, h, w = x.shape
    padded = x.new_empty(n, c, h + 2 * pad_h, w + 2 * pad_w)
    padded[:, :, :pad_h].zero_()
    padded[:, :, pad_h + h:].zero_()
    padded[:, :, pad_h:pad_h + h, :pad_w].zero_()
    padded[:, :, pad_h:pad_h + h, pad_w + w:].zero_()
    padded[:, :, pad_h:pad_h + h, pad_w:pad_w + w].copy_(x)
    return padded


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """A kernel pointer argument must point at memory even when the kernel never reads it."""
    return t if t.numel() else t.new_zeros(1)


def variant_of(weight: DirectWeight) -> str:
    """The config variant that runs a weight of this format."""
    if isinstance(weight, ChunkedCSRWeight):
        return "chunk"
    return "ell" if isinstance(weight, UniformELLWeight) else "csr"


def default_config(spec: ConvSpec, dtype: torch.dtype, variant: Optional[str] = None) -> DirectConfig:
    """The first candidate (of `variant`, if given)."""
    configs = candidate_configs(spec, dtype)
    return next((c for c in configs if variant in (None, c.variant)), configs[0])


WeightArrays = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                     Optional[torch.Tensor]]


def weight_arrays(weight: DirectWeight, padded_h: int, padded_w: int, config: Optional[DirectConfig] = None,
                  padding: Tuple[int, int] = (0, 0)) -> WeightArrays:
    """(values, offsets, row_ptr, row_order, codes): the tensors the kernel reads for a padded input
    of padded_h x padded_w (H + 2 pad_h, W + 2 pad_w) and that padding; row_ptr is None for "ell",
    row_order except for "csr"; codes are None unless config is variant "batch" and padding is
    non-zero.

    values float32 and offsets int32 ((K, L) views for "ell", (slots,) or (nnz,) otherwise); row_ptr
    int32 (K + 1,); row_order int32 (K,); codes int32 (slots,): the `ChunkedCSRWeight.masked_codes`
    of the unpadded H x W input, with which "batch" reads a batch-innermost input without padding it
    (None where they do not fit int32: that input is padded). Offsets and codes are cached on the
    weight per input size.
    """
    offsets = weight.offsets(padded_h, padded_w)
    variant = variant_of(weight)
    row_ptr = None if variant == "ell" else weight.row_ptr
    pad_h, pad_w = padding
    codes = None
    if config is not None and config.variant == "batch" and (pad_h or pad_w):
        codes = weight.masked_codes(padded_h - 2 * pad_h, padded_w - 2 * pad_w, pad_h, pad_w)
    return weight.values, offsets, row_ptr, weight.row_order if variant == "csr" else None, codes


def direct_conv2d(x: torch.Tensor, weight: DirectWeight, bias: Optional[torch.Tensor] = None,
                  stride=1, padding=0, config: Optional[DirectConfig] = None, *, relu: bool = False,
                  residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparse conv2d (dilation 1, groups 1) by the direct kernel: act(conv(x) + bias + residual).

    x: (N, C, H, W) fp32/fp16/bf16, any strides (channels_last is converted, see the module doc);
    weight: `ChunkedCSRWeight`, `UniformELLWeight` or `OffsetCSRWeight` matching `config.variant`;
    bias: (K,) or None; stride/padding: int or (h, w). relu: fuse max(y, 0), applied last.
    residual: None or an (N, K, P, Q) tensor of x's dtype and device, added before the ReLU.
    out: optional contiguous (N, K, P, Q) tensor of x's dtype to write into.
    Returns (N, K, P, Q) contiguous, x's dtype. `config` None: the default for this layer and the
    weight's variant.
    """
    (sh, sw), (ph, pw) = stride_padding(stride, padding)
    check_triton_input(x, "direct", _DTYPES)
    if not isinstance(weight, (ChunkedCSRWeight, UniformELLWeight, OffsetCSRWeight)):
        raise TypeError(f"weight must be a ChunkedCSRWeight, UniformELLWeight or OffsetCSRWeight, "
                        f"got {type(weight).__name__}")
    if config is None:
        n, c, h, w = x.shape
        kernel_k, _, kernel_r, kernel_s = weight.kernel_shape
        spec = ConvSpec(n, c, kernel_k, h, w, kernel_r, kernel_s, (sh, sw), (ph, pw))
        config = default_config(spec, x.dtype, variant_of(weight))
    check_weight_variant(weight, config)
    arrays = weight_arrays(weight, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw, config, (ph, pw))
    return direct_conv2d_arrays(x, *arrays, weight.kernel_shape, bias, (sh, sw), (ph, pw), config, relu=relu,
                                residual=residual, out=out)


def direct_conv2d_arrays(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                         row_ptr: Optional[torch.Tensor], row_order: Optional[torch.Tensor],
                         codes: Optional[torch.Tensor], kernel_shape: Tuple[int, int, int, int],
                         bias: Optional[torch.Tensor], stride, padding, config: DirectConfig, *, relu: bool = False,
                         residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`direct_conv2d` on a packed weight's tensors (what `weight_arrays` returns for this input's
    padded size and, for codes, padding; offsets and codes must be for exactly that size): the
    launcher the torch.library op `sparsecnn::direct_conv2d` binds. kernel_shape: the weight's
    (K, C, R, S).
    """
    arrays = (values, offsets, row_ptr, row_order, codes)
    spec = _checked_spec(x, arrays, kernel_shape, stride, padding, config)
    _check_bias(bias, spec.K, x)
    check_residual(residual, spec.output_shape, x)
    if out is None:
        out = new_output(spec.output_shape, x, config.out_layout)
    else:
        _check_out(out, spec.output_shape, x, config.variant)
    return _run(x, arrays, bias, residual, out, spec, config, relu)


def _checked_spec(x: torch.Tensor, arrays: WeightArrays, kernel_shape, stride, padding,
                  config: DirectConfig) -> ConvSpec:
    """The layer's `ConvSpec` once x, the packed arrays and the geometry are checked."""
    (sh, sw), (ph, pw) = stride_padding(stride, padding)
    check_triton_input(x, "direct", _DTYPES)
    kernel_k, kernel_c, _, _ = check_kernel_shape(kernel_shape)
    if x.shape[1] != kernel_c:
        raise ValueError(f"x has {x.shape[1]} channels, the weight expects {kernel_c}")
    spec = launch_spec(tuple(x.shape), tuple(kernel_shape), (sh, sw), (ph, pw))
    _check_arrays(x, *arrays, kernel_k, config)
    if kernel_k * spec.P * spec.Q > INT32_MAX:
        raise ValueError(f"one output image of {kernel_k}x{spec.P}x{spec.Q} exceeds int32 offsets")
    if config.variant == "batch":
        _check_batch_variant(spec, config)
    return spec


def _run(x: torch.Tensor, arrays: WeightArrays, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         out: torch.Tensor, spec: ConvSpec, config: DirectConfig, relu: bool) -> torch.Tensor:
    """Launch on checked operands, writing `out`; returns it."""
    if spec.N == 0:
        return out
    bias = None if bias is None else bias.contiguous()
    values, offsets, row_ptr, _, codes = arrays
    ph, pw = spec.padding
    with current_device(x):
        if config.variant == "batch":
            if residual is not None and residual.stride() != out.stride():
                residual = torch.empty_like(out).copy_(residual)  # the epilogue reads it at out's offsets
            # A batch-innermost padded input is read where it is, with masked loads, rather than
            # padded by a pass over it (see kernel_batch's module docstring).
            masked = codes is not None and (ph, pw) != (0, 0) and is_batch_inner(x)
            # A 1x1 kernel reads only the positions at multiples of the stride: only those are packed.
            step = spec.stride if (spec.R, spec.S) == (1, 1) else (1, 1)
            source, offsets, padding = ((x.permute(1, 2, 3, 0), codes, (ph, pw)) if masked
                                        else (padded_batch_inner(x, ph, pw, step), offsets, (0, 0)))
            launch_batch(source, _nonempty(values), _nonempty(offsets), row_ptr, bias, residual, out, spec.stride,
                         relu, config.block_pix, config.sub_batch, config.chunk, config.num_warps, padding)
        else:
            epilogue = (bias, None if residual is None else residual.contiguous())
            _launch(_padded_nchw(x, ph, pw), arrays, epilogue, out, spec, config, relu)
    return out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a `BoundDirectCall` checked: the input's (shape, dtype, device), the packed arrays, the
    op's static arguments, and what they give (the layer's spec and config)."""

    x_key: Tuple
    arrays: WeightArrays
    static: Tuple
    spec: ConvSpec
    config: DirectConfig

    def matches(self, x: torch.Tensor, arrays: WeightArrays, static: Tuple) -> bool:
        return ((x.shape, x.dtype, x.device) == self.x_key and static == self.static
                and all(a is b for a, b in zip(arrays, self.arrays)))


class BoundDirectCall:
    """The eager implementation of the op `sparsecnn::direct_conv2d` for one bound layer.

    Its first call, and any call whose input shape, dtype or device, packed arrays or static
    arguments differ from the checked ones, runs `checked` (the op's checked implementation);
    other calls check only those, the bias and the residual, then launch: checking every argument
    was a large share of an eager call's Python (`scripts/profile_eager.py`).
    """

    def __init__(self, checked: Callable[..., torch.Tensor]):
        self._checked = checked
        self._plan: Optional[_Plan] = None

    def __call__(self, x: torch.Tensor, values, offsets, row_ptr, row_order, codes, bias, residual, kernel_shape,
                 padded_hw, stride, padding, config_json: str, relu: bool) -> torch.Tensor:
        arrays = (values, offsets, row_ptr, row_order, codes)
        static = (kernel_shape, padded_hw, stride, padding, config_json)
        plan = self._plan
        if plan is None or not plan.matches(x, arrays, static):
            out = self._checked(x, *arrays, bias, residual, *static, relu)
            spec = launch_spec(tuple(x.shape), tuple(kernel_shape), tuple(stride), tuple(padding))
            config = DirectConfig.from_dict(json.loads(config_json))
            self._plan = _Plan((x.shape, x.dtype, x.device), arrays, static, spec, config)
            return out
        _check_bias(bias, plan.spec.K, x)
        check_residual(residual, plan.spec.output_shape, x)
        out = new_output(plan.spec.output_shape, x, plan.config.out_layout)
        return _run(x, arrays, bias, residual, out, plan.spec, plan.config, relu)


def _launch(xp: torch.Tensor, arrays: WeightArrays, epilogue: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
            out: torch.Tensor, spec: ConvSpec, config: DirectConfig, relu: bool) -> None:
    """Launch the kernel on the padded input `xp` (N, C, Hp, Wp), writing `out` (N, K, P, Q).

    epilogue: (bias (K,), residual (N, K, P, Q)), each contiguous or None.
    """
    values, offsets, row_ptr, row_order, _ = arrays
    bias, residual = epilogue
    # Absent operands pass `out`: a valid pointer the kernel never reads.
    operands = (bias if bias is not None else out, residual if residual is not None else out, out)
    if config.variant == "chunk":
        grid, args, meta = chunk_launch((xp, _nonempty(values), _nonempty(offsets), row_ptr, *operands), xp.shape,
                                        spec, config, bias is not None, residual is not None, relu)
        launch(_direct_chunk_kernel, grid, args, **meta)
        return
    n, c, hp, wp = xp.shape
    pq = spec.P * spec.Q
    geometry = (n, spec.K, pq, spec.Q, spec.stride[0] * wp, spec.stride[1], c * hp * wp, spec.K * pq)
    csr = config.variant == "csr"
    if csr:
        ell = (0, 0, 0)
    else:
        row_ptr, row_order = out, out  # unused by ELL
        ell = (values.shape[1], values.stride(0), values.stride(1))
    grid = (triton.cdiv(spec.K, config.block_k) * triton.cdiv(pq, config.block_pix)
            * triton.cdiv(n, config.sub_batch),)
    launch(
        _direct_conv_kernel, grid,
        (xp, _nonempty(values), _nonempty(offsets), row_ptr, row_order, *operands, *geometry, *ell),
        CSR=csr, EVEN_K=spec.K % config.block_k == 0, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, RELU=relu,
        BLOCK_PIX=config.block_pix, BLOCK_K=config.block_k, SUB_BATCH=config.sub_batch,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def chunk_launch(operands: tuple, padded_shape, spec: ConvSpec, config: DirectConfig, has_bias: bool,
                 has_residual: bool, relu: bool) -> Tuple[tuple, tuple, dict]:
    """(grid, args, meta) of `_direct_chunk_kernel` (variant "chunk") on a padded NCHW input of
    `padded_shape` (N, C, Hp, Wp).

    operands: (xp, values, offsets, row_ptr, bias, residual, out), bias and residual standing in
    as `out` when absent; tensors, or their dtypes for a compile without launch
    (`compile_ahead`). `_launch` launches with these and `compile_ahead` compiles with them, so both
    reach the same compiled kernel."""
    n, c, hp, wp = padded_shape
    pq = spec.P * spec.Q
    geometry = (n, spec.K, pq, spec.Q, spec.stride[0] * wp, spec.stride[1], c * hp * wp, spec.K * pq)
    grid = (spec.K * triton.cdiv(pq, config.block_pix) * triton.cdiv(n, config.sub_batch),)
    meta = dict(HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, RELU=relu, BLOCK_PIX=config.block_pix,
                SUB_BATCH=config.sub_batch, CHUNK=config.chunk, num_warps=config.num_warps,
                num_stages=config.num_stages)
    return grid, (*operands, *geometry), meta
