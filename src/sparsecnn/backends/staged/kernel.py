"""Direct sparse convolution with the input tile staged in shared memory (fp32, CUDA C compiled at
run time for each layer geometry and config; the weights are data, not code).

Why. The Triton "batch" kernel (`backends/direct/kernel_batch.py`) gathers each input from L1/L2
per multiply-add: its programs of one channel share nothing on chip, and it is L2-bound with a low
L1 hit rate. Here a block of `warps` warps computes
`warps x rows_per_warp` output channels of one output tile (tile_h x tile_w pixels x 32 images)
and stages the tile's input window in shared memory, chunk_c input channels at a time (cp.async,
double-buffered, zeros outside the image: padding costs nothing): every staged value is read by
all the block's channels, so L2 traffic falls by that factor, and a read from shared memory has
no tag lookup or miss. The bound becomes shared-memory bandwidth: one 16-byte read per lane feeds
4 FMAs (128 bytes per clock per SM: 32 FMAs per clock per SM).

Layout. The input is batch-innermost, (N, C, H, W) stored as (C, H, W, N) (what "batch" layers
write; anything else is transposed first), N a multiple of 32: one staged position is the 32
images of one (c, h, w), 128 contiguous bytes, read by 8 lanes as float4s. Lane l owns images
4 (l % 8) .. 4 (l % 8) + 3 of pixel l // 8 of every group of 4 adjacent pixels of the tile
(tile_w % 4 == 0), so a warp's read covers 4 whole 128-byte rows (no bank conflicts) and the
pixel groups of a lane differ by compile-time offsets. The output (N, K, P, Q) has any strides;
batch-innermost outputs are written as float4s.

Non-zeros. `backends.staged.format.StagedCSRWeight`: per block of rows (output channels, dealt to warps by
decreasing non-zero count), per chunk of input channels, one contiguous segment of (weight bits,
offset into the staged tile) int32 pairs, copied to shared memory with the chunk's input (each
row's bounds are loaded from global memory a chunk ahead). Per non-zero a warp reads one pair
(a broadcast 8-byte shared load), then tile_h * tile_w / 4 input vectors, and does 4x as many
FMAs per lane. With the pairs read from global memory instead (uniform loads, L2 latency on every
step) the best config per layer ran slower.

It is fastest on large outputs (VGG layers of 56x56 and 112x112 outputs, where it is
shared-memory bound); on 14x14 and 7x7 outputs too few blocks fill the GPU and `direct` is faster
(see `auto_configs`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import torch

from sparsecnn.backends.staged.format import StagedCSRWeight
from sparsecnn.backends.staged.source import (
    IMAGES,
    KERNEL_NAME,
    LANES_PER_POSITION,
    kernel_source,
)
from sparsecnn.core import device, toolchain
from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.batch_pack import padded_batch_inner
from sparsecnn.core.checks import (
    check_kernel_shape,
    check_residual,
    check_triton_input,
    config_from_dict,
    launch_spec,
    stride_padding,
)
from sparsecnn.core.cubin_loader import LazyKernels
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.toolchain import DiskCache

_MAX_ACCUMULATORS = 128       # floats per thread; beyond this the accumulators spill
_MAX_GRID_Y = 65535
_MIN_AUTO_OUTPUTS = 28 * 28 * 32   # output pixels x images below which `auto` tries staged only on deep layers
_MIN_DEEP_OUTPUTS = 14 * 14 * 32   # ... and never below this
_MIN_DEEP_REDUCTION = 4096         # C * R * S of a deep layer
_WARPS_PER_SM = 16      # what the candidates aim for: two blocks of 8 warps (registers allow that many)
OUT_LAYOUTS = ("nchw", "batch_inner")


@dataclasses.dataclass(frozen=True)
class StagedConfig:
    """tile_h x tile_w: output pixels per block (tile_w a multiple of 4, tile_h * tile_w <= 32);
    chunk_c: input channels staged at a time (1..64); rows_per_warp: output channels per warp
    (1..16); warps: warps per block (1, 2, 4, 8). Each thread keeps rows_per_warp x tile_h x
    tile_w accumulators (at most 128). out_layout: the layout of a new output, "nchw" (contiguous)
    or "batch_inner" ((N, K, P, Q) stored as (K, P, Q, N), which the next staged or direct "batch"
    layer reads without a transpose); not tuned: `tuning.layout` sets it."""

    tile_h: int = 2
    tile_w: int = 4
    chunk_c: int = 16
    rows_per_warp: int = 4
    warps: int = 8
    out_layout: str = "nchw"

    def __post_init__(self):
        for name, low, high in (("tile_h", 1, 8), ("tile_w", 4, 32), ("chunk_c", 1, 64), ("rows_per_warp", 1, 16)):
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"StagedConfig.{name} must be an int in {low}..{high}, got {value!r}")
        if self.tile_w % 4:
            raise ValueError(f"StagedConfig.tile_w must be a multiple of 4, got {self.tile_w}")
        if self.tile_h * self.tile_w > 32:
            raise ValueError(f"StagedConfig tile {self.tile_h}x{self.tile_w} has more than 32 pixels")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"StagedConfig.warps must be 1, 2, 4 or 8, got {self.warps!r}")
        if self.out_layout not in OUT_LAYOUTS:
            raise ValueError(f"StagedConfig.out_layout must be one of {OUT_LAYOUTS}, got {self.out_layout!r}")
        if self.accumulators > _MAX_ACCUMULATORS:
            raise ValueError(f"StagedConfig: rows_per_warp * tile_h * tile_w = {self.accumulators} accumulators "
                             f"per thread (max {_MAX_ACCUMULATORS})")

    @property
    def accumulators(self) -> int:
        return self.rows_per_warp * self.tile_h * self.tile_w

    @property
    def rows_per_block(self) -> int:
        return self.rows_per_warp * self.warps

    def halo(self, spec: ConvSpec) -> Tuple[int, int]:
        """Input positions (rows, columns) one tile reads."""
        return (self.tile_h - 1) * spec.stride[0] + spec.R, (self.tile_w - 1) * spec.stride[1] + spec.S

    def smem_bytes(self, spec: ConvSpec) -> int:
        """Dynamic shared memory of a block: two stages of chunk_c x halo x 32 images, fp32."""
        halo_h, halo_w = self.halo(spec)
        return 2 * self.chunk_c * halo_h * halo_w * IMAGES * 4

    @classmethod
    def from_dict(cls, saved: dict) -> "StagedConfig":
        return config_from_dict(cls, saved)


def max_smem_bytes(props=None) -> int:
    """Dynamic shared memory a block may use on `props` (`device.resolve`: None is the current GPU,
    an H100 without one, 227 KB): its opt-in maximum per block."""
    return device.resolve(props).max_shared_per_block_optin


def check_layer(spec: ConvSpec, config: StagedConfig, props=None) -> None:
    """ValueError unless the kernel can run `spec` (groups and dilation 1 are the caller's) with
    `config` on `props` (None: the current GPU)."""
    if spec.N % IMAGES:
        raise ValueError(f"the staged kernel needs a batch size N that is a multiple of {IMAGES}, got {spec.N}")
    limit = max_smem_bytes(props)
    if config.smem_bytes(spec) > limit:
        raise ValueError(f"StagedConfig {config} needs {config.smem_bytes(spec)} bytes of shared memory for "
                         f"{spec.R}x{spec.S} stride {spec.stride} (max {limit}): lower chunk_c or the tile")
    if spec.N // IMAGES > _MAX_GRID_Y:
        raise ValueError(f"batch {spec.N} needs more than {_MAX_GRID_Y} image blocks")


def candidate_configs(spec: ConvSpec, props=None) -> List[StagedConfig]:
    """Configs for the autotuner, the heuristic default first: four tile and channel shapes, each
    with 8 warps per block, or 4 where the layer gives fewer than two blocks per SM, and the
    largest chunk_c (up to 16) whose two stages let `_WARPS_PER_SM` warps' blocks share an SM.

    On DLMC ResNet-50 and VGG layers, 4 x 4 pixels x 4 channels per warp won most large layers,
    2 x 4 x 8 and 2 x 4 x 4 the others; 1 x 4 pixels x 16 channels won none, and 2 warps per block
    lost to 4 on every layer. props: the GPU sized for (None: the current one; its SM count and
    shared memory per block).
    """
    props = device.resolve(props)
    limit, sms = max_smem_bytes(props), props.sm_count
    configs = []
    for tile_h, tile_w, rows_per_warp in ((4, 4, 4), (2, 4, 8), (2, 8, 4), (2, 4, 4)):
        warps = 8
        if _blocks(spec, tile_h, tile_w, rows_per_warp * warps) < 2 * sms:
            warps = 4
        blocks_per_sm = _WARPS_PER_SM // warps
        for chunk_c in (16, 8, 4, 2, 1):
            config = StagedConfig(tile_h, tile_w, chunk_c, rows_per_warp, warps)
            if config.smem_bytes(spec) * blocks_per_sm <= limit or chunk_c == 1:
                break
        if config.smem_bytes(spec) <= limit:
            configs.append(config)
    return list(dict.fromkeys(configs))


def auto_configs(spec: ConvSpec, props=None) -> List[StagedConfig]:
    """The candidates `backend="auto"` tries: all of `candidate_configs` on layers of at least
    28 x 28 output pixels x 32 images, and on layers of 14 x 14 x 32 with a reduction C * R * S of
    at least 4096; none on the others. On DLMC ResNet-50 and VGG layers `staged` beat `direct` on
    most layers with 28x28 to 112x112 outputs, and rarely at 14x14 and 7x7: too few blocks to fill
    the GPU there, except where each staged chunk feeds many non-zeros (vgg-512x14-512 won;
    ResNet-50's 14x14 layers, C * R * S <= 2304, lost). Each candidate costs a compile and a timed
    run while tuning."""
    outputs = spec.P * spec.Q * spec.N
    deep = outputs >= _MIN_DEEP_OUTPUTS and spec.C * spec.R * spec.S >= _MIN_DEEP_REDUCTION
    return candidate_configs(spec, props) if outputs >= _MIN_AUTO_OUTPUTS or deep else []


def _blocks(spec: ConvSpec, tile_h: int, tile_w: int, rows_per_block: int) -> int:
    tiles = -(-spec.P // tile_h) * -(-spec.Q // tile_w)
    return tiles * -(-spec.K // rows_per_block) * max(1, spec.N // IMAGES)


def compiled_kernel(spec: ConvSpec, config: StagedConfig, arch=None) -> LazyKernels:
    """The kernel for this geometry (only R, S and the stride of `spec` matter) and config, for
    `arch` ("86", DeviceProperties; None: the current GPU's): its cubin from the disk cache (keyed
    by source, toolchain and arch) or nvcc/ptxas."""
    props = device.current() if arch is None else device.resolve(arch)
    return _compiled_kernel(spec, config, _target_arch(props), props.max_shared_per_block_optin)


@functools.lru_cache(maxsize=None)
def _target_arch(props: device.DeviceProperties) -> str:
    return toolchain.target_arch(props)


@functools.lru_cache(maxsize=None)
def _compiled_kernel(spec: ConvSpec, config: StagedConfig, arch: str, smem_limit: int) -> LazyKernels:
    return LazyKernels([cubin(spec, config, arch)], KERNEL_NAME, smem_limit)


def cubin(spec: ConvSpec, config: StagedConfig, arch: str) -> bytes:
    """The kernel's cubin for the geometry of `spec` (R, S, stride) and `config` on sm_`arch` (a
    `target_arch` string): from the disk cache (keyed by source, toolchain and arch), else compiled
    by nvcc and ptxas into it. Needs no GPU, so worker processes compile ahead of tuning
    (`compile_into_cache`); one process compiles a key at a time, the others then read it."""
    source = kernel_source(spec, config)
    cache = DiskCache()
    key = toolchain.cache_key("staged", source, toolchain.toolchain_id(arch))
    compiled = cache.get(key, "cubin")
    if compiled is None:
        with cache.exclusive(key):
            compiled = cache.get(key, "cubin")
            if compiled is None:
                ptx, _ = toolchain.nvcc_ptx(source, arch)
                compiled, _, _ = toolchain.ptxas_cubin(ptx, arch)
                cache.put(key, "cubin", compiled)
    return compiled


def compile_into_cache(spec: ConvSpec, config: StagedConfig, arch: str) -> None:
    """`cubin` for a worker process: the result stays in the disk cache, where the first call finds it."""
    cubin(geometry(spec), config, arch)


def target_arch(props=None) -> str:
    """The arch string kernels are compiled for on `props` (None: the current GPU, or the nominal one)."""
    return _target_arch(device.resolve(props))


def geometry(spec: ConvSpec) -> ConvSpec:
    """What a kernel's source depends on: the kernel size and stride (the rest is runtime ints)."""
    return ConvSpec(IMAGES, 1, 1, spec.R, spec.S, spec.R, spec.S, spec.stride, (0, 0))


def pack_weight(weight: torch.Tensor, config: StagedConfig) -> StagedCSRWeight:
    """The layer's dense (K, C, R, S) weight (zeros pruned) packed for `config`, on weight's device."""
    return StagedCSRWeight.from_dense(weight, config.chunk_c, config.rows_per_warp, config.warps)


def weight_arrays(packed: StagedCSRWeight, spec: ConvSpec, config: StagedConfig) -> Tuple[torch.Tensor, ...]:
    """(entries, chunk_ptr, channel): what the kernel reads for `spec` (entries depend on its stride)."""
    if packed.chunk_c != config.chunk_c or packed.rows_per_block != config.rows_per_block:
        raise ValueError(f"weight packed for chunk_c={packed.chunk_c} and {packed.channel.numel()} rows does not "
                         f"fit config {config}: pack it with this config")
    return packed.entries(*config.halo(spec), LANES_PER_POSITION), packed.chunk_ptr, packed.channel


def epilogue_flags(relu: bool, has_bias: bool, has_residual: bool, out_vectors: bool, pool: bool = False) -> int:
    """The kernel's `flags`: bit 0 ReLU, 1 bias, 2 residual, 3 float4 stores (out_vectors: the output
    and residual are batch-innermost, stride 1 along N and 16-byte aligned), 4 a 2x2 stride-2 max pool
    of act(conv + bias) written instead of it (no residual)."""
    return int(relu) | int(has_bias) << 1 | int(has_residual) << 2 | int(out_vectors) << 3 | int(pool) << 4


POOL_WINDOWS = (0, 2)   # the `pool` argument: none, or a 2x2 max pool with stride 2, no padding, floor mode


def pooled_shape(shape: Tuple[int, ...], pool: int) -> Tuple[int, ...]:
    """The (N, K, P, Q) output after the kernel's `pool` (0: none, 2: 2x2 stride 2, floor)."""
    n, k, p, q = shape
    return (n, k, p // 2, q // 2) if pool else (n, k, p, q)


def check_pool(pool: int, config: StagedConfig, spec: ConvSpec, has_residual: bool) -> None:
    """ValueError unless the kernel can pool this layer's output with `config` (`pool` in POOL_WINDOWS)."""
    if pool not in POOL_WINDOWS:
        raise ValueError(f"pool must be one of {POOL_WINDOWS} (a 2x2 stride-2 max pool), got {pool!r}")
    if not pool:
        return
    if config.tile_h % 2:
        raise ValueError(f"a fused 2x2 pool needs an even tile_h, config {config} has {config.tile_h}")
    if has_residual:
        raise ValueError("a fused pool takes no residual")
    if spec.P < 2 or spec.Q < 2:
        raise ValueError(f"a 2x2 pool of a {spec.P}x{spec.Q} output is empty")


def launch_geometry(spec: ConvSpec, config: StagedConfig, n_rows: int, n_chunks: int, max_segment: int,
                    out_strides, flags: int) -> Tuple[Tuple[int, int, int], Tuple[int, ...]]:
    """(grid, the kernel's int arguments) for `spec` with an output of `out_strides` (elements,
    (N, K, P, Q) order) and epilogue `flags`: blocks are (channel group fastest, then output tile)
    x image blocks."""
    tiles_w = -(-spec.Q // config.tile_w)
    tiles = -(-spec.P // config.tile_h) * tiles_w
    groups = n_rows // config.rows_per_block
    grid = (tiles * groups, spec.N // IMAGES, 1)
    ints = (spec.C, spec.H, spec.W, spec.N, spec.P, spec.Q, spec.padding[0], spec.padding[1], tiles_w, groups,
            n_chunks, max_segment, *out_strides, flags)
    return grid, ints


def shared_bytes(spec: ConvSpec, config: StagedConfig, max_segment: int) -> int:
    """Dynamic shared memory of a launch: two stages of input and of non-zeros (8 bytes each)."""
    return config.smem_bytes(spec) + 2 * 8 * max_segment


def _check_arrays(x: torch.Tensor, entries: torch.Tensor, chunk_ptr: torch.Tensor, channel: torch.Tensor,
                  spec: ConvSpec, config: StagedConfig, max_segment: int, props=None) -> None:
    n_chunks = -(-spec.C // config.chunk_c)
    rows = channel.numel()
    blocks = rows // config.rows_per_block
    limit = max_smem_bytes(props)
    if shared_bytes(spec, config, max_segment) > limit:
        raise ValueError(f"StagedConfig {config} with up to {max_segment} non-zeros per block and chunk needs "
                         f"{shared_bytes(spec, config, max_segment)} bytes of shared memory (max {limit}):"
                         f" lower chunk_c or rows per block")
    if (entries.dtype != torch.int32 or entries.dim() != 2 or entries.shape[1] != 2
            or chunk_ptr.dtype != torch.int32 or chunk_ptr.shape != (blocks, n_chunks, config.rows_per_block + 1)
            or channel.dtype != torch.int32 or channel.dim() != 1 or rows % config.rows_per_block or rows < spec.K):
        raise ValueError(f"packed arrays do not fit {spec.K} channels in chunks of {config.chunk_c} of {spec.C} "
                         f"inputs with {config.rows_per_block} rows per block: entries {entries.dtype} "
                         f"{tuple(entries.shape)}, chunk_ptr {chunk_ptr.dtype} {tuple(chunk_ptr.shape)}, channel "
                         f"{channel.dtype} {tuple(channel.shape)}")
    for name, tensor in (("entries", entries), ("chunk_ptr", chunk_ptr), ("channel", channel)):
        if tensor.device != x.device or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {x.device}, got {tensor.device}")


def staged_conv2d_arrays(x: torch.Tensor, entries: torch.Tensor, chunk_ptr: torch.Tensor, channel: torch.Tensor,
                         kernel_shape, max_segment: int, bias: Optional[torch.Tensor],
                         residual: Optional[torch.Tensor], stride, padding, config: StagedConfig, relu: bool = False,
                         out: Optional[torch.Tensor] = None, pool: int = 0) -> torch.Tensor:
    """act(conv(x) + bias + residual), the launcher the op `sparsecnn::staged_conv2d` binds; with
    pool 2, max_pool2d(act(conv(x) + bias), 2) (the pool fused into the epilogue; no residual).

    x: (N, C, H, W) float32 CUDA, N a multiple of 32, any strides (batch-innermost is read in
    place, anything else is transposed first); entries/chunk_ptr/channel: `weight_arrays` for this
    layer and config; kernel_shape (K, C, R, S); max_segment: the weight's `max_segment`; bias:
    (K,) or None; residual: (N, K, P, Q) or None; out: (N, K, P, Q) float32 with any strides
    (default: new, in config.out_layout), (N, K, P // 2, Q // 2) with pool 2.
    Returns out.
    """
    (sh, sw), (ph, pw) = stride_padding(stride, padding)
    check_triton_input(x, "staged", (torch.float32,))
    if not x.is_cuda:
        raise ValueError(f"x must be on CUDA for the staged kernel, got {x.device}")
    kernel_k, kernel_c, _, _ = check_kernel_shape(tuple(kernel_shape))
    if x.shape[1] != kernel_c:
        raise ValueError(f"x has {x.shape[1]} channels, the weight expects {kernel_c}")
    spec = launch_spec(tuple(x.shape), tuple(kernel_shape), (sh, sw), (ph, pw))
    props = device.of_index(x.device.index)
    check_layer(spec, config, props)
    _check_arrays(x, entries, chunk_ptr, channel, spec, config, max_segment, props)
    check_residual(residual, spec.output_shape, x)
    check_pool(pool, config, spec, residual is not None)
    out_shape = pooled_shape(spec.output_shape, pool)
    if bias is not None and (bias.shape != (kernel_k,) or bias.dtype != torch.float32 or bias.device != x.device):
        raise ValueError(f"bias must be a float32 ({kernel_k},) tensor on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    if out is None:
        out = new_output(out_shape, x, config.out_layout)
    elif out.shape != out_shape or out.dtype != torch.float32 or out.device != x.device:
        raise ValueError(f"out must be a float32 {out_shape} tensor on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if spec.N == 0:
        return out
    xt = padded_batch_inner(x, 0, 0)
    out_vectors = out.stride(0) == 1 and out.data_ptr() % 16 == 0 and all(s % 4 == 0 for s in out.stride()[1:])
    if residual is not None and residual.stride() != out.stride():
        residual = torch.empty_like(out).copy_(residual)   # the epilogue reads it at out's offsets
    bias = None if bias is None else bias.contiguous()
    compiled = compiled_kernel(geometry(spec), config, props)
    flags = epilogue_flags(relu, bias is not None, residual is not None, out_vectors, bool(pool))
    grid, ints = launch_geometry(spec, config, channel.numel(), chunk_ptr.shape[1], max_segment, out.stride(), flags)
    pointers = (xt.data_ptr(), entries.data_ptr(), chunk_ptr.data_ptr(), channel.data_ptr(),
                bias.data_ptr() if bias is not None else 0, residual.data_ptr() if residual is not None else 0,
                out.data_ptr())
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        compiled.kernels(x.device.index)[0].launch(grid, (config.warps * 32, 1, 1), pointers, ints, stream,
                                                   shared_bytes(spec, config, max_segment))
    return out


def staged_conv2d(x: torch.Tensor, packed: StagedCSRWeight, stride, padding, config: StagedConfig,
                  bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None, relu: bool = False,
                  out: Optional[torch.Tensor] = None, pool: int = 0) -> torch.Tensor:
    """`staged_conv2d_arrays` on a weight packed by `pack_weight` with `config`."""
    (sh, sw), (ph, pw) = stride_padding(stride, padding)
    spec = launch_spec(tuple(x.shape), tuple(packed.kernel_shape), (sh, sw), (ph, pw))
    arrays = weight_arrays(packed, spec, config)
    return staged_conv2d_arrays(x, *arrays, packed.kernel_shape, packed.max_segment, bias, residual, (sh, sw),
                                (ph, pw), config, relu, out, pool)
