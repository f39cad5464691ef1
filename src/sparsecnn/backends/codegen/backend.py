"""Backend `codegen`: sparsity-aware code generation (paper 002), CUDA fp32 and fp16 on sm_80 and newer.

The weight is compiled into the kernels (zero weights' FMAs removed, the rest immediates), which
needs the layer's spatial shape: `prepare` only checks and keeps the weight, and each layer shape
(any batch) is compiled on its first `bind` (through the on-disk cache of backends/codegen/generator.py, so a
shape compiled before costs a file read). Bind and run once outside CUDA-graph capture (the first
launch loads the modules). Runs go through the op `sparsecnn::codegen_conv2d`, which takes the
compiled kernels by a handle (see core/op_support.py).

Compiling a layer is slow (nvcc, then ptxas), so `backend="auto"` tries only the default
config, in emit mode (`auto_configs`), and `prefetch` compiles it in worker processes
(`workers.WorkerPool`, at most $SPARSECNN_COMPILE_WORKERS) while earlier layers are timed; `bind`
then takes the result.
Importing this module imports neither cuda-python nor CuPy and does not touch CUDA.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

import sparsecnn.settings as settings
from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.backends.codegen.op import codegen_conv2d_eager
from sparsecnn.core.op_support import generated_machine_check, register_codegen
from sparsecnn.core.registry import (
    Backend,
    KernelCall,
    apply_epilogue_,
    register_backend,
)
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.workers import COMPILE_POOL, NOTHING, WorkerPool

# K*C*R*S beyond this unrolls into so many kernels (each <= DEFAULT_MAX_KERNEL_FMAS template FMAs,
# nvcc per template plus ptxas per slice) that compiling one layer takes minutes.
MAX_UNROLLED_WEIGHTS = 1 << 20
# `backend="auto"` compiles only the default config (in emit mode), and only for layers whose output
# channels fit in at most this many kernels (slices): each slice reads the whole input again, and
# compile time grows with the slices. On ResNet-50 (DLMC 0.9, fp32) codegen won most one-slice
# layers against dense but few multi-slice ones, by little, and those took most of the compile time
# that tuning waited for.
MAX_AUTO_SLICES = 1
_INT32_MAX = 2**31 - 1
_LOG = logging.getLogger("sparsecnn.backends.codegen.backend")


def _new_workers(**kwargs) -> WorkerPool:
    return WorkerPool("codegen compile", settings.compile_workers, _LOG, **{"new_pool": COMPILE_POOL, **kwargs})


_WORKERS = _new_workers()


def _as_compiled_array(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().to("cpu", torch.float32).contiguous().numpy()


def _compile_key(weight: np.ndarray, spec: ConvSpec, config: codegen.CodegenConfig, has_bias: bool,
                 dtype: torch.dtype, relu: bool) -> Tuple:
    digest = hashlib.blake2b(weight.tobytes(), digest_size=16).hexdigest()
    return digest, weight.shape, spec.with_batch(0), config, has_bias, str(dtype), relu


def _compile_in_worker(weight: np.ndarray, spec: ConvSpec, config: codegen.CodegenConfig, has_bias: bool,
                       dtype: torch.dtype, relu: bool) -> Tuple:
    """compile_conv in a worker process, one slice at a time (the workers are the parallelism):
    (plan, cubins, report) to rebuild the `CompiledConv` from."""
    compiled = codegen.compile_conv(weight, spec, config, relu=relu, has_bias=has_bias, dtype=dtype, jobs=1)
    return compiled.plan, compiled.cubins, compiled.report, compiled.arch


class CodegenWeight:
    """The packed form: the dense weight on the CPU, and the compiled kernels per layer shape."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 4:
            raise ValueError(f"codegen needs a (K, C, R, S) weight, got shape {tuple(weight.shape)}")
        self.weight = _as_compiled_array(weight)
        if not np.isfinite(self.weight).all():
            raise ValueError("codegen cannot compile a weight with inf/NaN values")
        self._compiled: Dict[Tuple, codegen.CompiledConv] = {}
        self._lock = threading.Lock()

    def compiled(self, spec: ConvSpec, config: Optional[codegen.CodegenConfig], has_bias: bool,
                 dtype: torch.dtype = torch.float32, relu: bool = False) -> codegen.CompiledConv:
        """The kernels for `spec` at `dtype` (batch ignored; config None: the dtype's default; relu:
        with max(y, 0) compiled in), compiled on first use, or taken from a worker that `prefetch`
        set compiling."""
        config = config or _configs(spec, dtype)[0]
        key = _compile_key(self.weight, spec, config, has_bias, dtype, relu)
        with self._lock:
            if key not in self._compiled:
                done = _WORKERS.take(key)
                self._compiled[key] = (codegen.CompiledConv(*done) if done is not NOTHING else
                                       codegen.compile_conv(self.weight, spec, config, relu=relu, has_bias=has_bias,
                                                            dtype=dtype))
            return self._compiled[key]


def _spec_check(spec: ConvSpec) -> Optional[str]:
    if spec.groups != 1:
        return f"groups={spec.groups} (codegen supports groups=1 only)"
    if spec.dilation != (1, 1):
        return f"dilation={spec.dilation} (codegen supports dilation 1 only)"
    unrolled = spec.K * spec.C * spec.R * spec.S
    if unrolled > MAX_UNROLLED_WEIGHTS:
        return (f"K*C*R*S = {unrolled} weights to unroll exceed {MAX_UNROLLED_WEIGHTS}: compile time would be "
                "unreasonable")
    if spec.C * spec.H * spec.W > _INT32_MAX // 8 or spec.K * spec.P * spec.Q > _INT32_MAX // 8:
        return "one image's input or output is too large for the kernels' int32 offsets"
    if not codegen.candidate_configs(spec):
        return "no tiling fits shared memory and the unroll cap"
    return None


