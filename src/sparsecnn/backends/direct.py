"""Backend `direct`: UnSparse-Opt direct sparse convolution (paper 003, Algorithm 4) in Triton.

The kernel module imports triton, and triton decides at import whether kernels run compiled or
in its CPU interpreter (TRITON_INTERPRET=1). So it is imported on first use (prepare, bind,
configs), never by `import sparsecnn`, and nothing here touches CUDA. CPU (fp32) is offered only
while TRITON_INTERPRET=1 is set; set it before the first use of this backend. `bind` hands the
packed weight's tensors to the op `sparsecnn::direct_conv2d`, whose epilogue fuses bias, residual
and ReLU.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..formats import ChunkedCSRWeight, OffsetCSRWeight, UniformELLWeight
from ..layers import ConvSpec
from ..ops import config_json
from .registry import Backend, KernelCall, register_backend
from .triton_common import TritonDtypes, gather_spec_check


def _kernels():
    from ..kernels.triton import direct_conv

    return direct_conv


def _spec_check(spec: ConvSpec) -> Optional[str]:
    return gather_spec_check("direct", spec)


def _prepare(weight: torch.Tensor, config: Any):
    """Dense (K, C, R, S) weight -> the format of the config's variant (chunked CSR of 8 when None)."""
    if config is None or config.variant == "chunk":
        return ChunkedCSRWeight.from_dense(weight, 8 if config is None else config.chunk)
    return UniformELLWeight.from_dense(weight) if config.variant == "ell" else OffsetCSRWeight.from_dense(weight)


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The op `sparsecnn::direct_conv2d` on the packed weight's tensors for spec's padded input size."""
    kernels = _kernels()
    if config is None:
        config = kernels.default_config(spec, dtype, kernels.variant_of(packed))
    kernels.check_weight_variant(packed, config)
    padded_hw = [spec.H + 2 * spec.padding[0], spec.W + 2 * spec.padding[1]]
    static = (list(packed.kernel_shape), padded_hw, list(spec.stride), list(spec.padding), config_json(config))
    return KernelCall(torch.ops.sparsecnn.direct_conv2d.default, kernels.weight_arrays(packed, *padded_hw), static)


def _configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    return _kernels().candidate_configs(spec, dtype)


def _config_from_dict(saved: dict) -> Any:
    return _kernels().DirectConfig.from_dict(saved)


DIRECT = register_backend(Backend(
    name="direct",
    description="direct sparse convolution (UnSparse-Opt): chunked CSR, uniform-ELL or CSR weights with "
                "precomputed input offsets, Triton",
    dtypes=TritonDtypes(),
    autotune_devices=("cuda",),  # on CPU it runs only in Triton's interpreter, for tests
    prepare=_prepare,
    bind=_bind,
    spec_check=_spec_check,
    configs=_configs,
    config_from_dict=_config_from_dict,
))
