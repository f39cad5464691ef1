"""Backend `direct`: UnSparse-Opt direct sparse convolution (paper 003, Algorithm 4) in Triton.

The kernel module imports triton, and triton decides at import whether kernels run compiled or
in its CPU interpreter (TRITON_INTERPRET=1). So it is imported on first use (prepare, run,
configs), never by `import sparsecnn`, and nothing here touches CUDA. CPU (fp32) is offered only
while TRITON_INTERPRET=1 is set; set it before the first use of this backend.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..formats import ChunkedCSRWeight, OffsetCSRWeight, UniformELLWeight
from ..layers import ConvSpec
from .registry import Backend, register_backend

_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


class _Dtypes(Mapping):
    """{"cuda": fp32/fp16/bf16} plus {"cpu": fp32} while TRITON_INTERPRET=1, read at each lookup."""

    def _table(self) -> Dict[str, Tuple[torch.dtype, ...]]:
        table = {"cuda": _CUDA_DTYPES}
        if _interpreting():
            table["cpu"] = (torch.float32,)
        return table

    def __getitem__(self, device_type: str) -> Tuple[torch.dtype, ...]:
        return self._table()[device_type]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _kernels():
    from ..kernels.triton import direct_conv

    return direct_conv


def _spec_check(spec: ConvSpec) -> Optional[str]:
    if spec.groups != 1:
        return f"groups={spec.groups} (direct supports groups=1 only)"
    if spec.dilation != (1, 1):
        return f"dilation={spec.dilation} (direct supports dilation 1 only)"
    ph, pw = spec.padding
    if spec.C * (spec.H + 2 * ph) * (spec.W + 2 * pw) > _INT32_MAX or spec.K * spec.P * spec.Q > _INT32_MAX:
        return "one image's input or output exceeds int32 offsets"
    return None


def _prepare(weight: torch.Tensor, config: Any):
    """Dense (K, C, R, S) weight -> the format of the config's variant (chunked CSR of 8 when None)."""
    if config is None or config.variant == "chunk":
        return ChunkedCSRWeight.from_dense(weight, 8 if config is None else config.chunk)
    return UniformELLWeight.from_dense(weight) if config.variant == "ell" else OffsetCSRWeight.from_dense(weight)


def _run(x: torch.Tensor, packed, bias: Optional[torch.Tensor], spec: ConvSpec, config: Any) -> torch.Tensor:
    kernels = _kernels()
    if config is None:
        config = kernels.default_config(spec, x.dtype, kernels.variant_of(packed))
    return kernels.direct_conv2d(x, packed, bias, spec.stride, spec.padding, config)


def _configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    return _kernels().candidate_configs(spec, dtype)


def _config_from_dict(saved: dict) -> Any:
    return _kernels().DirectConfig.from_dict(saved)


DIRECT = register_backend(Backend(
    name="direct",
    description="direct sparse convolution (UnSparse-Opt): chunked CSR, uniform-ELL or CSR weights with "
                "precomputed input offsets, Triton",
    dtypes=_Dtypes(),
    autotune_devices=("cuda",),  # on CPU it runs only in Triton's interpreter, for tests
    prepare=_prepare,
    run=_run,
    spec_check=_spec_check,
    configs=_configs,
    config_from_dict=_config_from_dict,
))
