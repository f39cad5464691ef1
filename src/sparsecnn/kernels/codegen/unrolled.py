"""Unrolled sparse convolution on batch-innermost activations: one layer's weights as FMA immediates
(paper 002's idea on the layout of the "batch" kernels), fp32, PTX written and compiled by ptxas at run
time per layer and input shape (`unrolled_source.py`).

Why. The Triton "batch" kernel (`kernels/triton/direct_batch.py`) loads one input vector per
non-zero: L2-bound at ~12 FMAs per clock per SM on ResNet-50's 14x14 and 7x7 layers. `staged`
reads one shared-memory vector per non-zero. Here a thread keeps `bk` output channels' accumulators
and, per input column (c, r, s) of its group, loads its `vec` images once and applies every
non-zero of that column in the group: at 90% sparsity and bk = 32 about 3 FMAs per load, with no
index or weight loads (they are code). The price is code: one FMA instruction per non-zero and
image, compiled per layer (ptxas, seconds; cached on disk by PTX).

Layout. Input (N, C, H, W) read batch-innermost as (C, H + 2 ph, W + 2 pw, N), N a multiple of
vec (a batch-innermost input without padding in place, anything else packed first); output and
residual batch-innermost (vector stores).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Dict, List, Optional

import torch

from ...layers import ConvSpec
from ..batch_inner import batch_inner_view, is_batch_inner
from ..configs import check_residual, check_triton_input, config_from_dict
from ..triton.direct_batch import padded_batch_inner
from . import toolchain
from .toolchain import DiskCache
from .unrolled_source import KERNEL_NAME, kernel_ptx

_MAX_ACCUMULATORS = 128   # floats per thread; beyond this they spill
_MAX_GRID_Y = 65535
MAX_KERNEL_FMAS = 400_000  # FMA instructions per layer (non-zeros x vec): bounds compile time and code size


@dataclasses.dataclass(frozen=True)
class UnrolledConfig:
    """bk: output channels per thread (1..128); vec: consecutive images per thread (1, 2 or 4: the
    width of each load and store); threads: threads per block (a multiple of 32, at most 1024).
    Each thread keeps bk x vec accumulators (at most 128)."""

    bk: int = 32
    vec: int = 1
    threads: int = 128

    def __post_init__(self):
        for name in ("bk", "vec", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"UnrolledConfig.{name} must be a positive int, got {value!r}")
        if self.vec not in (1, 2, 4):
            raise ValueError(f"UnrolledConfig.vec must be 1, 2 or 4, got {self.vec}")
        if self.threads % 32 or self.threads > 1024:
            raise ValueError(f"UnrolledConfig.threads must be a multiple of 32 and <= 1024, got {self.threads}")
        if self.bk * self.vec > _MAX_ACCUMULATORS:
            raise ValueError(f"UnrolledConfig.bk * vec = {self.bk * self.vec} accumulators per thread, over "
                             f"{_MAX_ACCUMULATORS}")

    @classmethod
    def from_dict(cls, saved: dict) -> "UnrolledConfig":
        return config_from_dict(cls, saved)


CANDIDATES = (UnrolledConfig(32, 1, 128), UnrolledConfig(64, 1, 128), UnrolledConfig(16, 2, 128),
              UnrolledConfig(32, 2, 64), UnrolledConfig(16, 4, 64))


def check_layer(spec: ConvSpec, config: UnrolledConfig, nnz: int = 0) -> None:
    """ValueError unless the kernel runs this layer with `config` (nnz: the weight's non-zeros)."""
    if spec.groups != 1 or spec.dilation != (1, 1):
        raise ValueError("the unrolled kernel runs groups=1, dilation=1 only")
    if spec.N % config.vec:
        raise ValueError(f"batch {spec.N} is not a multiple of UnrolledConfig.vec={config.vec}")
    if -(-spec.K // config.bk) > _MAX_GRID_Y:
        raise ValueError(f"{spec.K} channels in groups of {config.bk} exceed the grid's {_MAX_GRID_Y} rows")
    if spec.C * spec.H * spec.W * spec.N >= 2 ** 31 or spec.K * spec.P * spec.Q * spec.N >= 2 ** 31:
        raise ValueError("the unrolled kernel indexes with 32-bit ints: input or output too large")
    if nnz * config.vec > MAX_KERNEL_FMAS:
        raise ValueError(f"{nnz} non-zeros x vec {config.vec} = {nnz * config.vec} FMAs exceed the unrolled "
                         f"kernel's {MAX_KERNEL_FMAS}")


def candidate_configs(spec: ConvSpec, nnz: int) -> List[UnrolledConfig]:
    """The configs the autotuner tries on this layer (those `check_layer` accepts)."""
    fitting = []
    for config in CANDIDATES:
        try:
            check_layer(spec, config, nnz)
        except ValueError:
            continue
        fitting.append(config)
    return fitting


@dataclasses.dataclass
class CompiledUnrolled:
    """One layer's kernel: its cubin (loaded per device on first use), geometry and compile cost."""

    cubin: bytes
    spec: ConvSpec
    config: UnrolledConfig
    compile_s: float
    registers: int
    spill_bytes: int

    def __post_init__(self):
        self._kernels: Dict[int, object] = {}
        self._lock = threading.Lock()

    def kernel(self, device_index: int):
        with self._lock:
            if device_index not in self._kernels:
                from .loader import load_kernel

                self._kernels[device_index] = load_kernel(self.cubin, KERNEL_NAME, device_index)
            return self._kernels[device_index]


def compile_layer(weight: torch.Tensor, spec: ConvSpec, config: UnrolledConfig) -> CompiledUnrolled:
    """The kernel of this layer (weight (K, C, R, S), zeros pruned, exact in float32) at spec's input
    shape: its cubin from the disk cache (keyed by source and toolchain) or nvcc/ptxas."""
    check_layer(spec, config, int(torch.count_nonzero(weight)))
    start = time.perf_counter()
    ptx = kernel_ptx(weight.detach().to("cpu", torch.float32).numpy(), spec, config.bk, config.vec, config.threads)
    cache = DiskCache()
    key = toolchain.cache_key("unrolled", ptx, toolchain.toolchain_id())
    cubin = cache.get(key, "cubin")
    registers = spills = -1
    if cubin is None:
        with cache.exclusive(key):
            cubin = cache.get(key, "cubin")
            if cubin is None:
                cubin, info, _ = toolchain.ptxas_cubin(ptx)
                registers, spills = info.registers, info.spill_stores + info.spill_loads
                cache.put(key, "cubin", cubin)
    return CompiledUnrolled(cubin, spec, config, time.perf_counter() - start, registers, spills)


def _epilogue_flags(relu: bool, has_bias: bool, has_residual: bool) -> int:
    return int(relu) | int(has_bias) << 1 | int(has_residual) << 2


def unrolled_conv2d(x: torch.Tensor, compiled: CompiledUnrolled, bias: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, relu: bool = False,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(conv(x) + bias + residual) for the layer `compiled` was built for.

    x: (N, C, H, W) float32 CUDA of that layer's input shape, any strides (batch-innermost without
    padding is read in place, anything else packed zero-padded first); bias: (K,) float32 or None; residual: (N, K, P, Q) or None (copied to the output's
    layout when it is not batch-innermost); out: a batch-innermost (N, K, P, Q) float32 tensor
    (default: new). Returns out.
    """
    spec, config = compiled.spec, compiled.config
    check_triton_input(x, "unrolled", (torch.float32,))
    if not x.is_cuda:
        raise ValueError(f"x must be on CUDA for the unrolled kernel, got {x.device}")
    if tuple(x.shape) != spec.input_shape:
        raise ValueError(f"x has shape {tuple(x.shape)}, the kernel was compiled for {spec.input_shape}")
    check_residual(residual, spec.output_shape, x)
    if bias is not None and (bias.shape != (spec.K,) or bias.dtype != torch.float32 or bias.device != x.device):
        raise ValueError(f"bias must be a float32 ({spec.K},) tensor on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    if out is None:
        out = batch_inner_view(spec.output_shape, x.dtype, x.device)
    elif (tuple(out.shape) != spec.output_shape or out.dtype != torch.float32 or not is_batch_inner(out)
          or out.device != x.device or out.data_ptr() % (4 * config.vec)):
        raise ValueError(f"out must be a batch-innermost float32 {spec.output_shape} tensor on {x.device}, "
                         f"{4 * config.vec}-byte aligned, got {out.dtype} {tuple(out.shape)} with strides "
                         f"{out.stride()} on {out.device}")
    if residual is not None and residual.stride() != out.stride():
        residual = torch.empty_like(out).copy_(residual)
    one_by_one = spec.R == 1 and spec.S == 1
    xt = padded_batch_inner(x, *spec.padding, step=spec.stride if one_by_one else (1, 1))
    if xt.data_ptr() % (4 * config.vec):   # vector loads need vec-float alignment
        xt = xt.clone()
    bias = None if bias is None else bias.contiguous()
    positions = spec.P * spec.Q * spec.N // config.vec
    grid = (-(-positions // config.threads), -(-spec.K // config.bk), 1)
    pointers = (xt.data_ptr(), bias.data_ptr() if bias is not None else 0,
                residual.data_ptr() if residual is not None else 0, out.data_ptr())
    flags = _epilogue_flags(relu, bias is not None, residual is not None)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        compiled.kernel(x.device.index).launch(grid, (config.threads, 1, 1), pointers, (flags,), stream)
    return out
