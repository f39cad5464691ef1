"""Backend `staged`: direct sparse convolution with each output tile's input staged in shared
memory and shared by 32-128 output channels (kernels/codegen/staged.py; CUDA C compiled at run
time per kernel size, stride and config, fp32 on CUDA, batch sizes that are multiples of 32).

The kernel module imports triton (its input transpose), so it is imported on first use only.
`bind` hands the packed weight's tensors to the op `sparsecnn::staged_conv2d`, whose epilogue
fuses bias, residual and ReLU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import ops
from ..layers import ConvSpec
from ..ops import config_json
from .registry import Backend, KernelCall, register_backend
from .triton_common import gather_spec_check


def _kernels():
    from ..kernels.codegen import staged

    return staged


def _prepare(weight: torch.Tensor, config: Any):
    return _kernels().pack_weight(weight, config if config is not None else _kernels().StagedConfig())


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    kernels = _kernels()
    config = config if config is not None else kernels.StagedConfig()
    kernels.check_layer(spec, config)
    static = (list(packed.kernel_shape), packed.max_segment, list(spec.stride), list(spec.padding),
              config_json(config))
    return KernelCall(torch.ops.sparsecnn.staged_conv2d.default, kernels.weight_arrays(packed, spec, config), static,
                      eager=ops.staged_conv2d_eager)


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
    spec_check=_spec_check,
    configs=lambda spec, dtype: _kernels().candidate_configs(spec),
    auto_configs=lambda spec, dtype: _kernels().auto_configs(spec),
    config_from_dict=lambda saved: _kernels().StagedConfig.from_dict(saved),
))
