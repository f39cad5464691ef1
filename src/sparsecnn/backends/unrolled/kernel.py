"""Unrolled sparse convolution on batch-innermost activations: one layer's weights as FMA immediates
(paper 002's idea on the layout of the "batch" kernels), fp32 or fp16, PTX written here and compiled
by ptxas at run time per layer, input shape and dtype (`source.py`). fp16 (`compile_layer(...,
dtype=torch.float16)`): packed f16x2 pairs over two images, partial sums flushed to fp32 every few
terms (`source.py` says why), its own candidates (`HALF_CANDIDATES`: one slice), input, bias,
residual and output all float16, an odd N packed with a zero image that is never stored.

Why. The Triton "batch" kernel (`backends/direct/kernel_batch.py`) loads one input per non-zero and
image: L2-bound on ResNet-50's 14x14 and 7x7 layers; `staged` reads
one shared-memory value per non-zero and image. Here a thread keeps `bk` output channels'
accumulators and, per input column (c, r, s) of its group, loads its input once and applies every
non-zero of that column in the group: at 90% sparsity and bk = 32 about 3 FMAs per load, and no
index or weight is loaded (they are code). The price is code: one FMA instruction per non-zero,
compiled per layer (ptxas time grows with the non-zeros; cached on disk). A layer over PART_FMAS
non-zeros (only under a limit raised by $SPARSECNN_UNROLLED_MAX_NNZ) compiles as several modules at
once (ptxas time grows faster than the code), run on concurrent streams.

Against `direct` "batch" (ResNet-50, fp32, batch-innermost input and output): faster on most
28x28, 14x14 and 7x7 layers (not on 1x1 expansions bound by their output and residual traffic),
slower on a 56x56 1x1 layer.

Layout. Input (N, C, H, W) read batch-innermost as (C, H + 2 ph, W + 2 pw, N) (a batch-innermost
input without padding in place, anything else packed first); output (N, K, P, Q) at any strides
(config.out_layout for a new one), residual at the output's strides.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

import sparsecnn.settings as settings
from sparsecnn.backends.unrolled import source as unrolled_source
from sparsecnn.backends.unrolled.source import KERNEL_NAME, kernel_ptx
from sparsecnn.core import spec as spec_module
from sparsecnn.core import toolchain
from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.batch_pack import padded_batch_inner
from sparsecnn.core.checks import check_residual, check_triton_input, config_from_dict
from sparsecnn.core.cubin_loader import LazyKernels
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.toolchain import DiskCache

_MAX_GRID_Y = 65535
# Non-zeros per layer: bounds compile time and code size (ptxas time grows with the non-zeros).
# A higher limit lengthens tuning from empty caches for little gain: the few larger layers save
# little of the model's time.
MAX_KERNEL_FMAS = settings.UNROLLED_MAX_NNZ_DEFAULT  # 60_000
# Non-zeros per compiled module (`layer_modules`): ptxas time grows faster than the module, so a layer
# over the limit raised by $SPARSECNN_UNROLLED_MAX_NNZ compiles as several modules at once, launched on
# concurrent streams (`_concurrent_streams`). Layers under the default limit stay one module: split
# smaller, tuning from empty caches was no faster, and each split layer costs a launch and a
# stream fork.
PART_FMAS = MAX_KERNEL_FMAS
_COMPILE_THREADS = 4   # ptxas processes per layer at once (layers compile in parallel workers too)
OUT_LAYOUTS = ("nchw", "batch_inner")
BK_CHOICES = (32, 16, 8)
SLICE_CHOICES = (1, 2, 4)
TQ_CHOICES = (2, 4)   # output columns per thread of the register-tiled candidates (timed slower: not in `auto_config`)
MAX_ACCUMULATORS = 128   # bk * tq per thread
MAX_SHARED_BYTES = 48 * 1024   # static shared memory of a block (the partial sums of slices 1..)
MIN_THREADS_PER_COLUMN = 85   # `auto_config`: threads per input column (C*R*S) a group walks


@dataclasses.dataclass(frozen=True)
class UnrolledConfig:
    """bk: output channels per thread (1..128: its accumulators); threads: threads per block (a
    multiple of 32, at most 1024); out_layout: the layout of a new output, "nchw" (contiguous) or
    "batch_inner" ((N, K, P, Q) stored as (K, P, Q, N)); not tuned: `tuning.layout` sets it; slices:
    warp rows per block (1..8), each walking a share of the group's input columns for the same
    positions, the partial sums added through shared memory: `slices` times the warps, for layers
    whose few positions leave the GPU's schedulers idle (latency-bound: Nsight Compute); tq: output
    columns per thread (1..8, a divisor of the layer's Q, `check_layer`): a loaded input value feeds
    every tap and output column reading it, (tq - 1) * stride + S loads per input row instead of
    tq * S, for tq times the accumulators and a tq-th of the threads."""

    bk: int = 32
    threads: int = 128
    out_layout: str = "nchw"
    slices: int = 1
    tq: int = 1

    def __post_init__(self):
        for name in ("bk", "threads", "slices", "tq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"UnrolledConfig.{name} must be a positive int, got {value!r}")
        if self.bk > 128:
            raise ValueError(f"UnrolledConfig.bk must be at most 128 (accumulators per thread), got {self.bk}")
        if self.threads % 32 or self.threads > 1024:
            raise ValueError(f"UnrolledConfig.threads must be a multiple of 32 and <= 1024, got {self.threads}")
        if self.slices > 8 or self.threads * self.slices > 1024:
            raise ValueError(f"UnrolledConfig.slices must be at most 8 with threads * slices <= 1024, got "
                             f"{self.slices} slices of {self.threads} threads")
        if self.tq > 8 or self.bk * self.tq > MAX_ACCUMULATORS:
            raise ValueError(f"UnrolledConfig.tq must be at most 8 with bk * tq <= {MAX_ACCUMULATORS} "
                             f"accumulators, got tq={self.tq}, bk={self.bk}")
        if 4 * (self.slices - 1) * self.bk * self.tq * self.threads > MAX_SHARED_BYTES:
            raise ValueError(f"UnrolledConfig.slices: {self.slices} slices of bk={self.bk} x {self.threads} threads "
                             f"need more than {MAX_SHARED_BYTES} bytes of shared memory for their partial sums")
        if self.out_layout not in OUT_LAYOUTS:
            raise ValueError(f"UnrolledConfig.out_layout must be one of {OUT_LAYOUTS}, got {self.out_layout!r}")

    @classmethod
    def from_dict(cls, saved: dict) -> "UnrolledConfig":
        return config_from_dict(cls, saved)


# Batch-innermost outputs (see `auto_config`); `auto` tries one of these per layer.
CANDIDATES = tuple([UnrolledConfig(bk, threads, "batch_inner", slices) for slices in SLICE_CHOICES
                    for bk in BK_CHOICES for threads in (128, 64)]
                   + [UnrolledConfig(bk, 128, "batch_inner", 1, tq) for tq in TQ_CHOICES for bk in BK_CHOICES
                      if bk * tq <= 64])
# float16 (`source._HalfWriter`): one slice; a slot costs three registers (its f16x2 partial and the
# pair's two fp32 sums), so at most 32 slots (bk * tq) per thread.
HALF_CANDIDATES = tuple([UnrolledConfig(bk, threads, "batch_inner") for bk in BK_CHOICES for threads in (128, 64)]
                        + [UnrolledConfig(bk, 128, "batch_inner", 1, 2) for bk in BK_CHOICES if bk * 2 <= 32])
DTYPES = (torch.float32, torch.float16)


def _is_half(dtype: torch.dtype) -> bool:
    if dtype not in DTYPES:
        raise ValueError(f"the unrolled kernel runs {DTYPES}, got {dtype}")
    return dtype == torch.float16


def check_layer(spec: ConvSpec, config: UnrolledConfig, nnz: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """ValueError unless the kernel runs this layer with `config` at `dtype` (nnz: the weight's
    non-zeros)."""
    if spec.groups != 1 or spec.dilation != (1, 1):
        raise ValueError("the unrolled kernel runs groups=1, dilation=1 only")
    if _is_half(dtype) and config.slices != 1:
        raise ValueError(f"the float16 unrolled kernel runs one slice, got slices={config.slices}")
    if -(-spec.K // config.bk) > _MAX_GRID_Y:
        raise ValueError(f"{spec.K} channels in groups of {config.bk} exceed the grid's {_MAX_GRID_Y} rows")
    padded = spec.C * (spec.H + 2 * spec.padding[0]) * (spec.W + 2 * spec.padding[1]) * spec.N
    if 4 * padded >= 2 ** 31 or 4 * spec.K * spec.P * spec.Q * spec.N >= 2 ** 31:
        raise ValueError("the unrolled kernel addresses input and output with 32-bit byte offsets: layer too large")
    if spec.Q % config.tq:
        raise ValueError(f"tq={config.tq} output columns per thread do not divide the layer's {spec.Q}")
    if nnz > max_kernel_fmas():
        raise ValueError(f"{nnz} non-zeros exceed the unrolled kernel's {max_kernel_fmas()} (compile time; "
                         f"${settings.UNROLLED_MAX_NNZ.name} raises it)")


def thread_positions(spec: ConvSpec, config: UnrolledConfig, dtype: torch.dtype = torch.float32) -> int:
    """Threads per channel group and slice: one per image (float16: per pair of images) and run of
    config.tq output columns."""
    return spec.P * (spec.Q // config.tq) * (-(-spec.N // 2) if _is_half(dtype) else spec.N)


def max_kernel_fmas() -> int:
    """The most non-zeros one layer's kernel may hold: $SPARSECNN_UNROLLED_MAX_NNZ (a positive int)
    when set, else MAX_KERNEL_FMAS. Raising it trades tuning time (ptxas) for larger layers; layers
    tuned to `unrolled` under a raised limit need it again to bind."""
    return settings.unrolled_max_nnz()


def candidate_configs(spec: ConvSpec, nnz: int, dtype: torch.dtype = torch.float32) -> List[UnrolledConfig]:
    """The candidates of `dtype` (CANDIDATES, HALF_CANDIDATES) `check_layer` accepts for this layer
    and a weight of `nnz` non-zeros."""
    fitting = []
    for config in HALF_CANDIDATES if _is_half(dtype) else CANDIDATES:
        try:
            check_layer(spec, config, nnz, dtype)
        except ValueError:
            continue
        fitting.append(config)
    return fitting


def auto_config(spec: ConvSpec, dtype: torch.dtype = torch.float32) -> UnrolledConfig:
    """One config per layer, as each costs a compile: the largest bk of BK_CHOICES that leaves at
    least MIN_THREADS_PER_COLUMN threads per input column (C*R*S) a group walks through, 128 threads
    per block. More channels per thread mean fewer loads per FMA, but fewer threads, each walking
    all the columns. Where that rule gives up channels (bk < 32: many columns for few positions),
    bk 32 with two slices instead: the slices bring the threads back without the extra loads.
    Measured on ResNet-50 (DLMC, N=32, benchmarks/unrolled_sweep.py): on layer3's 14x14 layers
    bk 32 with two slices ran 1.16-1.48x faster than the one-slice rule's bk 16 or 8; where the rule
    keeps bk 32 (layer2, 28x28), a second slice ran 0.87-1.0x.
    Batch-innermost output: a warp holds 32 positions of one pixel, so an NCHW store scatters them
    K*P*Q apart; tuned layers of "batch" backends write batch-innermost (`tuning.layout`), so their
    candidates are timed that way (with NCHW-writing candidates no ResNet-50 layer2 layer chose
    unrolled).
    float16 (the default when the backend is named without a config; `auto` tries none): the same rule
    over pairs of images, one slice, bk 8 where no bk keeps enough threads."""
    if _is_half(dtype):
        threads = spec.P * spec.Q * -(-spec.N // 2)
        bk = next((bk for bk in BK_CHOICES
                   if threads * -(-spec.K // bk) >= MIN_THREADS_PER_COLUMN * spec.C * spec.R * spec.S), BK_CHOICES[-1])
        return UnrolledConfig(bk, 128, "batch_inner")
    threads = spec.P * spec.Q * spec.N
    bk = next((bk for bk in BK_CHOICES
               if threads * -(-spec.K // bk) >= MIN_THREADS_PER_COLUMN * spec.C * spec.R * spec.S), None)
    if bk == BK_CHOICES[0]:
        return UnrolledConfig(bk, 128, "batch_inner")
    return UnrolledConfig(BK_CHOICES[0], 128, "batch_inner", slices=2)


@dataclasses.dataclass(eq=False)
class CompiledUnrolled:
    """One layer's kernel at one input shape: its cubins (one per module, `unrolled_source.split_groups`;
    each loaded per device on first use) with the number of channel groups each computes, the layer
    and config it runs, and what compiling it cost (registers: the most of any module, -1 when every
    module came from the cache); dtype: what it computes in (float32 or float16). Compared and hashed
    by identity (the op's handle registry keys it weakly)."""

    cubins: Tuple[bytes, ...]
    group_counts: Tuple[int, ...]
    spec: ConvSpec
    config: UnrolledConfig
    compile_s: float
    registers: int
    spill_bytes: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        _is_half(self.dtype)
        if len(self.cubins) != len(self.group_counts) or not self.cubins:
            raise ValueError(f"{len(self.cubins)} cubins for {len(self.group_counts)} group counts")
        self._modules = LazyKernels(self.cubins, KERNEL_NAME)

    def kernels(self, device_index: int) -> List[object]:
        """The loaded kernel of each module on CUDA device `device_index` (group_counts: their groups)."""
        return self._modules.kernels(device_index)

    def fields(self) -> tuple:
        """What rebuilds it in another process (`CompiledUnrolled(*fields)`): the loaded kernels stay."""
        return (self.cubins, self.group_counts, self.spec, self.config, self.compile_s, self.registers,
                self.spill_bytes, self.dtype)


@functools.lru_cache(maxsize=1)
def _generator_digest() -> str:
    """Digest of the code that writes the PTX (`unrolled_source` and the ConvSpec it reads)."""
    return toolchain.cache_key(*(Path(module.__file__).read_bytes() for module in (unrolled_source, spec_module)))


def _cache_key(weight: torch.Tensor, spec: ConvSpec, config: UnrolledConfig, arch: str,
               dtype: torch.dtype = torch.float32) -> str:
    """A kernel's cache key: the weight's bytes, the layer without its name, the tiling, the dtype, the generator's
    digest and the toolchain and arch, not the PTX itself: writing the PTX is slow enough that loading an
    artefact would pay it for every layer."""
    layer = dataclasses.replace(spec, name="")
    return toolchain.cache_key("unrolled", weight.numpy().tobytes(), tuple(weight.shape), repr(layer), config.bk,
                               config.threads, config.slices, config.tq, str(dtype), _generator_digest(),
                               toolchain.toolchain_id(arch))


def layer_modules(weight: np.ndarray, config: UnrolledConfig,
                  part_fmas: Optional[int] = None) -> List[List[List[int]]]:
    """The channel groups of each module a layer (weight (K, C, R, S)) compiles to: runs of at most
    `part_fmas` (default PART_FMAS) non-zeros (`unrolled_source.split_groups`)."""
    groups = unrolled_source.channel_groups(weight, config.bk)
    return unrolled_source.split_groups(weight, groups, PART_FMAS if part_fmas is None else part_fmas)


def compile_layer(weight: torch.Tensor, spec: ConvSpec, config: UnrolledConfig,
                  cache: Optional[DiskCache] = None, arch=None, dtype: torch.dtype = torch.float32) -> CompiledUnrolled:
    """The kernel of this layer (weight (K, C, R, S), zeros pruned, exact in float32) at spec's input
    shape: its modules' cubins from `cache` (default: the codegen disk cache; `_cache_key`) or ptxas,
    the missing modules compiled at once. The output layout is not compiled in (the launcher passes
    strides). arch: the target ("86", DeviceProperties; None: the current GPU's, sm_90 without one);
    dtype: float32, or float16 (the weight rounded to float16, which must leave it finite)."""
    arch = toolchain.target_arch(arch)
    weight = weight.detach().to("cpu", torch.float32).contiguous()
    check_layer(spec, config, int(torch.count_nonzero(weight)), dtype)
    start = time.perf_counter()
    cache = cache or DiskCache()
    modules = layer_modules(weight.numpy(), config)
    key = _cache_key(weight, spec, config, arch, dtype)
    suffixes = [f"{index}of{len(modules)}.cubin" for index in range(len(modules))]
    cubins = [cache.get(key, suffix) for suffix in suffixes]
    registers, spills = -1, 0
    if None in cubins:
        with cache.exclusive(key):
            cubins = [cache.get(key, suffix) for suffix in suffixes]
            missing = [index for index, cubin in enumerate(cubins) if cubin is None]
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(missing), _COMPILE_THREADS))) as pool:
                results = pool.map(lambda index: toolchain.ptxas_cubin(
                    kernel_ptx(weight.numpy(), spec, config.bk, config.threads, modules[index], arch, config.slices,
                               config.tq, _is_half(dtype)), arch), missing)
                for index, (cubin, info, _) in zip(missing, results):
                    cubins[index] = cubin
                    registers = max(registers, info.registers)
                    spills += info.spill_stores + info.spill_loads
                    cache.put(key, suffixes[index], cubin)
    return CompiledUnrolled(tuple(cubins), tuple(len(groups) for groups in modules), spec, config,
                            time.perf_counter() - start, registers, spills, dtype)