def _prepare(weight: torch.Tensor, config: Any) -> CodegenWeight:
    return CodegenWeight(weight)


def _epilogue(y: torch.Tensor, residual: Optional[torch.Tensor], fused_relu: bool, relu: bool) -> torch.Tensor:
    """act(y + residual) after the kernels; with `fused_relu` the kernels applied the ReLU already,
    so only relu=True without a residual is accepted."""
    if not fused_relu:
        return apply_epilogue_(y, relu, residual)
    if residual is not None or not relu:
        raise ValueError("this codegen binding has the ReLU compiled into its kernels: call it with relu=True and "
                         "no residual, or bind the layer without relu_only")
    return y


def _codegen_conv(x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], handle: int,
                  fused_relu: bool, relu: bool) -> torch.Tensor:
    return _epilogue(torch.ops.sparsecnn.codegen_conv2d.default(x, bias, handle), residual, fused_relu, relu)


def _codegen_conv_eager(x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], handle: int,
                        fused_relu: bool, relu: bool) -> torch.Tensor:
    """`_codegen_conv` without the dispatcher (see core/op_support.py: its first dispatch imports torch._dynamo)."""
    return _epilogue(codegen_conv2d_eager(x, bias, handle), residual, fused_relu, relu)


def _bind_kernels(packed: CodegenWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                  relu: bool) -> KernelCall:
    """The op `sparsecnn::codegen_conv2d` on this shape's kernels (compiled on first use), with the
    ReLU compiled in when `relu` (a separate compile; no pass over the output after the kernels)."""
    compiled = packed.compiled(spec, config, has_bias, dtype, relu=relu)
    return KernelCall(_codegen_conv, (), (register_codegen(compiled), relu), keepalive=compiled,
                      eager=_codegen_conv_eager)


def _bind(packed: CodegenWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """Residual and ReLU applied after the kernels."""
    return _bind_kernels(packed, spec, config, dtype, has_bias, relu=False)


def _bind_relu(packed: CodegenWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The ReLU compiled into the kernels: the call accepts only relu=True and no residual."""
    return _bind_kernels(packed, spec, config, dtype, has_bias, relu=True)


def _compile_kernels(packed: CodegenWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                     relu_only: bool, cache) -> None:
    """The layer's kernels through `cache` (see `Backend.compile_kernels`)."""
    codegen.compile_conv(packed.weight, spec, config or _configs(spec, dtype)[0], relu=relu_only, has_bias=has_bias,
                         dtype=dtype, cache=cache)


def _configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    return codegen.candidate_configs(spec, dtype)


def _auto_configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    """[the default config in emit mode] when its plan has at most MAX_AUTO_SLICES slices, else [];
    [] for strided 1x1 layers (downsampling shortcuts): codegen never beat direct or dense on one in
    the model runs.

    Emit, not rewrite: ptxas makes the same FMAs, loads and stores from both (about half the
    kernels byte for byte; `scripts/codegen_mode_sass.py` compares them), but nvcc on a layer's
    placeholder template costs several times nvcc on its kept terms, and a cold tuning has no
    template cached; rewrite was also refused (not SSA) on wide 1x1 templates after their nvcc ran."""
    if (spec.R, spec.S) == (1, 1) and spec.stride != (1, 1):
        return []
    default = dataclasses.replace(_configs(spec, dtype)[0], mode="emit")
    return [default] if codegen.make_plan(spec, default, dtype=dtype).n_slices <= MAX_AUTO_SLICES else []


def _prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
              configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Start compiling `configs` (None: those `backend="auto"` tries) for `spec` in workers, with the
    ReLU compiled in when the layer will be bound `relu_only`."""
    if _spec_check(spec) is not None:
        return
    array = _as_compiled_array(weight)
    for config in _auto_configs(spec, dtype) if configs is None else configs:
        _WORKERS.submit(_compile_key(array, spec, config, has_bias, dtype, relu_only), _compile_in_worker, array, spec,
                        config, has_bias, dtype, relu_only)


def _pending(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool, config: Any,
             relu_only: bool = False) -> bool:
    """Whether `config`'s kernels for this layer are still compiling in a worker (binding would wait)."""
    if _spec_check(spec) is not None:
        return False
    return _WORKERS.running(_compile_key(_as_compiled_array(weight), spec, config, has_bias, dtype, relu_only))


CODEGEN = register_backend(Backend(
    name="codegen",
    description="sparsity-aware code generation (Dong et al.): weights as FMA immediates, zero-weight FMAs "
                "deleted from a PTX template (or never emitted), fp32/fp16 CUDA sm_80 and newer",
    dtypes={"cuda": (torch.float32, torch.float16)},
    prepare=_prepare,
    bind=_bind,
    spec_check=_spec_check,
    configs=_configs,
    config_from_dict=codegen.CodegenConfig.from_dict,
    autotune_devices=("cuda",),
    auto_configs=_auto_configs,
    prefetch=_prefetch,
    bind_relu=_bind_relu,
    pending=_pending,
    compile_kernels=_compile_kernels,
    machine_check=generated_machine_check("nvcc", "ptxas"),
))
