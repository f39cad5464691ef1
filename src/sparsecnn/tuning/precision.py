"""Precision policies: the dtype a tuned model runs in and whether TF32 may round fp32 products.

Tuning and the final accuracy check run with the global TF32 flags as the policy says
(`tf32_flags(policy.dense_tf32)`): off for exact policies, so that `dense`, `im2col-cublas` and every
other candidate compute exactly what their dtype says, on for "fp32-default" (PyTorch's defaults,
the policy of `dtype=None` for an fp32 model while `torch.backends.cudnn.allow_tf32` is on); a
TF32 candidate (backend `dense-tf32`, or a config whose `precision` field is "tf32") turns TF32 on
for its own kernel only, and is offered under "tf32" and under "fp32-default" (where cuDNN rounds
convolution products to TF32 already, so a sparse kernel that does the same costs no accuracy the
user has not accepted). The "fp32" policy admits
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
    """name: "fp32" (exact), "fp32-default", "tf32", "fp16", "bf16" or "fp64"; dtype: what weights
    and activations are stored in; allow_tf32: whether fp32 candidates that round products to TF32
    are offered; dense_tf32: whether tuning, the checks and inference run with PyTorch's TF32 flags
    on, so that dense cuDNN/cuBLAS layers round products to TF32 (as PyTorch runs fp32 convolutions
    by default); describe: one line for reports."""

    name: str
    dtype: torch.dtype
    allow_tf32: bool
    dense_tf32: bool = False
    describe: str = ""


POLICIES = {
    "fp32": PrecisionPolicy("fp32", torch.float32, False, describe="fp32, exact everywhere (TF32 off)"),
    "tf32": PrecisionPolicy("tf32", torch.float32, True, describe="fp32 storage, TF32 products allowed in any kernel"),
    "fp16": PrecisionPolicy("fp16", torch.float16, False, describe="fp16"),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16, False, describe="bf16"),
    "fp64": PrecisionPolicy("fp64", torch.float64, False, describe="fp64"),
    "fp32-default": PrecisionPolicy("fp32-default", torch.float32, True, dense_tf32=True,
                                    describe="fp32 at PyTorch's defaults: convs in TF32, dense and sparse"),
}
_BY_DTYPE = {policy.dtype: policy for policy in POLICIES.values() if policy.name not in ("tf32", "fp32-default")}


def resolve_policy(dtype: Optional[str], model_dtype: torch.dtype, device_type: str = "cpu") -> PrecisionPolicy:
    """The policy named by `dtype`; for None, the one PyTorch's flags give the model's parameter
    dtype on `device_type`: an fp32 model on CUDA with `torch.backends.cudnn.allow_tf32` on
    (PyTorch's default) gets "fp32-default" (convs in TF32, dense and sparse), else the
    exact policy of its dtype (TF32 does not exist on the CPU)."""
    if dtype is None:
        if model_dtype == torch.float32 and device_type == "cuda" and torch.backends.cudnn.allow_tf32:
            return POLICIES["fp32-default"]
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
