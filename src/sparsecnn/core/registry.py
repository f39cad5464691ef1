"""The backend registry: each backend declares what it supports and how to run.

A backend sees only 2-D convolutions (Conv1d arrives as H = R = 1) and a weight that follows the
pruning contract: dense (K, C // groups, R, S) with zeros at pruned positions.

Running is split in two: `bind` does the Python work once per layer and input size (config
defaults, offsets for the padded input, JSON configs, compiled-kernel handles) and returns a
`KernelCall`; calling that is pure tensor work (a torch.library op of a backend's `op.py`, or an aten
composition), so torch.compile traces it without graph breaks and CUDA graphs capture it.
Every call computes act(conv(x) + bias + residual), act = ReLU or identity: kernels with an
epilogue fuse it, the others finish with `apply_epilogue_`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from sparsecnn.core.checks import check_residual
from sparsecnn.core.spec import ConvSpec

# prepare(weight, config) -> packed weight in the backend's format
PrepareFn = Callable[[torch.Tensor, Any], Any]
# bind(packed, spec, config, dtype, has_bias) -> KernelCall for inputs of spec's shape and `dtype`
BindFn = Callable[[Any, ConvSpec, Any, torch.dtype, bool], "KernelCall"]


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One layer's kernel with its packed weight bound.

    call(x, bias, residual, relu) = fn(x, *tensors, bias, residual, *static, relu) -> (N, K, P, Q):
    act(conv(x) + bias + residual) for x (N, C, H, W) of the shape and dtype it was bound for;
    bias (K,) or None; residual None or of the output's shape, dtype and device. `fn` is an op of a
    backend's `op.py` or a function of aten ops; `static` holds ints, lists and strings only. `keepalive`
    is never passed: it holds what handles in `static` refer to (a compiled codegen kernel).
    `eager`: `fn`'s plain Python implementation, called instead of the op outside torch.compile.
    """

    fn: Callable[..., torch.Tensor]
    tensors: Tuple[Optional[torch.Tensor], ...] = ()
    static: Tuple[Any, ...] = ()
    keepalive: Any = dataclasses.field(default=None, repr=False, compare=False)
    eager: Optional[Callable[..., torch.Tensor]] = dataclasses.field(default=None, repr=False, compare=False)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, relu: bool = False) -> torch.Tensor:
        fn = self.fn if self.eager is None or torch.compiler.is_compiling() else self.eager
        return fn(x, *self.tensors, bias, residual, *self.static, relu)


