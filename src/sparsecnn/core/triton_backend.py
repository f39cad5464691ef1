"""What the Triton backends share: dtype table, layer checks, the op's static arguments, registration.

Triton decides at import whether kernels run compiled or in its CPU interpreter
(TRITON_INTERPRET=1), so a Triton backend offers CPU (fp32) only while that variable is set.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from sparsecnn.core.checks import interpreting
from sparsecnn.core.op_support import config_json
from sparsecnn.core.registry import Backend, not_batch_inner, register_backend
from sparsecnn.core.spec import ConvSpec

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


def padded_hw(spec: ConvSpec) -> List[int]:
    """[H + 2 pad_h, W + 2 pad_w]: the input size a packed weight's offsets are computed for."""
    return [spec.H + 2 * spec.padding[0], spec.W + 2 * spec.padding[1]]


def op_static_args(packed, spec: ConvSpec, config: Any) -> tuple:
    """The non-tensor arguments of a Triton op: (kernel shape, padded size, stride, padding, config JSON)."""
    return (list(packed.kernel_shape), padded_hw(spec), list(spec.stride), list(spec.padding), config_json(config))


def register_triton_backend(name: str, description: str, kernels: Callable[[], ModuleType], config_class: str,
                            prepare, bind, prefetch=None, auto_configs=None, weight_configs=None,
                            batch_inner: Callable[[Any], bool] = not_batch_inner, channels_last: bool = False,
                            prepare_shortcut=None, bind_shortcut=None) -> Backend:
    """Register a Triton backend whose kernel module (imported lazily by `kernels()`) provides
    `candidate_configs(spec, dtype)` and the config dataclass named `config_class`; prefetch,
    auto_configs, weight_configs, batch_inner, channels_last, prepare_shortcut and bind_shortcut:
    see `Backend`."""
    return register_backend(Backend(
        name=name,
        description=description,
        dtypes=TritonDtypes(),
        autotune_devices=("cuda",),  # on CPU it runs only in Triton's interpreter, for tests
        prepare=prepare,
        bind=bind,
        spec_check=lambda spec: gather_spec_check(name, spec),
        configs=lambda spec, dtype: kernels().candidate_configs(spec, dtype),
        config_from_dict=lambda saved: getattr(kernels(), config_class).from_dict(saved),
        prefetch=prefetch,
        auto_configs=auto_configs,
        weight_configs=weight_configs,
        batch_inner=batch_inner,
        channels_last=channels_last,
        prepare_shortcut=prepare_shortcut,
        bind_shortcut=bind_shortcut,
    ))
