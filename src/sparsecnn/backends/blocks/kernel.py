"""OptPrune sparse convolution (paper 000, Sec. 4): GEMM on dense blocks plus a sparse remainder.

Implicit GEMM. For output channels `rows`, kernel-matrix columns `cols` (c, r, s) and pixels g
(n, p, q) of the whole batch (the GEMM's other dimension):
    y[n, rows, p, q] += W[rows, cols] @ x_padded[n, c, p*sh + r, q*sw + s]
The input matrix is never built: a column is an input offset c*Hp*Wp + r*Wp + s in the
zero-padded input, a pixel a base offset n*C*Hp*Wp + p*sh*Wp + q*sw, and an operand element the
input at their sum. The output is written straight into (N, K, P, Q) NCHW. The kernel computes
the transposed product, pixels x channels, so that a warp's lanes walk consecutive pixels (see
the kernel's docstring); the MMA's M is then pixels and its N channels (16..128, any multiple of
8 suits Hopper's wgmma).

Why the work is organised by output tiles, not by blocks. Algorithm 1 repeats on what earlier
blocks left, so blocks of different iterations share rows (row 3 of the paper's own example is
in both of its blocks; DLMC ResNet-50 layers reach 10-40 iterations, every row in several
blocks). A (block, row tile, pixel tile) work item per block would then need atomics or one
launch per iteration to sum into the same outputs. Instead each program owns a tile of BLOCK_M
output channels x BLOCK_N pixels and computes it completely, in one store:
  * dense part: the tile's columns are the union of the columns of every block holding any of its
    rows; its dense BLOCK_M x width weight holds all non-zeros of the tile's rows in those
    columns (remainder non-zeros that fall there are absorbed: they are free, the cell was a
    multiplied zero otherwise). tl.dot over it: tensor cores for fp16/bf16, TF32 and 3xTF32
    ("tf32x3": each fp32 operand split into a TF32 high part and a TF32 low part, three MMAs per
    product, fp32-level error: the default for fp32), FMA units for "ieee".
  * sparse part: the tile rows' other non-zeros as a row-wise ELL loop (every row of the tile
    advances one non-zero per step; rows padded to the tile's longest with zero weights).
  * the epilogue (bias, residual, ReLU), then one store. Rows in no block form tiles with only a sparse part, so every output
    element is written exactly once (bias or zero included), deterministically, in one launch.
The price: where a tile's rows belong to blocks of several iterations, its column union is
wider than any one block, so the dense part is sparser than the blocks (`BlocksWeight.stats`
reports it; on DLMC ResNet-50 at t2 = 8 the blocks' fill is ~0.15-0.3, the tiles' ~0.1-0.15).

Rows not a multiple of the tile (paper Sec. 4.2). The channels are ordered so that each block's
rows are adjacent (sorted by the block they belong to in iteration 1, then 2, ...; within that by
remainder length, which evens the ELL rows of a tile), and that order is cut into tiles of
BLOCK_M: rows are packed, so only the last tile of the layer has padded rows. A tile that
straddles two blocks pays with a wider column union instead. Tiles run heaviest first, so the
tail of the grid holds the cheap ones.

Pipelining (sm_90, checked by compiling offline). fp32 input gathers are 4 bytes, so Triton
pipelines the dot loop with cp.async over num_stages buffers; fp16/bf16 gathers (2 bytes, at
arbitrary alignment) cannot use cp.async, and that loop runs single-buffered, its latency hidden
by the other programs on the SM (~126 registers at 64 x 64: four programs of 4 warps).

Grid: 1-D, tiles fastest, then pixel tiles: programs that run together read the same input patch
(from L2 after the first). Accumulation is float32; output dtype = input dtype. All offsets are
int32: the launcher splits a batch whose input or output would overflow them into several launches.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparsecnn.backends.blocks.format import (
    BlockDecomposition,
    BlockParams,
    extract_blocks,
)
from sparsecnn.core.checks import (
    check_kernel_shape,
    check_pow2_field,
    check_residual,
    check_triton_input,
    config_from_dict,
    current_device,
    int_pair,
    launch_spec,
    pow2_at_least,
    stride_padding,
)
from sparsecnn.core.offsets import INT32_MAX, expand_offsets
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_epilogue import store_epilogue
from sparsecnn.core.triton_launch import launch

PRECISIONS = ("ieee", "tf32", "tf32x3")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ACC_PER_THREAD = 128  # beyond this the accumulators alone spill registers


# Specialised: PQ and y_img_stride (the output stores along pixels). The other integers' divisibility
# gave one compile per layer shape: most of the Triton compiles of tuning a ResNet-50 were this
# kernel's (`scripts/profile_tuning.py --triton-census`).
@triton.jit(do_not_specialize=["NPQ", "Q", "row_step", "col_step", "x_img_stride", "num_tiles"])
def _blocks_conv_kernel(
    x_ptr, rows_ptr, dense_start_ptr, dense_off_ptr, dense_val_ptr,
    ell_start_ptr, ell_off_ptr, ell_val_ptr, bias_ptr, res_ptr, y_ptr,
    NPQ, PQ, Q, row_step, col_step, x_img_stride, y_img_stride, num_tiles,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[n, rows, pq] = act(bias[rows] + dense part + ELL part + residual[n, rows, pq]), for one tile
    of BLOCK_M channels x BLOCK_N pixels per program; computed transposed, as [pixels, channels].

    x_ptr: padded contiguous (N, C, Hp, Wp); y_ptr and res_ptr: contiguous (N, K, P, Q); act is
    ReLU when RELU, else the identity; all offsets int32 (the launcher splits batches whose
    offsets would not fit).
    rows: int32 (num_tiles * BLOCK_M,) output channel of each tile slot, -1 for an empty slot.
    dense_start: int32 (num_tiles + 1,) column ranges (widths are multiples of BLOCK_K);
    dense_off: int32 input offset of each column (padding columns: 0, with zero weights);
    dense_val: per tile a (width, BLOCK_M) row-major weight block at BLOCK_M * dense_start[tile].
    ell_start: int32 (num_tiles + 1,) step ranges; ell_off / ell_val: (steps, BLOCK_M) int32
    input offsets / float32 weights.
    row_step = stride_h * Wp, col_step = stride_w: input distance between output rows / columns.
    FP32_DOT: fp32 operands, multiplied as PRECISION says ("ieee", "tf32" or "tf32x3").

    Pixels are dim 0 of every 2-D tensor: the gathered offsets hide contiguity from Triton,
    which then gives lanes to dim 0; this way a warp's lanes read consecutive pixels (coalesced)
    rather than 32 channels' columns. So the MMA is pixels (M) x channels (N).
    """
    pid = tl.program_id(0)
    tile = pid % num_tiles
    pix_tile = pid // num_tiles

    # Pixels past the end are clamped to the last one for loading (no masks in the loops) and
    # masked only at the store.
    pix = pix_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pix_ok = pix < NPQ
    pix_in = tl.minimum(pix, NPQ - 1)
    img = pix_in // PQ
    pq = pix_in - img * PQ
    oh = pq // Q
    x_pix = img * x_img_stride + oh * row_step + (pq - oh * Q) * col_step  # [BLOCK_N]

    slot = tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + tile * BLOCK_M + slot)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)

    # Sparse remainder first: its accumulator then enters the dot loop as the initial value,
    # so both parts share one set of registers.
    for step in range(tl.load(ell_start_ptr + tile), tl.load(ell_start_ptr + tile + 1)):
        w = tl.load(ell_val_ptr + step * BLOCK_M + slot)
        off = tl.load(ell_off_ptr + step * BLOCK_M + slot)
        xv = tl.load(x_ptr + (x_pix[:, None] + off[None, :]))
        acc += xv.to(tl.float32) * w[None, :]

    # The dot loop loads the next chunk's offsets before using the current ones, so the gather
    # never waits on an offset load (the column arrays end with BLOCK_K slack columns for the
    # last look-ahead). The ELL loop does not: its offsets are replicated in every thread of a
    # pixel row, and a second set would cost ~50 registers (measured on sm_90) and occupancy.
    dense_begin = tl.load(dense_start_ptr + tile)
    width = tl.load(dense_start_ptr + tile + 1) - dense_begin
    kk = tl.arange(0, BLOCK_K)
    w_tile = dense_val_ptr + dense_begin * BLOCK_M
    off = tl.load(dense_off_ptr + dense_begin + kk)
    for k0 in range(0, width, BLOCK_K):
        xt = tl.load(x_ptr + (x_pix[:, None] + off[None, :]))               # [BLOCK_N, BLOCK_K] input
        wt = tl.load(w_tile + ((k0 + kk) * BLOCK_M)[:, None] + slot[None, :])  # [BLOCK_K, BLOCK_M] weights
        off = tl.load(dense_off_ptr + dense_begin + k0 + BLOCK_K + kk)
        if FP32_DOT:
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xt, wt, acc)

    row_ok = rows >= 0
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    y_offs = (img * y_img_stride + pq)[:, None] + (rows * PQ)[None, :]
    mask = pix_ok[:, None] & row_ok[None, :]
    store_epilogue(acc, y_ptr, res_ptr, y_offs, mask, HAS_RESIDUAL, RELU)