def apply_epilogue_(y: torch.Tensor, relu: bool, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """act(y + residual) in place on `y`, a conv output the caller owns (fresh from a kernel).

    For backends whose kernels have no fused epilogue; residual: None or y's shape/dtype/device.
    """
    check_residual(residual, y.shape, y)
    if residual is not None:
        y = y.add_(residual)
    return y.relu_() if relu else y


def _supports_everything(spec: ConvSpec) -> Optional[str]:
    return None


def _no_configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    return [None]


def not_batch_inner(config: Any) -> bool:
    """`Backend.batch_inner` of backends whose kernels read and write NCHW (the default)."""
    return False


@dataclasses.dataclass(frozen=True)
class Backend:
    """A way to run a sparse convolution.

    dtypes: per device type ("cpu", "cuda"), the input dtypes it runs.
    prepare(weight, config) -> the packed weight; bind(packed, spec, config, dtype, has_bias) ->
    the `KernelCall` running it on inputs of spec's shape and `dtype` (config None: the default).
    spec_check(spec) -> None when the layer is supported, else the reason it is not.
    configs(spec, dtype) -> the candidate configs the autotuner may try (each valid by construction);
    the first is the default for untuned use. `config_from_dict` rebuilds one from its saved form.
    autotune_devices: device types where `backend="auto"` may pick it unasked (None: wherever it
    runs); e.g. a Triton backend runs on CPU only in the interpreter, for tests.
    auto_configs(spec, dtype), optional: the configs `backend="auto"` tries when the backend is
    not named (None: all of `configs`); for backends whose every config costs work per layer.
    auto_with_tf32: whether `backend="auto"` tries it under a policy that offers TF32 (where cuDNN's
    TF32 tensor cores are a candidate); False for an fp32 CUDA-core backend measured to win no layer
    there, so that tuning does not compile its kernels for nothing (named, it is still tried).
    weight_configs(weight, configs), optional: of those auto configs, the ones worth timing for
    this (K, C, R, S) weight with zeros, by a cost model (the tuner measures among the kept ones;
    none: the backend is not timed on this layer).
    prefetch(spec, weight, dtype, has_bias, configs=None, relu_only=False), optional: start
    preparing work for a (K, C, R, S) weight that will be tuned with `configs` (None: its
    `auto_configs`) on inputs of `spec`'s shape at `dtype` (e.g. in worker processes), bound with
    `bind_for(..., relu_only)`; must not change results.
    bind_relu, optional: a `bind` whose kernel computes relu(conv + bias) itself, for layers that
    always ask for the ReLU and never pass a residual (`bind_for` picks it); its call refuses any
    other epilogue.
    pending(spec, weight, dtype, has_bias, config, relu_only=False), optional: whether preparing
    and binding `config` now would wait for prefetched work still running; the tuner then times
    that candidate after the model's other layers.
    bind_pooled(packed, spec, config, dtype, has_bias, pool), optional: a `bind` whose kernel also
    applies the max pool `pool` (a `core.pool_args.PoolArgs`) to act(conv + bias), returning the
    pooled output (no residual), or None where it cannot; without it the layer pools after the call.
    batch_inner(config): whether the kernel with `config` reads its input batch-innermost ((N, C, H, W)
    stored as (C, H, W, N)) and writes new outputs in `config.out_layout` (a "batch" layer, see
    `tuning.layout`); writes_nchw: whether such a layer writes NCHW well (False: it always writes
    batch-innermost outputs, e.g. a warp holding one pixel's images scatters NCHW stores).
    compile_kernels(packed, spec, config, dtype, has_bias, relu_only, cache), optional, for backends
    that generate code per layer: compile (or fetch) the kernels a bound layer runs through `cache`
    (a `core.toolchain.DiskCache`); artefacts pass one that copies every file it touches.
    channels_last: whether its kernels read and write channels_last (NHWC) memory: other layouts
    are copied on every call, so callers that can (a model whose layers agree, a benchmark) pass
    channels_last inputs.
    machine_check(), optional: None when this machine has what the backend needs besides a device
    of its type (a compiler, a kernel loader), else why not; the tuner then leaves the backend out
    and says so once (`tuning.select.candidates_for`).
    prepare_shortcut(weight, shortcut_weight, config) and bind_shortcut(packed, spec, config, dtype,
    has_bias, shortcut_stride), optional: the packed form of a conv with a 1x1 projection shortcut
    of (K, C2, 1, 1) `shortcut_weight` folded into its reduction (None where this config cannot),
    and its `KernelCall`, which takes the shortcut's input in the residual's place:
    act(conv(x) + bias + conv(shortcut_input, shortcut_weight, shortcut_stride)).
    """

    name: str
    description: str
    dtypes: Mapping[str, Tuple[torch.dtype, ...]]
    prepare: PrepareFn
    bind: BindFn
    spec_check: Callable[[ConvSpec], Optional[str]] = _supports_everything
    configs: Callable[[ConvSpec, torch.dtype], List[Any]] = _no_configs
    config_from_dict: Callable[[dict], Any] = lambda saved: None
    autotune_devices: Optional[Tuple[str, ...]] = None
    auto_configs: Optional[Callable[[ConvSpec, torch.dtype], List[Any]]] = None
    auto_with_tf32: bool = True
    weight_configs: Optional[Callable[[torch.Tensor, List[Any]], List[Any]]] = None
    prefetch: Optional[Callable[..., None]] = None
    bind_relu: Optional[BindFn] = None
    pending: Optional[Callable[..., bool]] = None
    bind_pooled: Optional[Callable[..., Optional[KernelCall]]] = None
    batch_inner: Callable[[Any], bool] = not_batch_inner
    writes_nchw: bool = True
    compile_kernels: Optional[Callable[..., None]] = None
    machine_check: Optional[Callable[[], Optional[str]]] = None
    channels_last: bool = False
    prepare_shortcut: Optional[Callable[[torch.Tensor, torch.Tensor, Any], Any]] = None
    bind_shortcut: Optional[Callable[..., KernelCall]] = None

    def bind_for(self, packed: Any, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                 relu_only: bool = False) -> KernelCall:
        """`bind`, or `bind_relu` when every call will ask for the ReLU without a residual
        (`relu_only`) and the backend has one."""
        if relu_only and self.bind_relu is not None:
            return self.bind_relu(packed, spec, config, dtype, has_bias)
        return self.bind(packed, spec, config, dtype, has_bias)

    def run(self, x: torch.Tensor, packed: Any, bias: Optional[torch.Tensor], spec: ConvSpec, config: Any, *,
            relu: bool = False, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """act(conv(x) + bias + residual) -> (N, K, P, Q) for x (N, C, H, W) described by `spec`.

        Binds on every call; code that runs a layer repeatedly should `bind` once and call that.
        """
        call = self.bind_for(packed, spec, config, x.dtype, bias is not None, relu and residual is None)
        return call(x, bias, residual, relu)

    def unsupported_reason(self, spec: ConvSpec, dtype: torch.dtype, device_type: str) -> Optional[str]:
        """None when this backend can run `spec` at `dtype` on `device_type`, else why not."""
        if device_type not in self.dtypes:
            return f"{self.name} does not run on {device_type}"
        if dtype not in self.dtypes[device_type]:
            return f"{self.name} does not support {dtype} on {device_type}"
        return self.spec_check(spec)

    def default_config(self, spec: ConvSpec, dtype: torch.dtype) -> Any:
        return self.configs(spec, dtype)[0]


_REGISTRY: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def backend_names() -> List[str]:
    return list(_REGISTRY)


def config_to_dict(config: Any) -> Optional[dict]:
    """JSON-able form of a config (configs are frozen dataclasses or None)."""
    return None if config is None else dataclasses.asdict(config)
