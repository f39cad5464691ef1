"""What the Triton backends share: their dtype table and the layer checks of a gather kernel.

Triton decides at import whether kernels run compiled or in its CPU interpreter
(TRITON_INTERPRET=1), so a Triton backend offers CPU (fp32) only while that variable is set.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..kernels.configs import interpreting
from ..layers import ConvSpec

_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


class TritonDtypes(Mapping):
    """{"cuda": fp32/fp16/bf16} plus {"cpu": fp32} while TRITON_INTERPRET=1, read at each lookup."""

    def _table(self) -> Dict[str, Tuple[torch.dtype, ...]]:
        table = {"cuda": _CUDA_DTYPES}
        if interpreting():
            table["cpu"] = (torch.float32,)
        return table

    def __getitem__(self, device_type: str) -> Tuple[torch.dtype, ...]:
        return self._table()[device_type]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def gather_spec_check(name: str, spec: ConvSpec) -> Optional[str]:
    """Why backend `name` (groups 1, dilation 1, int32 offsets within an image) cannot run `spec`."""
    if spec.groups != 1:
        return f"groups={spec.groups} ({name} supports groups=1 only)"
    if spec.dilation != (1, 1):
        return f"dilation={spec.dilation} ({name} supports dilation 1 only)"
    ph, pw = spec.padding
    if spec.C * (spec.H + 2 * ph) * (spec.W + 2 * pw) > _INT32_MAX or spec.K * spec.P * spec.Q > _INT32_MAX:
        return "one image's input or output exceeds int32 offsets"
    return None
