"""Backend `staged`: direct sparse convolution with each output tile's input staged in shared
memory and shared by 32-128 output channels (backends/staged/kernel.py; CUDA C compiled at run
time per kernel size, stride and config, fp32 on CUDA, batch sizes that are multiples of 32).

The kernel module imports triton (its input transpose), so it is imported on first use only.
`bind` hands the packed weight's tensors to the op `sparsecnn::staged_conv2d`, whose epilogue
fuses bias, residual and ReLU; `bind_pooled` one that also fuses a 2x2 stride-2 max pool.

A kernel is compiled on its first call (nvcc and ptxas, about 1 s; ResNet-50 at N=32 has 26
geometry x config kernels). `prefetch` compiles them ahead of tuning in worker processes
($SPARSECNN_COMPILE_WORKERS), into the disk cache where the first call finds them; `bind` takes
the job (its times go to the report), and a job that failed only means compiling on the first call.
`auto` tries it only under exact fp32: where cuDNN runs TF32 (PyTorch's default for fp32) it won
no layer in any measured tuning (RESULTS.md, "Cold tuning time"), while its compiles took a share of
cold tuning's CPU.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

import sparsecnn.settings as settings
from sparsecnn.backends.staged import op
from sparsecnn.core.op_support import config_json, generated_machine_check
from sparsecnn.core.pool_args import PoolArgs
from sparsecnn.core.registry import Backend, KernelCall, register_backend
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_backend import gather_spec_check
from sparsecnn.core.workers import COMPILE_POOL, WorkerPool

_LOG = logging.getLogger("sparsecnn.backends.staged")
_WORKERS = WorkerPool("staged compile", settings.compile_workers, _LOG, COMPILE_POOL)


def _kernels():
    from sparsecnn.backends.staged import kernel as staged

    return staged


def _prepare(weight: torch.Tensor, config: Any):
    return _kernels().pack_weight(weight, config if config is not None else _kernels().StagedConfig())


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool, pool: int = 0) -> KernelCall:
    kernels = _kernels()
    config = config if config is not None else kernels.StagedConfig()
    kernels.check_layer(spec, config)
    if _WORKERS.pending:  # a prefetched compile of this kernel: wait for it (and count its time)
        _WORKERS.take(_compile_key(spec, config))
    static = (list(packed.kernel_shape), packed.max_segment, list(spec.stride), list(spec.padding),
              config_json(config), pool)
    return KernelCall(torch.ops.sparsecnn.staged_conv2d.default, kernels.weight_arrays(packed, spec, config), static,
                      eager=op.staged_conv2d_eager)


def _bind_pooled(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                 pool: PoolArgs) -> Optional[KernelCall]:
    """The kernel with the max pool `pool` in its epilogue, or None where it cannot fuse it: only
    2x2 windows at stride 2 without padding or ceil mode, and configs with an even tile_h."""
    kernels = _kernels()
    config = config if config is not None else kernels.StagedConfig()
    if pool != PoolArgs.of(2) or config.tile_h % 2 or spec.P < 2 or spec.Q < 2:
        return None
    return _bind(packed, spec, config, dtype, has_bias, pool=2)


def _compile_key(spec: ConvSpec, config: Any) -> tuple:
    kernels = _kernels()
    return kernels.geometry(spec), config, kernels.target_arch()


def _prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
              configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Start compiling the kernels of `configs` (None: those `auto` tries) for spec's geometry in
    worker processes, for the current GPU's arch (what the first call would compile)."""
    if dtype != torch.float32 or _spec_check(spec) is not None:
        return
    kernels = _kernels()
    for config in kernels.auto_configs(spec) if configs is None else configs:
        key = _compile_key(spec, config)
        _WORKERS.submit(key, kernels.compile_into_cache, spec, config, key[2])


def _pending(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool, config: Any,
             relu_only: bool = False) -> bool:
    """Whether `config`'s kernel for spec's geometry is still compiling in a worker (a call would wait)."""
    return _spec_check(spec) is None and _WORKERS.running(_compile_key(spec, config))


def _spec_check(spec: ConvSpec) -> Optional[str]:
    if spec.N % 32:
        return f"batch size {spec.N} (staged needs a multiple of 32)"
    return gather_spec_check("staged", spec)


STAGED = register_backend(Backend(
    name="staged",
    description="direct sparse convolution, input tiles staged in shared memory for 32-128 output channels, "
                "CUDA C (fp32)",
    dtypes={"cuda": (torch.float32,)},
    prepare=_prepare,
    bind=_bind,
    bind_pooled=_bind_pooled,
    spec_check=_spec_check,
    configs=lambda spec, dtype: _kernels().candidate_configs(spec),
    auto_configs=lambda spec, dtype: _kernels().auto_configs(spec),
    auto_with_tf32=False,
    config_from_dict=lambda saved: _kernels().StagedConfig.from_dict(saved),
    batch_inner=lambda config: True,
    machine_check=generated_machine_check("nvcc", "ptxas"),
    prefetch=_prefetch,
    pending=_pending,
))
