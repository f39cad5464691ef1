"""Backend `direct`: UnSparse-Opt direct sparse convolution (paper 003, Algorithm 4) in Triton.

The kernel module imports triton, and triton decides at import whether kernels run compiled or
in its CPU interpreter (TRITON_INTERPRET=1). So it is imported on first use (prepare, bind,
configs), never by `import sparsecnn`, and nothing here touches CUDA. CPU (fp32) is offered only
while TRITON_INTERPRET=1 is set; set it before the first use of this backend. `bind` hands the
packed weight's tensors to the op `sparsecnn::direct_conv2d`, whose epilogue fuses bias, residual
and ReLU. `prefetch` compiles the kernels tuning will launch in worker processes (`compile_ahead`).
"""
from __future__ import annotations

from typing import Any

import torch

from sparsecnn.backends.direct import compile_ahead, op
from sparsecnn.backends.direct.format import (
    ChunkedCSRWeight,
    OffsetCSRWeight,
    UniformELLWeight,
)
from sparsecnn.core.registry import KernelCall
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_backend import (
    op_static_args,
    padded_hw,
    register_triton_backend,
)


def _kernels():
    from sparsecnn.backends.direct import kernel as direct_conv

    return direct_conv


def _prepare(weight: torch.Tensor, config: Any):
    """Dense (K, C, R, S) weight -> the format of the config's variant (chunked CSR of 8 when None)."""
    if config is None or config.variant in ("chunk", "batch"):
        return ChunkedCSRWeight.from_dense(weight, 8 if config is None else config.chunk)
    return UniformELLWeight.from_dense(weight) if config.variant == "ell" else OffsetCSRWeight.from_dense(weight)


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The op `sparsecnn::direct_conv2d` on the packed weight's tensors for spec's padded input size
    (variant "batch": with images per program dividing spec's batch, `kernel.for_batch`)."""
    kernels = _kernels()
    if config is None:
        config = kernels.default_config(spec, dtype, kernels.variant_of(packed))
    compile_ahead.settle(spec, config, dtype, has_bias)
    config = kernels.for_batch(config, spec.N)
    kernels.check_weight_variant(packed, config)
    return KernelCall(torch.ops.sparsecnn.direct_conv2d.default,
                      kernels.weight_arrays(packed, *padded_hw(spec), config, spec.padding),
                      op_static_args(packed, spec, config), eager=kernels.BoundDirectCall(op.direct_conv2d_eager))


DIRECT = register_triton_backend(
    "direct",
    "direct sparse convolution (UnSparse-Opt): chunked CSR, uniform-ELL or CSR weights with precomputed input "
    "offsets, Triton",
    _kernels, "DirectConfig", _prepare, _bind, prefetch=compile_ahead.prefetch,
    auto_configs=lambda spec, dtype: _kernels().auto_configs(spec, dtype),
    batch_inner=lambda config: getattr(config, "variant", None) == "batch")
