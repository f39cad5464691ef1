"""Backend `unrolled`: each layer's weights as FMA immediates over batch-innermost activations
(backends/unrolled/kernel.py: PTX written per layer and input shape, compiled by ptxas; fp32 and
fp16 CUDA, fp16 as packed pairs over two images with partial sums flushed to fp32).

Each layer and input shape is compiled on its first `bind` (through the codegen disk cache, so a
layer compiled before costs a file read), or taken from a worker process that `prefetch` set
compiling while earlier layers were timed (`workers.WorkerPool`, at most
$SPARSECNN_COMPILE_WORKERS). A compile's ptxas time grows with the non-zeros (the kernel takes
at most `unrolled.max_kernel_fmas()`), so `auto` tries one config per layer (`unrolled.auto_config`)
and only on outputs of at most 28x28 (`_auto_configs`): larger feature maps were not measured to
gain (a 56x56 1x1 layer ran slower than `direct` "batch"); in fp16 `auto` tries none (timed no faster than
the fp32 kernel and slower than cuDNN's tensor cores, RESULTS.md: they run where the backend is
named, tuned over `HALF_CANDIDATES`). Runs go through the op
`sparsecnn::unrolled_conv2d`, which takes the compiled kernel by a handle (see core/op_support.py) and fuses
bias, residual and ReLU. Importing this module touches neither CUDA nor ptxas.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

import sparsecnn.settings as settings
from sparsecnn.backends.unrolled import op
from sparsecnn.core.op_support import config_json, generated_machine_check, register_codegen
from sparsecnn.core.registry import Backend, KernelCall, register_backend
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.workers import COMPILE_POOL, NOTHING, WorkerPool

AUTO_MAX_OUTPUT_PIXELS = 28 * 28
AUTO_MIN_POSITIONS = 7 * 7 * 32   # output pixels x images: fewer leave most of the GPU idle
_LOG = logging.getLogger("sparsecnn.backends.unrolled.backend")
_WORKERS = WorkerPool("unrolled compile", settings.compile_workers, _LOG, COMPILE_POOL)


def _kernels():
    from sparsecnn.backends.unrolled import kernel as unrolled

    return unrolled


def _compile_key(weight: torch.Tensor, spec: ConvSpec, config: Any, dtype: torch.dtype) -> Tuple:
    digest = hashlib.blake2b(weight.numpy().tobytes(), digest_size=16).hexdigest()
    return digest, spec, config.bk, config.threads, config.slices, config.tq, str(dtype)


def _compile_in_worker(weight: torch.Tensor, spec: ConvSpec, config: Any, dtype: torch.dtype) -> tuple:
    return _kernels().compile_layer(weight, spec, config, dtype=dtype).fields()


class UnrolledWeight:
    """The packed form: the dense weight (zeros pruned) on the CPU, and the compiled kernel per input
    shape, tiling and dtype (the output layout is a launch argument, so it shares the kernel)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 4:
            raise ValueError(f"unrolled needs a (K, C, R, S) weight, got shape {tuple(weight.shape)}")
        self.weight = weight.detach().to("cpu", torch.float32).contiguous()
        if not torch.isfinite(self.weight).all():
            raise ValueError("unrolled cannot compile a weight with inf/NaN values")
        self._compiled: Dict[Tuple, Any] = {}
        self._lock = threading.Lock()

    def compiled(self, spec: ConvSpec, config: Any, dtype: torch.dtype = torch.float32):
        """The kernel for inputs of `spec`'s shape and `dtype`, compiled on first use or taken from a
        worker."""
        key = _compile_key(self.weight, spec, config, dtype)
        with self._lock:
            if key not in self._compiled:
                done = _WORKERS.take(key)
                self._compiled[key] = (_kernels().CompiledUnrolled(*done) if done is not NOTHING else
                                       _kernels().compile_layer(self.weight, spec, config, dtype=dtype))
            return self._compiled[key]


