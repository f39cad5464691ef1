"""Compiling a Triton backend's kernels ahead of tuning, in worker processes.

Why. Tuning calls each candidate once before timing it, and that first call compiles the kernel
specialization it launches, in the tuning process, where Triton's front end holds the GIL: the
compiles run one at a time on the tuning thread's path (RESULTS.md, cold tuning). A backend's
`prefetch` hands each launch tuning will make to `AheadCompiles.submit`; a worker process compiles
it for the GPU's architecture without touching a GPU (`compile_in_worker`: Triton's own binder,
option parsing and compiler, as `JITFunction.run` calls them), into Triton's disk cache, where the
tuning process's first call finds it. Layers that share a specialization share its compile.

Never waited for. `settle(layer)` (at bind) takes finished jobs (their times go to the report)
and cancels those not yet started; a running one is left to finish. The first call then loads the
kernel from the disk cache or compiles it itself, as it would without workers: a late or failed
worker compile costs CPU, never a wait or a different result. The workers are a small pool of their
own (`workers()`: at most 4), so these short jobs do not queue behind the long ptxas jobs of the
generated backends.
"""
from __future__ import annotations

import logging
from typing import Dict, Hashable, Iterable, List, Optional, Tuple

import torch

import sparsecnn.settings as settings
from sparsecnn.core.workers import WorkerPool

# One launch to compile: (kernel as "module:attribute", its runtime arguments in order with each
# tensor given as its dtype (taken as 16-byte aligned, as PyTorch's allocations are), its
# constexprs and launch options by name).
Launch = Tuple[str, tuple, dict]
_INT32 = (-2 ** 31, 2 ** 31 - 1)
_MAX_WORKERS = 4
_LOG = logging.getLogger("sparsecnn.core.triton_ahead")


def epilogues(relu_only: bool) -> List[Tuple[bool, bool]]:
    """(relu, residual) pairs a layer may be tuned with: relu alone where `relu_only`; else the
    layer's epilogue is not known at prefetch, and the two a fused ResNet has are compiled: neither
    (a downsample conv) and both (the conv before a residual add)."""
    return [(True, False)] if relu_only else [(False, False), (True, True)]


def workers() -> int:
    """Worker processes for Triton compiles: $SPARSECNN_COMPILE_WORKERS, at most 4 (0: none)."""
    return min(_MAX_WORKERS, settings.compile_workers())


def compile_target(weight: torch.Tensor, spec) -> Optional[int]:
    """The arch (90 for sm_90) to compile a layer's kernels ahead for: the GPU `weight` is on; None
    for a weight elsewhere (under Triton's CPU interpreter nothing compiles) or a layer without
    output pixels (`spec`, a ConvSpec, at its tuning shape)."""
    if weight.device.type != "cuda" or spec.N * spec.P * spec.Q == 0:
        return None
    major, minor = torch.cuda.get_device_capability(weight.device)
    return major * 10 + minor


def launch_key(launch: Launch) -> Hashable:
    """What the compiled kernel depends on: the kernel, its constexprs and options, each tensor's
    dtype and, per int, what Triton may specialize on (64-bit, == 1, divisible by 16). It may split
    more finely than Triton does (ints of parameters Triton does not specialize), never less."""
    kernel, args, meta = launch
    ints = (lambda value: (not _INT32[0] <= value <= _INT32[1], value == 1, value % 16 == 0))
    return kernel, tuple(arg if isinstance(arg, torch.dtype) else ints(arg) for arg in args), tuple(sorted(meta.items()))


def compile_in_worker(kernel_path: str, arch: int, args: tuple, meta: dict) -> None:
    """Compile the kernel at `kernel_path` ("module:attribute", a `triton.jit` function) for sm_`arch`
    with the specialization `args` and `meta` give, into Triton's disk cache, as `JITFunction.run`
    would on that GPU: its binder, option parsing and compile, so that the cache key is the one the
    tuning process's launch computes. Needs no GPU."""
    import importlib

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    module, _, name = kernel_path.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(meta)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*map(MockTensor.wrap_dtype, args), **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


class AheadCompiles:
    """One backend's compiles ahead of tuning, by layer. what: the work, for the report ("direct
    compile"); pool: the `WorkerPool` (default: `workers()` processes of its own)."""

    def __init__(self, what: str, pool: Optional[WorkerPool] = None) -> None:
        self.pool = pool or WorkerPool(what, workers, _LOG)
        self._submitted: set = set()
        self._by_layer: Dict[Hashable, List[Hashable]] = {}

    def submit(self, layer: Hashable, launches: Iterable[Launch], arch: int) -> None:
        """Start compiling, for sm_`arch`, each of the launches of `layer` (any key its backend's
        bind can name again, e.g. (spec, config, dtype, has_bias)) not started before."""
        keys = self._by_layer.setdefault(layer, [])
        for launch in launches:
            key = launch_key(launch)
            keys.append(key)
            if key not in self._submitted:
                self._submitted.add(key)
                self.pool.submit(key, compile_in_worker, *launch[:1], arch, *launch[1:])

    def settle(self, layer: Hashable) -> None:
        """At bind, without waiting: of the compiles submitted for `layer`, take the finished ones
        (counting their times), cancel those not started (the first call compiles them, as it would
        without workers), leave running ones."""
        for key in self._by_layer.pop(layer, ()):
            entry = self.pool.pending.get(key)
            if entry is None:
                continue
            if entry[0].cancel():
                del self.pool.pending[key]
            elif entry[0].done():
                self.pool.take(key)
