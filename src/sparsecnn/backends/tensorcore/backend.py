"""Backend `tensorcore`: sparse convolution on tensor cores over kept units (issue 45).

prepare packs the weight for the config's (group, chunk) with its output channels in the config's
order (`format.pack_units`: by the units they keep, or by index); bind hands its tensors to the op
`sparsecnn::tensorcore_conv2d`, whose epilogue fuses bias, residual and ReLU. Inputs and outputs
are channels_last. The kernel module imports triton, so it is imported on first use (configs,
bind), never by `import sparsecnn`; CPU (fp32) runs only while TRITON_INTERPRET=1 is set.
`prefetch` compiles the kernels tuning will launch in worker processes (`compile_ahead`).
"""
from __future__ import annotations

from typing import Any

import torch

from sparsecnn.backends.tensorcore import compile_ahead, op
from sparsecnn.backends.tensorcore.format import UnitWeights, pack_shortcut_units, pack_units
from sparsecnn.core.op_support import config_json
from sparsecnn.core.registry import KernelCall
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_backend import register_triton_backend


def _kernels():
    from sparsecnn.backends.tensorcore import kernel

    return kernel


def _prepare(weight: torch.Tensor, config: Any) -> UnitWeights:
    """Dense (K, C, R, S) weight with zeros -> `UnitWeights` on its device for the config's packing
    (None: the default config's)."""
    if config is None:
        config = _kernels().TensorCoreConfig()
    return pack_units(weight, *config.packing)


def _bind(packed: UnitWeights, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The op `sparsecnn::tensorcore_conv2d` on the packed weight (config None: the default launch
    for the packing the weight has)."""
    if config is None:
        config = _kernels().TensorCoreConfig(group=packed.group, chunk=packed.chunk, order=packed.order)
    compile_ahead.settle(spec, config, dtype, has_bias)
    if config.packing != (packed.group, packed.chunk, packed.order):
        raise ValueError(f"config packing (group, chunk, order) = {config.packing} differs from the weight's "
                         f"{(packed.group, packed.chunk, packed.order)}; prepare the weight for this config")
    tensors = (packed.values.to(dtype), packed.unit_tap, packed.unit_chunk, packed.unit_code, packed.group_start,
               packed.out_channel)
    static = (list(packed.kernel_shape), list(spec.stride), list(spec.padding), packed.permuted, packed.max_units,
              config_json(config))
    return KernelCall(torch.ops.sparsecnn.tensorcore_conv2d.default, tensors, static,
                      eager=op.tensorcore_conv2d_eager)


def _prepare_shortcut(weight: torch.Tensor, shortcut_weight: torch.Tensor, config: Any):
    """`format.pack_shortcut_units` for the config's (group, chunk), or None where the config's
    packing cannot hold a shortcut: support order (its channel map), or C not a multiple of chunk."""
    if config is None:
        config = _kernels().TensorCoreConfig()
    if config.order != "index" or weight.shape[1] % config.chunk:
        return None
    return pack_shortcut_units(weight, shortcut_weight, config.group, config.chunk)


def _bind_shortcut(packed: UnitWeights, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool,
                   shortcut_stride) -> KernelCall:
    """The op `sparsecnn::tensorcore_shortcut_conv2d` on a `_prepare_shortcut` packing; its call
    takes the shortcut's input where other calls take a residual."""
    if config is None:
        config = _kernels().TensorCoreConfig(group=packed.group, chunk=packed.chunk)
    tensors = (packed.values.to(dtype), packed.unit_tap, packed.unit_chunk, packed.unit_code, packed.group_start,
               packed.out_channel, packed.group_split)
    static = (list(packed.kernel_shape), list(spec.stride), list(spec.padding), packed.shortcut_channels,
              list(shortcut_stride), packed.max_units, config_json(config))
    return KernelCall(torch.ops.sparsecnn.tensorcore_shortcut_conv2d.default, tensors, static,
                      eager=op.tensorcore_shortcut_conv2d_eager)


TENSORCORE = register_triton_backend(
    "tensorcore",
    "implicit GEMM on tensor cores over each output-channel group's kept units (runs of input channels at one "
    "tap), NHWC, Triton",
    _kernels, "TensorCoreConfig", _prepare, _bind, prefetch=compile_ahead.prefetch,
    auto_configs=lambda spec, dtype: _kernels().auto_configs(spec, dtype),
    weight_configs=lambda weight, configs: _kernels().least_work_configs(weight, configs), channels_last=True,
    prepare_shortcut=_prepare_shortcut, bind_shortcut=_bind_shortcut)
