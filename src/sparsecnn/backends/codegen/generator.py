"""Sparsity-aware code generation for convolutions (paper 002): weights become FMA immediates.

`compile_conv(weight, spec, config, dtype=...)` turns one layer's pruned weight into kernels for
the device's arch (sm_80 and newer; `arch=` for another),
one per slice of output channels (tiling: plan.py; CUDA C: template.py for FFMA, half2.py for
HFMA2):
  rewrite mode: the placeholder template -> nvcc -ptx, once per layer shape, config, dtype and
    toolchain (cached on disk) -> Algorithm 2 per slice (ptx_rewrite.py): real weights
    substituted, FMAs of zero weights deleted -> ptxas -> cubin (cached per template + weights);
  emit mode: CUDA C with only the non-zero terms per slice -> nvcc -ptx -> ptxas -> cubin.
The returned `CompiledConv` runs the layer (CUDA float32 or float16, NCHW) on torch's current
stream, and its `report` (`CompileReport`) says what compiling cost and produced.

Nothing here imports cuda-python or CuPy, or touches CUDA, until a kernel is launched.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sparsecnn.backends.codegen import half2, template
from sparsecnn.backends.codegen import plan as plan_module
from sparsecnn.backends.codegen.plan import (
    DEFAULT_MAX_KERNEL_FMAS,
    CodegenConfig,
    KernelPlan,
    candidate_configs,
    default_config,
    dtype_name,
    make_plan,
)
from sparsecnn.backends.codegen.ptx_rewrite import (
    RewriteError,
    RewriteStats,
    placeholder_sites,
    rewrite_ptx,
)
from sparsecnn.backends.codegen.template import KERNEL_NAME
from sparsecnn.core import spec as spec_module
from sparsecnn.core import toolchain
from sparsecnn.core.cubin_loader import LazyKernels
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.toolchain import DiskCache, ToolchainError

_LOG = logging.getLogger(__name__)
__all__ = ["CodegenConfig", "CompileReport", "CompiledConv", "KernelPlan", "RewriteError", "RewriteStats",
           "Template", "ToolchainError", "candidate_configs", "compile_conv", "compile_template", "default_config",
           "kernel_source", "make_plan", "placeholders", "prepare_weight", "slot_weights"]


def kernel_source(plan: KernelPlan, weights: Optional[np.ndarray] = None) -> str:
    """CUDA C of one slice kernel: the placeholder template (weights None) or the emitted sparse
    kernel for `weights`, (slice_k, C, R, S) float32 of this slice (zero rows past K; exact in the
    plan's dtype)."""
    generator = half2.Half2Generator if plan.half2 else template.Generator
    return generator(plan, weights).source()


def placeholders(plan: KernelPlan) -> np.ndarray:
    """(template_fmas,) uint32: the placeholder of each FMA slot of `plan`'s template."""
    return (half2.placeholder_bits if plan.half2 else template.placeholder_bits)(plan.template_fmas)


def slot_weights(plan: KernelPlan, weight_slice: np.ndarray) -> np.ndarray:
    """(template_fmas,) uint32: the real weight of each FMA slot, in the placeholders' encoding
    (float32 bits, or half2 bits with the weight in both halves)."""
    return (half2.slot_weight_bits if plan.half2 else template.slot_weight_bits)(plan, weight_slice)


@dataclasses.dataclass
class CompileReport:
    """What compiling one layer cost and produced (sizes summed, registers/spills max over slices).

    Seconds are this call's: an artifact found in the disk cache costs ~0 (`cache_hits` counts them).
    fmas_deleted/kept count template FMAs (slot = weight x output pixel of a thread); emit mode
    reports the same counts for the terms it left out / wrote.
    """

    mode: str
    slices: int
    template_fmas: int  # per kernel
    dtype: str = "float32"
    flush_terms: int = 0  # half2: (c, r, s) terms per half2 partial sum (0: one partial)
    fmas_deleted: int = 0
    fmas_kept: int = 0
    nvcc_s: float = 0.0
    rewrite_s: float = 0.0
    ptxas_s: float = 0.0
    compile_s: float = 0.0  # wall time of compile_conv
    template_ptx_bytes: int = 0
    ptx_bytes: int = 0
    cubin_bytes: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem_bytes: int = 0
    cache_hits: int = 0
    fallback: str = ""  # why a rewrite-mode config was compiled in emit mode instead


@dataclasses.dataclass
class _Slice:
    cubin: bytes
    meta: dict  # ptx_bytes, deleted, kept, registers, spill_stores, spill_loads, smem_bytes, *_s
    cached: bool


@dataclasses.dataclass(frozen=True)
class Template:
    """The placeholder PTX of one plan, its cache key, and the nvcc seconds it cost this call."""

    ptx: str
    key: str
    nvcc_s: float
    cached: bool


@functools.lru_cache(maxsize=1)
def _generator_digest() -> str:
    """Digest of the code that turns a plan into a template's source (this package's generator
    modules and the ConvSpec it reads): a template's cache key names its plan, not its source."""
    modules = (template, half2, plan_module, spec_module)
    return toolchain.cache_key(*(Path(module.__file__).read_bytes() for module in modules))


def _template_key(plan: KernelPlan, arch: str) -> str:
    """Cache key of `plan`'s placeholder PTX: the plan without what the source does not depend on
    (the batch and the layer's name), the generator's digest and the toolchain. Generating the
    source of a large template is slow enough that loading a cached layer would otherwise pay it."""
    spec = dataclasses.replace(plan.spec.with_batch(0), name="")
    return toolchain.cache_key("template", repr(dataclasses.replace(plan, spec=spec)), _generator_digest(),
                               toolchain.toolchain_id(arch))


def compile_template(plan: KernelPlan, cache: Optional[DiskCache] = None, arch=None) -> Template:
    """The placeholder PTX of `plan` for `arch` (`toolchain.target_arch`: None is the current
    device's) from the disk cache, else nvcc.

    A fresh template is checked before it is cached: each placeholder must feed exactly one FMA
    weight operand (nvcc neither merged nor duplicated any), else RewriteError.
    """
    cache = cache or DiskCache()
    arch = toolchain.target_arch(arch)
    key = _template_key(plan, arch)
    with cache.exclusive(key):  # layers sharing a plan, compiled in parallel processes: one nvcc
        cached = cache.get(key, "ptx")
        if cached is not None:
            return Template(cached.decode(), key, 0.0, True)
        return _new_template(plan, key, cache, arch)


def _new_template(plan: KernelPlan, key: str, cache: DiskCache, arch: str) -> Template:
    ptx, seconds = toolchain.nvcc_ptx(kernel_source(plan), arch)
    sites = placeholder_sites(ptx, frozenset(placeholders(plan).tolist()))
    wrong = {bits: count for bits, count in sites.items() if count != 1}
    if len(sites) != plan.template_fmas or wrong:
        raise RewriteError(f"template keeps {len(sites)} of {plan.template_fmas} placeholders, "
                           f"{len(wrong)} not exactly once: nvcc folded or duplicated weights")
    cache.put(key, "ptx", ptx.encode())
    return Template(ptx, key, seconds, False)


def compile_conv(weight, spec: ConvSpec, config: Optional[CodegenConfig] = None, relu: bool = False,
                 has_bias: bool = True, max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS, jobs: int = 0,
                 cache: Optional[DiskCache] = None, dtype: Union[torch.dtype, str] = torch.float32,
                 arch=None) -> "CompiledConv":
    """Compile the kernels of one layer for inputs of `dtype` (float32 or float16).

    weight: (K, C, R, S) float (tensor on any device, or array), zeros at pruned positions; for
    float16 it is rounded to half (a weight that rounds to 0 is pruned with the zeros); spec: the
    layer (its N is not compiled in: the kernels run any batch); config: None for the first of
    `candidate_configs(spec, dtype)`; relu: fuse max(y, 0); has_bias: the kernels read a bias (of
    `dtype`); jobs: parallel slice compiles (0: one per CPU). A rewrite-mode layer whose template
    the rewrite cannot handle soundly (RewriteError, e.g. nvcc left a loop in a very large kernel,
    so the PTX is not in SSA form) is compiled in emit mode instead; `report.fallback` says why.
    arch: the target ("86", DeviceProperties; None: the current device's, sm_90 without a GPU).
    """
    args = (spec, relu, has_bias, max_kernel_fmas, jobs, cache or DiskCache(), dtype, toolchain.target_arch(arch))
    try:
        return _compile_conv(weight, config, *args)
    except RewriteError as error:
        config = prepare_weight(weight, spec, config, relu, has_bias, max_kernel_fmas, dtype)[1].config
        if config.mode != "rewrite":
            raise
        compiled = _compile_conv(weight, dataclasses.replace(config, mode="emit"), *args)
        compiled.report.fallback = f"rewrite refused ({error}); compiled in emit mode"
        _LOG.warning("codegen %s: %s", spec.name or spec, compiled.report.fallback)
        return compiled


def _compile_conv(weight, config: Optional[CodegenConfig], spec: ConvSpec, relu: bool, has_bias: bool,
                  max_kernel_fmas: int, jobs: int, cache: DiskCache, dtype, arch: str) -> "CompiledConv":
    start = time.perf_counter()
    weight, plan = prepare_weight(weight, spec, config, relu, has_bias, max_kernel_fmas, dtype)
    config = plan.config
    slices = _weight_slices(weight, plan)
    report = CompileReport(config.mode, plan.n_slices, plan.template_fmas, plan.dtype, plan.flush_terms,
                           smem_bytes=plan.smem_bytes)
    if config.mode == "rewrite":
        template = compile_template(plan, cache, arch)
        report.nvcc_s, report.cache_hits = template.nvcc_s, int(template.cached)
        report.template_ptx_bytes = len(template.ptx.encode())
        build = lambda w: _rewritten_slice(plan, template, w, cache, arch)  # noqa: E731
    else:
        build = lambda w: _emitted_slice(plan, w, cache, arch)  # noqa: E731
    workers = max(1, min(len(slices), jobs or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(build, slices))
    for result in results:
        _add(report, result)
    report.compile_s = time.perf_counter() - start
    return CompiledConv(plan, [result.cubin for result in results], report, arch)


def prepare_weight(weight, spec: ConvSpec, config: Optional[CodegenConfig] = None, relu: bool = False,
                   has_bias: bool = True, max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS,
                   dtype: Union[torch.dtype, str] = torch.float32) -> Tuple[np.ndarray, KernelPlan]:
    """(weight as `compile_conv` compiles it: (K, C, R, S) float32 exact in `dtype`, its plan);
    arguments as `compile_conv`'s. The plan's half2 partials follow the weight's density."""
    name = dtype_name(dtype)
    config = config or candidate_configs(spec, name, max_kernel_fmas)[0]
    weight = _as_array(weight, spec, name)
    density = np.count_nonzero(weight) / weight.size
    return weight, make_plan(spec, config, relu, has_bias, max_kernel_fmas, name, density)


def _as_array(weight, spec: ConvSpec, dtype: str) -> np.ndarray:
    """(K, C, R, S) float32 holding values exact in `dtype`."""
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().to("cpu", torch.float32).numpy()
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.shape != spec.weight_shape:
        raise ValueError(f"weight shape {weight.shape} does not match the layer's {spec.weight_shape}")
    if not np.isfinite(weight).all():
        raise ValueError("weight has non-finite values; they cannot be compiled into immediates")
    if dtype == "float16":
        with np.errstate(over="ignore"):
            weight = weight.astype(np.float16).astype(np.float32)
        if not np.isfinite(weight).all():
            raise ValueError("weight has values beyond the float16 range (|w| > 65504)")
    return weight


def _weight_slices(weight: np.ndarray, plan: KernelPlan) -> List[np.ndarray]:
    """(slice_k, C, R, S) per slice, channels past K zero."""
    padded = np.zeros((plan.n_slices * plan.slice_k, *weight.shape[1:]), dtype=np.float32)
    padded[:weight.shape[0]] = weight
    return [padded[s * plan.slice_k:(s + 1) * plan.slice_k] for s in range(plan.n_slices)]


def _cached_slice(cache: DiskCache, key: str) -> Optional[_Slice]:
    cubin, meta = cache.get(key, "cubin"), cache.get(key, "json")
    if cubin is None or meta is None:
        return None
    return _Slice(cubin, json.loads(meta), True)


def _store_slice(cache: DiskCache, key: str, cubin: bytes, meta: dict) -> _Slice:
    cache.put(key, "json", json.dumps(meta).encode())
    cache.put(key, "cubin", cubin)  # last: a cubin on disk implies its metadata is there
    return _Slice(cubin, meta, False)


def _assemble(ptx: str, arch: str) -> tuple:
    cubin, info, seconds = toolchain.ptxas_cubin(ptx, arch)
    meta = dict(ptx_bytes=len(ptx.encode()), ptxas_s=seconds, **dataclasses.asdict(info))
    return cubin, meta


def _rewritten_slice(plan: KernelPlan, template: Template, weight: np.ndarray, cache: DiskCache,
                     arch: str) -> _Slice:
    key = toolchain.cache_key("rewrite", template.key, weight.tobytes(), toolchain.toolchain_id(arch))
    found = _cached_slice(cache, key)
    if found is not None:
        return found
    value_map = dict(zip(placeholders(plan).tolist(), slot_weights(plan, weight).tolist()))
    ptx, stats = rewrite_ptx(template.ptx, value_map)
    cubin, meta = _assemble(ptx, arch)
    meta.update(deleted=stats.deleted, kept=stats.kept, rewrite_s=stats.seconds, nvcc_s=0.0)
    return _store_slice(cache, key, cubin, meta)


def _emitted_slice(plan: KernelPlan, weight: np.ndarray, cache: DiskCache, arch: str) -> _Slice:
    source = kernel_source(plan, weight)
    key = toolchain.cache_key("emit", source, toolchain.toolchain_id(arch))
    found = _cached_slice(cache, key)
    if found is not None:
        return found
    ptx, nvcc_s = toolchain.nvcc_ptx(source, arch)
    cubin, meta = _assemble(ptx, arch)
    kept = int(np.count_nonzero(weight)) * plan.pixels
    meta.update(deleted=plan.template_fmas - kept, kept=kept, rewrite_s=0.0, nvcc_s=nvcc_s)
    return _store_slice(cache, key, cubin, meta)


def _add(report: CompileReport, result: _Slice) -> None:
    meta = result.meta
    report.cache_hits += result.cached
    report.fmas_deleted += meta["deleted"]
    report.fmas_kept += meta["kept"]
    report.ptx_bytes += meta["ptx_bytes"]
    report.cubin_bytes += len(result.cubin)
    for field in ("registers", "spill_stores", "spill_loads"):
        setattr(report, field, max(getattr(report, field), meta[field]))
    if not result.cached:
        report.nvcc_s += meta["nvcc_s"]
        report.rewrite_s += meta["rewrite_s"]
        report.ptxas_s += meta["ptxas_s"]


class CompiledConv:
    """The kernels of one layer: call with x (N, C, H, W) CUDA of the compiled dtype -> y (N, K, P, Q)
    of that dtype.

    Slices run one after another on torch's current stream (CUDA-graph capturable once loaded: the
    first call on a device loads the modules, so make it outside capture). Odd slices walk the
    blocks backwards to start on the input the previous slice left in L2.
    """

    def __init__(self, plan: KernelPlan, cubins: Sequence[bytes], report: CompileReport,
                 arch: str = toolchain.ARCH):
        self.plan, self.cubins, self.report, self.arch = plan, list(cubins), report, arch
        self._slices = LazyKernels(self.cubins, KERNEL_NAME)
        self._checked: set = set()

    def kernels(self, device_index: int) -> list:
        """The loaded slice kernels on one device (loaded on first use)."""
        if device_index not in self._checked:
            capability = torch.cuda.get_device_capability(device_index)
            if f"{capability[0]}{capability[1]}" != self.arch:
                raise RuntimeError(f"these codegen kernels are sm_{self.arch} cubins; device {device_index} is "
                                   f"sm_{capability[0]}{capability[1]}")
            self._checked.add(device_index)
        return self._slices.kernels(device_index)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = conv(x) + bias (ReLU'd if compiled so); every element of `out` (or a new tensor) is written."""
        spec, plan = self.plan.spec, self.plan
        dtype = plan.torch_dtype
        if x.device.type != "cuda" or x.dtype != dtype:
            raise TypeError(f"these codegen kernels take {dtype} CUDA input, got {x.dtype} on {x.device}")
        if x.dim() != 4 or tuple(x.shape[1:]) != (spec.C, spec.H, spec.W):
            raise ValueError(f"input shape {tuple(x.shape)} does not match the compiled (N, {spec.C}, {spec.H}, "
                             f"{spec.W})")
        if (bias is not None) != plan.has_bias:
            raise ValueError(f"kernels compiled with has_bias={plan.has_bias}, called with bias "
                             f"{'given' if bias is not None else 'None'}")
        n = x.shape[0]
        shape = (n, spec.K, spec.P, spec.Q)
        if out is None:
            y = torch.empty(shape, device=x.device, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() \
                or out.device != x.device:
            raise ValueError(f"out must be a contiguous {dtype} {shape} tensor on {x.device}")
        else:
            y = out
        grid = plan.grid(n)
        if n == 0:
            return y
        if grid[1] > 65535:
            raise ValueError(f"batch {n} needs {grid[1]} blocks in grid y (max 65535); raise bn")
        x = x.contiguous()
        bias_ptr = 0
        if bias is not None:
            bias = bias.to(device=x.device, dtype=dtype).contiguous()
            bias_ptr = bias.data_ptr()
        stream = torch.cuda.current_stream(x.device).cuda_stream
        with torch.cuda.device(x.device):  # makes the device's primary context current for the driver calls
            for index, kernel in enumerate(self.kernels(x.device.index)):
                kernel.launch(grid, plan.block(), (x.data_ptr(), bias_ptr, y.data_ptr()),
                              (n, index * plan.slice_k, index % 2), stream)
        return y
