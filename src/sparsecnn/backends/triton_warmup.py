"""Triton kernels compiled ahead of tuning, in worker processes, into Triton's on-disk cache.

Tuning a model from empty caches spent most of its time in the first calls of the `direct`
candidates: Triton compiling one kernel per config and layer variant, in threads of the tuning
process that mostly hold the GIL. `submit_warmups` has workers (`workers.WorkerPool`, at most
$SPARSECNN_TRITON_WORKERS, each with its own CUDA context) run each candidate once on random
inputs of the layer's exact shapes, with the layer's weight, bias, ReLU and residual, so that the
kernel Triton compiles is the one tuning will ask for; the tuning process then finds it on disk.
Nothing is taken back: results never depend on whether a warm-up ran.
"""
from __future__ import annotations

import logging
from typing import Any, List

import torch

from ..layers import ConvSpec
from .workers import WorkerPool

WORKERS_ENV_VAR = "SPARSECNN_TRITON_WORKERS"
_LOG = logging.getLogger("sparsecnn.backends.triton_warmup")
_WORKERS = WorkerPool("triton compile", WORKERS_ENV_VAR, _LOG)


def _warm_in_worker(backend_name: str, spec: ConvSpec, weight: torch.Tensor, config: Any, dtype: torch.dtype,
                    has_bias: bool, relu: bool, residual: bool) -> None:
    """One call of (backend, config) on CUDA for `spec` (weight: the layer's, on the CPU)."""
    from .registry import get_backend

    device = torch.device("cuda")
    backend = get_backend(backend_name)
    x = torch.randn(spec.input_shape, device=device, dtype=dtype)
    bias = torch.randn(spec.K, device=device, dtype=dtype) if has_bias else None
    added = torch.randn(spec.output_shape, device=device, dtype=dtype) if residual else None
    call = backend.bind(backend.prepare(weight.to(device, dtype), config), spec, config, dtype, has_bias)
    call(x, bias, added, relu)
    torch.cuda.synchronize(device)


def submit_warmups(backend_name: str, spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
                   configs: List[Any], relu: bool, residual: bool) -> None:
    """Start compiling `configs` of `backend_name` for `spec` in workers (weight: (K, C, R, S), the
    one tuning will prepare)."""
    sent = weight.detach().to("cpu", dtype).contiguous().clone()
    for config in configs:
        key = (backend_name, spec, config, str(dtype), has_bias, relu, residual)
        _WORKERS.submit(key, _warm_in_worker, backend_name, spec, sent, config, dtype, has_bias, relu, residual)


def cancel_warmups() -> None:
    """Drop the warm-ups not started yet (tuning is over: compiling them now only takes CPU)."""
    _WORKERS.forget()