def _spec_check(spec: ConvSpec) -> Optional[str]:
    if spec.groups != 1:
        return f"groups={spec.groups} (unrolled supports groups=1 only)"
    if spec.dilation != (1, 1):
        return f"dilation={spec.dilation} (unrolled supports dilation 1 only)"
    try:
        _kernels().check_layer(spec, _kernels().UnrolledConfig())
    except ValueError as why:
        return str(why)
    return None


def _prepare(weight: torch.Tensor, config: Any) -> UnrolledWeight:
    return UnrolledWeight(weight)


def _bind(packed: UnrolledWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    config = config if config is not None else _kernels().auto_config(spec, dtype)
    compiled = packed.compiled(spec, config, dtype)
    return KernelCall(torch.ops.sparsecnn.unrolled_conv2d.default, (), (register_codegen(compiled),
                                                                          config_json(config)),
                      keepalive=compiled, eager=op.unrolled_conv2d_eager)


def _compile_kernels(packed: UnrolledWeight, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                     relu_only: bool, cache) -> None:
    """The layer's kernel through `cache` (see `Backend.compile_kernels`)."""
    _kernels().compile_layer(packed.weight, spec,
                             config if config is not None else _kernels().auto_config(spec, dtype), cache=cache,
                             dtype=dtype)


def _configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    """Every candidate of `dtype` the layer's shape allows (the weight's non-zeros are checked at bind)."""
    return _kernels().candidate_configs(spec, 0, dtype)


def _auto_configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    """[`auto_config(spec)`] on layers of at most AUTO_MAX_OUTPUT_PIXELS output pixels and at least
    AUTO_MIN_POSITIONS output positions (the kernel refuses weights of too many non-zeros at bind);
    none in float16 (slower than cuDNN's tensor cores where timed: it runs where the backend is named)."""
    if dtype == torch.float16:
        return []
    positions = spec.P * spec.Q * spec.N
    if spec.P * spec.Q > AUTO_MAX_OUTPUT_PIXELS or positions < AUTO_MIN_POSITIONS:
        return []
    return [_kernels().auto_config(spec)]


def _prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
              configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Start compiling `configs` (None: those `auto` tries) for inputs of `spec`'s shape in workers,
    unless the weight has more non-zeros than the kernel takes."""
    weight = weight.detach().to("cpu", torch.float32).contiguous()
    if _spec_check(spec) is not None or int(torch.count_nonzero(weight)) > _kernels().max_kernel_fmas():
        return
    if configs is None:
        configs = _auto_configs(spec, dtype)
    for config in configs:
        _WORKERS.submit(_compile_key(weight, spec, config, dtype), _compile_in_worker, weight, spec, config, dtype)


def _pending(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool, config: Any,
             relu_only: bool = False) -> bool:
    """Whether `config`'s kernel for this layer is still compiling in a worker (binding would wait)."""
    if _spec_check(spec) is not None:
        return False
    return _WORKERS.running(_compile_key(weight.detach().to("cpu", torch.float32).contiguous(), spec, config, dtype))


UNROLLED = register_backend(Backend(
    name="unrolled",
    description="direct sparse convolution with the layer's weights as FMA immediates (PTX per layer), "
                "batch-innermost activations, fp32 and fp16 CUDA sm_80 and newer",
    dtypes={"cuda": (torch.float32, torch.float16)},
    prepare=_prepare,
    bind=_bind,
    spec_check=_spec_check,
    configs=_configs,
    config_from_dict=lambda saved: _kernels().UnrolledConfig.from_dict(saved),
    autotune_devices=("cuda",),
    auto_configs=_auto_configs,
    prefetch=_prefetch,
    pending=_pending,
    batch_inner=lambda config: True,
    writes_nchw=False,   # a warp holds one pixel's images: NCHW stores scatter (`tuning.layout`)
    compile_kernels=_compile_kernels,
    machine_check=generated_machine_check("ptxas"),
))
