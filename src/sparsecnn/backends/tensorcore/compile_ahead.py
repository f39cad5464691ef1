"""The tensorcore kernels tuning will launch for a layer, compiled ahead in worker processes
(`core.triton_ahead`): `prefetch` submits them, `bind` settles them (never waits).

Which launches: each pointer-kernel config offered (TMA configs are left to their first call) with
each epilogue the layer may be tuned with (`epilogues`), on the packing of that config, built by
`kernel.pointer_launch` as `unit_conv` builds its launch (how many a model has:
`scripts/tensorcore_compile_census.py`).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_ahead import AheadCompiles, Launch, compile_target, epilogues

_COMPILES = AheadCompiles("tensorcore compile")
_KERNEL = "sparsecnn.backends.tensorcore.kernel:_unit_conv_kernel"
_INDEX = torch.int32


def ahead_launches(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool, configs: List[Any],
                   relu_only: bool, pdl: bool) -> List[Tuple[Any, Launch]]:
    """(config, launch) per compile `prefetch` starts, tensors as dtypes. weight: the (K, C, R, S)
    weight tuning will pack."""
    from sparsecnn.backends.tensorcore.kernel import launch_precision, pointer_launch

    packed = {}
    launches = []
    operands = (dtype, dtype, _INDEX, _INDEX, _INDEX, dtype, dtype, dtype)
    for config in configs:
        if config.loads != "pointer":
            continue
        if config.packing not in packed:
            packed[config.packing] = pack_units(weight, *config.packing)
        for relu, residual in epilogues(relu_only):
            _, args, meta = pointer_launch(operands, (spec.N, spec.C, spec.H, spec.W), (spec.P, spec.Q),
                                           packed[config.packing], spec.stride, spec.padding, config,
                                           launch_precision(dtype, config), (has_bias, residual, relu), pdl)
            launches.append((config, (_KERNEL, args, meta)))
    return launches


def prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
             configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Start compiling, in worker processes, the kernels tuning will launch for this layer
    (`configs`; None: `kernel.auto_configs`) for the GPU `weight` is on; nothing for a weight
    elsewhere (under Triton's CPU interpreter nothing compiles). Returns at once."""
    arch = compile_target(weight, spec)
    if arch is None:
        return
    from sparsecnn.backends.tensorcore import kernel

    configs = kernel.auto_configs(spec, dtype) if configs is None else configs
    for config, launch in ahead_launches(spec, weight, dtype, has_bias, configs, relu_only,
                                         kernel.dependent_launch_on(weight.device)):
        _COMPILES.submit((spec, config, dtype, has_bias), [launch], arch)


def settle(spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> None:
    """At bind: the layer's prefetched compiles of `config` taken if done, cancelled if not started."""
    _COMPILES.settle((spec, config, dtype, has_bias))