# --- config -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlocksConfig:
    """Parameters of the blocks backend: the extraction's t2 and the kernel's launch.

    t2: Algorithm 1's column threshold (paper: 4, 8, 12, 16; t1 = B1 = B2 = 8 fixed);
    block_m: output channels per tile (16..128), block_n: pixels per tile (16..256),
    block_kred: reduction columns per dot step (16..64), all powers of two; num_warps: 1..8;
    num_stages: software-pipelining depth of the dot loop (1..5); precision: how fp32 inputs are
    multiplied, "ieee" (FMA units), "tf32x3" (tensor cores, three TF32 products per fp32 product:
    error within ~2x of cuDNN fp32's, checked by the GPU tests) or "tf32" (tensor cores, inputs
    rounded to TF32). fp16/bf16 always use tensor cores, whose products are exact: their configs
    carry "ieee".
    t2, block_m and block_kred shape the packed weight (`BlocksWeight`); the others only the launch.
    """

    t2: int = 8
    block_m: int = 64
    block_n: int = 64
    block_kred: int = 32
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "ieee"

    def __post_init__(self):
        if not isinstance(self.t2, int) or isinstance(self.t2, bool) or self.t2 < 1:
            raise ValueError(f"BlocksConfig.t2 must be an int >= 1, got {self.t2!r}")
        check_pow2_field("BlocksConfig", "block_m", self.block_m, 16, 128)
        check_pow2_field("BlocksConfig", "block_n", self.block_n, 16, 256)
        check_pow2_field("BlocksConfig", "block_kred", self.block_kred, 16, 64)
        check_pow2_field("BlocksConfig", "num_warps", self.num_warps, 1, 8)
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 1 <= self.num_stages <= 5:
            raise ValueError(f"BlocksConfig.num_stages must be an int in 1..5, got {self.num_stages!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"BlocksConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        per_thread = self.block_m * self.block_n // (32 * self.num_warps)
        if per_thread > _MAX_ACC_PER_THREAD:
            raise ValueError(f"BlocksConfig.num_warps={self.num_warps} too few for a {self.block_m}x{self.block_n} "
                             f"tile: {per_thread} accumulators per thread (max {_MAX_ACC_PER_THREAD})")

    @property
    def packing(self) -> Tuple[int, int, int]:
        """(t2, block_m, block_kred): what a `BlocksWeight` is built for."""
        return self.t2, self.block_m, self.block_kred

    @classmethod
    def from_dict(cls, saved: dict) -> "BlocksConfig":
        """Rebuild from `dataclasses.asdict` output (unknown keys are an error)."""
        return config_from_dict(cls, saved)


_T2_VALUES = (4, 8, 12, 16)  # the paper tunes t2 over these (Sec. 6.2)


def candidate_configs(spec: ConvSpec, dtype: torch.dtype = torch.float32,
                      precision: Optional[str] = None) -> List[BlocksConfig]:
    """Configs for the autotuner, default first; <= 6, distinct.

    precision: for fp32, "tf32x3" (the default: fp32-level error on tensor cores, so autotuning
    never trades accuracy for speed), "ieee" or "tf32"; fp16/bf16 ignore it. The default tile is
    64 channels x 64 pixels x 32 columns (4 warps: one Hopper warpgroup, a wgmma-sized M). Its t2
    is 8 for tensor-core modes, 12 for "ieee", where the dense part runs on FMA units and zeros in
    blocks cost as much as non-zeros. The others: the three other t2 values, then a narrower (32 x 128) and a taller
    (128 x 64, 8 warps) tile at the default t2. Tiles never exceed the layer's channel count
    (rounded up to a power of two).
    """
    if precision is None:
        precision = "tf32x3"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if dtype != torch.float32:
        precision = "ieee"
    t2 = 12 if dtype == torch.float32 and precision == "ieee" else 8
    channels = max(16, pow2_at_least(spec.K))

    def sized(t2_value: int, block_m: int, block_n: int, num_warps: int) -> BlocksConfig:
        return BlocksConfig(t2_value, min(block_m, channels), block_n, 32, num_warps, 3, precision)

    configs = [sized(t2, 64, 64, 4)]
    configs += [sized(other, 64, 64, 4) for other in _T2_VALUES if other != t2]
    configs += [sized(t2, 32, 128, 4), sized(t2, 128, 64, 8)]
    return list(dict.fromkeys(configs))


# --- packed weight ----------------------------------------------------------------------------

@dataclasses.dataclass
class BlocksWeight:
    """A layer's weight packed for `blocks_conv2d`: per output tile, a dense part and an ELL part.

    decomposition: the `BlockDecomposition` (Algorithm 1) it was built from; config: the
    `BlocksConfig` it was packed for (its t2, block_m, block_kred; `blocks_conv2d` runs with it
    when given no config); rows: int32 (tiles * block_m,) channels, -1 = empty slot;
    dense_start: int32 (tiles + 1,); dense_cols: int32 (D + block_kred,) kernel-matrix columns;
    dense_values: float32 ((D + block_kred) * block_m,), per tile a (width, block_m) row-major
    block; ell_start: int32 (tiles + 1,); ell_cols: int32 (E + 1, block_m); ell_values: float32
    (E + 1, block_m); the last block_kred columns and the last step are slack (see `_concatenate`).
    All on one device.
    stats: what the kernel will compute (see `_plan_stats`).
    """

    decomposition: BlockDecomposition
    config: BlocksConfig
    rows: torch.Tensor
    dense_start: torch.Tensor
    dense_cols: torch.Tensor
    dense_values: torch.Tensor
    ell_start: torch.Tensor
    ell_cols: torch.Tensor
    ell_values: torch.Tensor
    stats: Dict[str, float]
    _offsets: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)
    _cast: Dict[torch.dtype, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, config: BlocksConfig,
                   params: Optional[BlockParams] = None) -> "BlocksWeight":
        """Extract blocks from a dense (K, C, R, S) weight (t2 from `config`) and pack them on its device."""
        params = dataclasses.replace(params or BlockParams(), t2=config.t2)
        return cls.from_decomposition(extract_blocks(weight, params), config, weight.device)

    @classmethod
    def from_decomposition(cls, decomposition: BlockDecomposition, config: BlocksConfig,
                           device: torch.device) -> "BlocksWeight":
        """Pack a decomposition (whose t2 must be config.t2) for config's block_m / block_kred."""
        if decomposition.params.t2 != config.t2:
            raise ValueError(f"decomposition has t2={decomposition.params.t2}, config wants t2={config.t2}")
        tiles = _plan_tiles(decomposition, config.block_m, config.block_kred)
        packed = _concatenate(tiles, config.block_m, config.block_kred)
        return cls(decomposition, config, *(torch.from_numpy(a).to(device) for a in packed),
                   stats=_plan_stats(tiles, decomposition))

    def to(self, device) -> "BlocksWeight":
        """A copy on `device` (packing is CPU work: pack on CPU, e.g. in worker processes, then move)."""
        arrays = (self.rows, self.dense_start, self.dense_cols, self.dense_values, self.ell_start,
                  self.ell_cols, self.ell_values)
        return BlocksWeight(self.decomposition, self.config, *(a.to(device) for a in arrays), stats=self.stats)

    @property
    def kernel_shape(self) -> Tuple[int, int, int, int]:
        return self.decomposition.kernel_shape

    @property
    def packing(self) -> Tuple[int, int, int]:
        return self.config.packing

    @property
    def num_tiles(self) -> int:
        return self.dense_start.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def offsets(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Input offsets of the dense and ELL columns for a (padded) height x width input (cached)."""
        key = (int(height), int(width))
        if key not in self._offsets:
            self._offsets[key] = tuple(expand_offsets(cols, self.kernel_shape, *key)
                                       for cols in (self.dense_cols, self.ell_cols))
        return self._offsets[key]

    def dense_values_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weights in the dot's operand dtype (cached per dtype)."""
        if dtype not in self._cast:
            self._cast[dtype] = self.dense_values.to(dtype)
        return self._cast[dtype]


@dataclasses.dataclass
class _Tile:
    rows: np.ndarray      # int64 (<= block_m,) channels
    cols: np.ndarray      # int64 (width,) kernel-matrix columns, padding 0
    dense: np.ndarray     # float32 (width, block_m): column-major tile weights, channels contiguous
    ell_cols: np.ndarray  # int64 (steps, block_m)
    ell_vals: np.ndarray  # float32 (steps, block_m)
    dense_nnz: int
    ell_nnz: int

    @property
    def cost(self) -> int:
        """Gathered input rows per pixel: one per dense column, block_m per ELL step."""
        return self.cols.size + self.ell_cols.size


def _row_order(decomposition: BlockDecomposition, union: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """Channels sorted by (block in iteration 1, block in iteration 2, ..., longest remainder first).

    Rows of one block become adjacent, rows sharing blocks of later iterations too; rows in no
    block come last.
    """
    blocks = decomposition.blocks
    signature = np.full((union.shape[0], max(decomposition.report.num_levels, 1)), len(blocks), dtype=np.int64)
    for index, block in enumerate(blocks):
        signature[block.rows.numpy(), block.level] = index
    outside = (nonzero & ~union).sum(axis=1)
    return np.lexsort((-outside, *signature.T[::-1]))


def _plan_tiles(decomposition: BlockDecomposition, block_m: int, block_kred: int) -> List[_Tile]:
    """Cut the row order into tiles of block_m channels; heaviest tile first."""
    matrix = decomposition.to_dense().reshape(decomposition.kernel_shape[0], -1).float().numpy()
    nonzero = matrix != 0
    union = np.zeros_like(nonzero)  # cells in the columns of a block holding the row
    for block in decomposition.blocks:
        union[np.ix_(block.rows.numpy(), block.cols.numpy())] = True
    order = _row_order(decomposition, union, nonzero)
    tiles = [_tile(matrix, nonzero, union, order[start:start + block_m], block_m, block_kred)
             for start in range(0, order.size, block_m)]
    return sorted(tiles, key=lambda tile: -tile.cost)


def _tile(matrix, nonzero, union, rows, block_m: int, block_kred: int) -> _Tile:
    """Dense part over the union of the rows' block columns, ELL part for their other non-zeros."""
    cols = np.flatnonzero(union[rows].any(axis=0))
    width = -(-cols.size // block_kred) * block_kred
    dense = np.zeros((width, block_m), dtype=np.float32)
    dense[:cols.size, :rows.size] = matrix[np.ix_(rows, cols)].T
    padded_cols = np.zeros(width, dtype=np.int64)
    padded_cols[:cols.size] = cols
    in_dense = np.zeros(matrix.shape[1], dtype=bool)
    in_dense[cols] = True
    row_index, col = np.nonzero(nonzero[rows] & ~in_dense)  # row-major: columns increase per row
    counts = np.bincount(row_index, minlength=rows.size)
    steps = int(counts.max()) if counts.size else 0
    step = np.arange(row_index.size) - np.concatenate(([0], np.cumsum(counts)[:-1]))[row_index]
    ell_cols = np.zeros((steps, block_m), dtype=np.int64)
    ell_vals = np.zeros((steps, block_m), dtype=np.float32)
    ell_cols[step, row_index] = col
    ell_vals[step, row_index] = matrix[rows[row_index], col]
    # A row's padding steps re-read its last column (input already in L1), times a zero weight.
    for slot in np.flatnonzero(counts[:rows.size] < steps):
        if counts[slot]:
            ell_cols[counts[slot]:, slot] = ell_cols[counts[slot] - 1, slot]
    return _Tile(rows, padded_cols, dense, ell_cols, ell_vals,
                 int(nonzero[np.ix_(rows, cols)].sum()), int(row_index.size))


def _concatenate(tiles: List[_Tile], block_m: int, block_kred: int) -> Tuple[np.ndarray, ...]:
    """The flat arrays of `BlocksWeight` (rows ... ell_values) from the tiles.

    The dense arrays end with block_kred slack columns (offset 0, weight 0): the kernel's dot
    loop reads one chunk of offsets ahead, past a tile's last.
    """
    rows = np.full((len(tiles), block_m), -1, dtype=np.int32)
    for index, tile in enumerate(tiles):
        rows[index, :tile.rows.size] = tile.rows
    dense_start = np.concatenate(([0], np.cumsum([t.cols.size for t in tiles]))).astype(np.int64)
    ell_start = np.concatenate(([0], np.cumsum([t.ell_cols.shape[0] for t in tiles]))).astype(np.int64)
    if block_m * (dense_start[-1] + block_kred) > INT32_MAX or block_m * ell_start[-1] > INT32_MAX:
        raise ValueError("packed weight too large for int32 indexing")
    dense_cols = np.concatenate([t.cols for t in tiles] + [np.zeros(block_kred, np.int64)])
    dense_values = np.concatenate([t.dense.ravel() for t in tiles] + [np.zeros(block_kred * block_m, np.float32)])
    # One zero step even when there are none: a kernel argument must point at memory.
    ell_cols = np.concatenate([t.ell_cols for t in tiles] + [np.zeros((1, block_m), np.int64)])
    ell_values = np.concatenate([t.ell_vals for t in tiles] + [np.zeros((1, block_m), np.float32)])
    return (rows.ravel(), dense_start.astype(np.int32), dense_cols.astype(np.int32), dense_values,
            ell_start.astype(np.int32), ell_cols.astype(np.int32), ell_values)


def _plan_stats(tiles: List[_Tile], decomposition: BlockDecomposition) -> Dict[str, float]:
    """Work of the packed weight per output pixel, against the layer's non-zeros.

    dense_cells: multiply-adds of the dot loops (tile rows x padded widths); dense_fill: non-zeros
    among them; gathered_rows: input rows read per pixel (dense columns + ELL steps x block_m);
    ell_slots / ell_fill: ELL multiply-adds and their non-zero share; absorbed: remainder
    non-zeros that the dense parts took.
    """
    nnz = max(decomposition.report.nnz, 1)
    dense_cells = sum(t.dense.size for t in tiles)
    dense_nnz = sum(t.dense_nnz for t in tiles)
    ell_slots = sum(t.ell_cols.size for t in tiles)
    ell_nnz = sum(t.ell_nnz for t in tiles)
    return dict(
        tiles=len(tiles), dense_cells=dense_cells, dense_fill=dense_nnz / dense_cells if dense_cells else 0.0,
        ell_slots=ell_slots, ell_fill=ell_nnz / ell_slots if ell_slots else 0.0,
        gathered_rows=sum(t.cost for t in tiles), macs_per_nnz=(dense_cells + ell_slots) / nnz,
        absorbed=(dense_nnz - decomposition.report.nnz_in_blocks) / nnz)


# --- launcher ---------------------------------------------------------------------------------

BlocksArrays = Tuple[torch.Tensor, ...]


def _check_operands(x: torch.Tensor, weight: BlocksWeight, config: BlocksConfig) -> None:
    check_triton_input(x, "blocks", _DTYPES)
    if not isinstance(weight, BlocksWeight):
        raise TypeError(f"weight must be a BlocksWeight, got {type(weight).__name__}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if config.packing != weight.packing:
        raise ValueError(f"config (t2, block_m, block_kred) = {config.packing} differs from the weight's "
                         f"packing {weight.packing}; pack the weight for this config")


def _check_arrays(x: torch.Tensor, arrays: BlocksArrays, config: BlocksConfig) -> None:
    """The tensors of `weight_arrays` for a weight packed with config's block_m / block_kred, on x's device."""
    rows, dense_start, dense_off, dense_values, ell_start, ell_off, ell_values = arrays
    names = ("rows", "dense_start", "dense_offsets", "dense_values", "ell_start", "ell_offsets", "ell_values")
    for name, tensor in zip(names, arrays):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
        expected = x.dtype if name == "dense_values" else torch.float32 if name == "ell_values" else torch.int32
        if tensor.dtype != expected:
            raise ValueError(f"{name} must be {expected}, got {tensor.dtype}")
    tiles = dense_start.numel() - 1
    if (tiles < 0 or rows.shape != (tiles * config.block_m,) or ell_start.shape != (tiles + 1,)
            or dense_values.numel() != dense_off.numel() * config.block_m or dense_off.numel() < config.block_kred
            or ell_off.dim() != 2 or ell_off.shape[1] != config.block_m or ell_values.shape != ell_off.shape):
        raise ValueError(f"packed arrays do not fit a packing with block_m={config.block_m}, "
                         f"block_kred={config.block_kred}: shapes {[tuple(t.shape) for t in arrays]}")


def _padded_nchw(x: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    """(N, C, H, W) in any layout -> contiguous (N, C, H + 2 pad_h, W + 2 pad_w), zero border.

    Padding once lets every load in the loops go unmasked (a bounds check would cost more
    integer work per element than the copy costs per input element).
    """
    if pad_h == 0 and pad_w == 0:
        return x.contiguous()
    return F.pad(x.contiguous(), (pad_w, pad_w, pad_h, pad_h))


def weight_arrays(weight: BlocksWeight, padded_h: int, padded_w: int, dtype: torch.dtype) -> BlocksArrays:
    """(rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets, ell_values): what the
    kernel reads for a padded input of padded_h x padded_w (H + 2 pad_h, W + 2 pad_w) of `dtype`.

    Offsets int32 (cached on the weight per input size); dense_values in `dtype` (the dot's
    operand type, cached per dtype); the rest as stored in `BlocksWeight`.
    """
    dense_off, ell_off = weight.offsets(padded_h, padded_w)
    return (weight.rows, weight.dense_start, dense_off, weight.dense_values_as(dtype), weight.ell_start, ell_off,
            weight.ell_values)


def blocks_conv2d(x: torch.Tensor, weight: BlocksWeight, bias: Optional[torch.Tensor] = None,
                  stride=1, padding=0, config: Optional[BlocksConfig] = None, *, relu: bool = False,
                  residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparse conv2d (dilation 1, groups 1) by dense-block GEMM plus ELL remainder, one launch:
    act(conv(x) + bias + residual).

    x: (N, C, H, W) fp32/fp16/bf16 on CUDA (CPU with TRITON_INTERPRET=1), any strides;
    weight: `BlocksWeight` on x's device; bias: (K,) or None; stride/padding: int or (h, w);
    config: None for the one the weight was packed for; else its (t2, block_m, block_kred) must
    match the weight's. relu: fuse max(y, 0), applied last. residual: None or an (N, K, P, Q)
    tensor of x's dtype and device, added before the ReLU. out: optional contiguous (N, K, P, Q)
    tensor of x's dtype. Returns (N, K, P, Q) contiguous, x's dtype.
    """
    (_, _), (ph, pw) = int_pair(stride, "stride"), int_pair(padding, "padding")
    if config is None and isinstance(weight, BlocksWeight):
        config = weight.config
    _check_operands(x, weight, config)
    arrays = weight_arrays(weight, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw, x.dtype)
    return blocks_conv2d_arrays(x, arrays, weight.kernel_shape, bias, stride, padding, config, relu=relu,
                                residual=residual, out=out)


def blocks_conv2d_arrays(x: torch.Tensor, arrays: BlocksArrays, kernel_shape: Tuple[int, int, int, int],
                         bias: Optional[torch.Tensor], stride, padding, config: BlocksConfig, *,
                         relu: bool = False, residual: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`blocks_conv2d` on a packed weight's tensors (`weight_arrays` for exactly this input's padded
    size and dtype): the launcher the torch.library op `sparsecnn::blocks_conv2d` binds.
    kernel_shape: the weight's (K, C, R, S); config: the one the arrays were packed with.
    """
    (sh, sw), (ph, pw) = stride_padding(stride, padding)
    check_triton_input(x, "blocks", _DTYPES)
    check_kernel_shape(kernel_shape)
    _check_arrays(x, arrays, config)
    n, c, h, w = x.shape
    k, kernel_c, r, s = kernel_shape
    if c != kernel_c:
        raise ValueError(f"x has {c} channels, the weight expects {kernel_c}")
    if bias is not None and (bias.shape != (k,) or bias.device != x.device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating ({k},) tensor on {x.device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
    spec = launch_spec(tuple(x.shape), tuple(kernel_shape), (sh, sw), (ph, pw))
    check_residual(residual, spec.output_shape, x)
    hp, wp = h + 2 * ph, w + 2 * pw
    if c * hp * wp > INT32_MAX or k * spec.P * spec.Q > INT32_MAX:
        raise ValueError("one image's padded input or output exceeds int32 offsets")
    if out is None:
        out = torch.empty(spec.output_shape, dtype=x.dtype, device=x.device)
    elif out.shape != spec.output_shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {spec.output_shape} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if n:
        xp = _padded_nchw(x, ph, pw)
        bias = None if bias is None else bias.contiguous()
        residual = None if residual is None else residual.contiguous()
        # int32 offsets in the kernel: launch per chunk of images whose input and output fit.
        chunk = max(1, min(INT32_MAX // (c * hp * wp), INT32_MAX // (k * spec.P * spec.Q)))
        with current_device(x):
            for first in range(0, n, chunk):
                images = slice(first, first + chunk)
                _launch(xp[images], arrays, bias, None if residual is None else residual[images], out[images],
                        spec, config, relu)
    return out


def _launch(xp: torch.Tensor, arrays: BlocksArrays, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
            out: torch.Tensor, spec: ConvSpec, config: BlocksConfig, relu: bool) -> None:
    """One launch over the padded input `xp` (n, C, Hp, Wp), writing `out` (n, K, P, Q)."""
    n, c, hp, wp = xp.shape
    pq = spec.P * spec.Q
    num_tiles = arrays[1].numel() - 1
    grid = (num_tiles * triton.cdiv(n * pq, config.block_n),)
    launch(
        _blocks_conv_kernel, grid,
        (xp, *arrays, out if bias is None else bias, out if residual is None else residual, out,
         n * pq, pq, spec.Q, spec.stride[0] * wp, spec.stride[1], c * hp * wp, spec.K * pq, num_tiles),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, RELU=relu,
        FP32_DOT=xp.dtype == torch.float32, PRECISION=config.precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_kred,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
