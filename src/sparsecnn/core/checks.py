"""Helpers shared by kernels: config validation and launcher argument checks.

Imports neither triton nor CUDA, so backends may use it at `import sparsecnn` time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Optional, Sequence, Tuple, Type, TypeVar

import torch

from sparsecnn.core.spec import ConvSpec

Config = TypeVar("Config")


def is_pow2(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value & (value - 1) == 0


def pow2_at_least(value: int) -> int:
    """The smallest power of two >= value (1 for value <= 1)."""
    return 1 << max(0, int(value) - 1).bit_length()


def check_pow2_field(owner: str, name: str, value, low: int, high: int) -> None:
    """ValueError naming `owner.name` unless `value` is a power of two in low..high."""
    if not is_pow2(value) or not low <= value <= high:
        raise ValueError(f"{owner}.{name} must be a power of two in {low}..{high}, got {value!r}")


def config_from_dict(cls: Type[Config], saved: dict) -> Config:
    """Rebuild a config dataclass from `dataclasses.asdict` output (unknown keys are an error)."""
    unknown = set(saved) - {field.name for field in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}.from_dict: unknown keys {sorted(unknown)}")
    return cls(**saved)


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on CPU tensors (its interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def int_pair(value, name: str) -> Tuple[int, int]:
    """An int or a pair of ints as a pair; ValueError naming `name` otherwise."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair


def check_triton_input(x: torch.Tensor, kernel: str, dtypes: Sequence[torch.dtype]) -> None:
    """x must be a 4-D (N, C, H, W) tensor of one of `dtypes`, on CUDA (or on the CPU while Triton
    interprets); the errors name `kernel`."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D (N, C, H, W) tensor, got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in dtypes:
        raise TypeError(f"x dtype must be one of {tuple(dtypes)}, got {x.dtype}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"x is on {x.device}: the {kernel} kernel needs CUDA (or CPU with TRITON_INTERPRET=1)")


def stride_padding(stride, padding) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((sh, sw), (ph, pw)) from ints or pairs; ValueError unless stride >= 1 and padding >= 0."""
    (sh, sw), (ph, pw) = int_pair(stride, "stride"), int_pair(padding, "padding")
    if min(sh, sw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"stride must be >= 1 and padding >= 0, got stride={stride!r} padding={padding!r}")
    return (sh, sw), (ph, pw)


@functools.lru_cache(maxsize=1024)
def launch_spec(x_shape: Tuple[int, int, int, int], kernel_shape: Tuple[int, int, int, int],
                stride: Tuple[int, int], padding: Tuple[int, int]) -> ConvSpec:
    """The `ConvSpec` of an (N, C, H, W) input convolved by a (K, C, R, S) kernel. Cached: the
    launchers need it on every call, and building one (with its checks) is a large share of an
    eager call's Python time."""
    n, c, h, w = x_shape
    k, _, r, s = kernel_shape
    return ConvSpec(n, c, k, h, w, r, s, stride, padding)


def current_device(x: torch.Tensor):
    """A context in which x's CUDA device is the current one (Triton launches on the current device):
    a no-op when it already is or x is not on CUDA, since entering `torch.cuda.device` on every eager
    call showed in the eager profile (`scripts/profile_eager.py`)."""
    if not x.is_cuda or x.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(x.device)


def check_kernel_shape(kernel_shape) -> Tuple[int, int, int, int]:
    """The weight's (K, C, R, S) as a 4-tuple; ValueError otherwise."""
    if len(kernel_shape) != 4:
        raise ValueError(f"kernel_shape must be (K, C, R, S), got {tuple(kernel_shape)}")
    return tuple(kernel_shape)


def check_residual(residual: Optional[torch.Tensor], shape: Sequence[int], like: torch.Tensor) -> None:
    """Raise unless `residual` is None or a tensor of `shape` with the dtype and device of `like`.

    The epilogue adds the residual to a conv output of `shape` computed from input `like`.
    """
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor or None, got {type(residual).__name__}")
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"residual must have the output's shape {tuple(shape)}, got {tuple(residual.shape)}")
    if residual.dtype != like.dtype:
        raise TypeError(f"residual dtype {residual.dtype} differs from the input's {like.dtype}")
    if residual.device != like.device:
        raise ValueError(f"residual is on {residual.device} but the input is on {like.device}")