def unrolled_conv2d(x: torch.Tensor, compiled: CompiledUnrolled, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, relu: bool = False,
                    config: Optional[UnrolledConfig] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(conv(x) + bias + residual) for the layer `compiled` was built for.

    x: (N, C, H, W) CUDA of that layer's input shape and the kernel's dtype (compiled.dtype: float32
    or float16), any strides; bias: (K,) of that dtype too (float16 kernels: float16, as a half
    model's bias is; added in fp32) or None; residual: (N, K, P, Q) of that dtype or None (copied
    when its strides differ from the output's); config: the layout of a new output (default:
    compiled.config's); out: an (N, K, P, Q) tensor of that dtype with any strides (default: new).
    Returns out. float16 with an odd N: the input is packed with a zero image after the last (a
    thread owns a pair of images), whose results are not stored.
    """
    spec, dtype = compiled.spec, compiled.dtype
    check_triton_input(x, "unrolled", (dtype,))
    if not x.is_cuda:
        raise ValueError(f"x must be on CUDA for the unrolled kernel, got {x.device}")
    if tuple(x.shape) != spec.input_shape:
        raise ValueError(f"x has shape {tuple(x.shape)}, the kernel was compiled for {spec.input_shape}")
    check_residual(residual, spec.output_shape, x)
    if bias is not None and (bias.shape != (spec.K,) or bias.dtype != dtype or bias.device != x.device):
        raise ValueError(f"bias must be a {dtype} ({spec.K},) tensor on {x.device} (the kernel's dtype), got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if out is None:
        out = new_output(spec.output_shape, x, (config or compiled.config).out_layout)
    elif tuple(out.shape) != spec.output_shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"out must be a {dtype} {spec.output_shape} tensor on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if spec.N == 0:
        return out
    if residual is not None and residual.stride() != out.stride():
        residual = torch.empty_like(out).copy_(residual)
    one_by_one = spec.R == 1 and spec.S == 1
    if dtype == torch.float16 and spec.N % 2:   # the pairs' last image: zero, never stored
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    xt = padded_batch_inner(x, *spec.padding, step=spec.stride if one_by_one else (1, 1))
    bias = None if bias is None else bias.contiguous()
    blocks = -(-thread_positions(spec, compiled.config, dtype) // compiled.config.threads)
    pointers = (xt.data_ptr(), bias.data_ptr() if bias is not None else 0,
                residual.data_ptr() if residual is not None else 0, out.data_ptr())
    flags = int(relu) | int(bias is not None) << 1 | int(residual is not None) << 2
    kernels = compiled.kernels(x.device.index)
    ints = (flags, *out.stride())

    def launch(kernel, groups: int, stream: torch.cuda.Stream) -> None:
        kernel.launch((blocks, groups, 1), (compiled.config.threads, compiled.config.slices, 1), pointers, ints,
                      stream.cuda_stream)

    with torch.cuda.device(x.device):
        if len(kernels) == 1:   # eager calls are CPU-bound: no stream fork for one module
            launch(kernels[0], compiled.group_counts[0], torch.cuda.current_stream(x.device))
            return out
        with _concurrent_streams(x.device, len(kernels)) as streams:
            for kernel, groups, stream in zip(kernels, compiled.group_counts, streams):
                launch(kernel, groups, stream)
    return out


_SIDE_STREAMS: Dict[int, List[Tuple[torch.cuda.Stream, torch.cuda.Event]]] = {}
_FORK_EVENTS: Dict[int, torch.cuda.Event] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _concurrent_streams(device: torch.device, count: int) -> Iterator[List[torch.cuda.Stream]]:
    """`count` streams whose work runs concurrently and is ordered after the current stream's work so
    far and before its work after the block: the current stream, then side streams (made once per
    device, with their events) that wait for it on entry and that it waits for on exit (CUDA graphs
    capture the fork and the join). A layer's modules each hold a share of its channel groups; one
    after another on one stream, each launch left most of the GPU idle (VGG16's 28x28 layers ran 1.2x
    slower)."""
    current = torch.cuda.current_stream(device)
    with _SIDE_STREAMS_LOCK:   # held to the join: the streams and events serve one caller at a time
        side = _SIDE_STREAMS.setdefault(device.index, [])
        while len(side) < count - 1:
            side.append((torch.cuda.Stream(device), torch.cuda.Event()))
        side = side[:count - 1]
        fork = _FORK_EVENTS.setdefault(device.index, torch.cuda.Event())
        fork.record(current)
        for stream, _ in side:
            stream.wait_event(fork)
        try:
            yield [current, *(stream for stream, _ in side)]
        finally:
            for stream, joined in side:
                joined.record(stream)
                current.wait_event(joined)
