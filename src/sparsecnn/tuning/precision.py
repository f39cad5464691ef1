"""Precision policies: the dtype a tuned model runs in and whether TF32 may round fp32 products.

Tuning and the final accuracy check run with the global TF32 flags off (`tf32_flags(False)`), so
that `dense`, `im2col-cublas` and every other candidate compute exactly what their dtype says; a
TF32 candidate (backend `dense-tf32`, or a config whose `precision` field is "tf32") turns TF32 on
for its own kernel only, and is offered only under the "tf32" policy. The "fp32" policy admits
fp32-level products only: FMA units, or 3xTF32 on tensor cores (a `precision` of "tf32x3": three
TF32 products per fp32 product, error within ~2x of cuDNN fp32's). Layers left on `dense` run
exact fp32 at inference only while torch.backends.cudnn.allow_tf32 is False (PyTorch's default
is True): set it for exact results outside tuning.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch

TF32_BACKENDS = frozenset({"dense-tf32"})  # backends whose fp32 products are rounded to TF32
_PRECISION_FIELD = "precision"  # configs with this field ("ieee" / "tf32x3" / "tf32") choose it per config


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """name: "fp32" (exact), "tf32", "fp16", "bf16" or "fp64"; dtype: what weights and activations
    are stored in; allow_tf32: whether fp32 candidates that round products to TF32 are offered."""

    name: str
    dtype: torch.dtype
    allow_tf32: bool


POLICIES = {
    "fp32": PrecisionPolicy("fp32", torch.float32, False),
    "tf32": PrecisionPolicy("tf32", torch.float32, True),
    "fp16": PrecisionPolicy("fp16", torch.float16, False),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16, False),
    "fp64": PrecisionPolicy("fp64", torch.float64, False),
}
_BY_DTYPE = {policy.dtype: policy for policy in POLICIES.values() if policy.name != "tf32"}


def resolve_policy(dtype: Optional[str], model_dtype: torch.dtype) -> PrecisionPolicy:
    """The policy named by `dtype`, or for None the exact policy of the model's parameter dtype."""
    if dtype is None:
        if model_dtype not in _BY_DTYPE:
            raise ValueError(f"the model's parameters are {model_dtype}: pass dtype= one of {', '.join(POLICIES)}")
        return _BY_DTYPE[model_dtype]
    if dtype not in POLICIES:
        raise ValueError(f"dtype must be None or one of {', '.join(POLICIES)}, got {dtype!r}")
    return POLICIES[dtype]


def uses_tf32(backend: str, config: Any) -> bool:
    """Whether (backend, config) rounds fp32 products to TF32."""
    return backend in TF32_BACKENDS or getattr(config, _PRECISION_FIELD, None) == "tf32"


def tf32_variant(config: Any) -> Optional[Any]:
    """`config` with precision "tf32" if its type has a precision field and it is not TF32 yet, else None."""
    fields = {field.name for field in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else ()
    if _PRECISION_FIELD not in fields or getattr(config, _PRECISION_FIELD) == "tf32":
        return None
    return dataclasses.replace(config, **{_PRECISION_FIELD: "tf32"})


@contextlib.contextmanager
def tf32_flags(enabled: bool) -> Iterator[None]:
    """Within the block, cuDNN convolutions and cuBLAS matmuls may use TF32 iff `enabled`; the
    previous flags are restored on exit."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
