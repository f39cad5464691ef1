"""Measured hardware ceilings and the roofline floor: the least time any kernel could take."""
from __future__ import annotations

from typing import Dict

import torch

from sparsecnn.bench.schema import DTYPES
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning import benchmark

# (bytes copied, matmul size n for n x n x n) per device type; CPU sizes keep it under ~2 s
_SIZES = {"cuda": (1 << 30, 8192), "cpu": (64 << 20, 1024)}
_ELEM_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}
_CACHE: Dict[str, Dict[str, float]] = {}


def _time_ms(fn, device: torch.device) -> float:
    return benchmark(fn, device, warmup_ms=10, rep_ms=50, min_rep=3, flush_l2=False)["median_ms"]


def _copy_GBps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _matmul_TFLOPs(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """Dense n x n x n matmul rate in TFLOP/s (2 n^3 flops), TF32 off."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ms = _time_ms(lambda: a @ b, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def measure_ceilings(device: torch.device | str) -> Dict[str, float]:
    """{"copy_GBps", "fp32_TFLOPs", "fp16_TFLOPs"} measured on `device`, cached per process.

    CUDA: 1 GiB device-to-device copy; 8192^3 matmul in fp32 (TF32 off) and in fp16.
    CPU: 64 MiB copy and 1024^3 fp32 matmul; fp16_TFLOPs is set to the fp32 rate (CPUs have no
    faster half-precision path that matters here).
    """
    device = torch.device(device)
    key = str(device)
    if key not in _CACHE:
        nbytes, n = _SIZES["cuda" if device.type == "cuda" else "cpu"]
        fp32 = _matmul_TFLOPs(device, n, torch.float32)
        fp16 = _matmul_TFLOPs(device, n, torch.float16) if device.type == "cuda" else fp32
        _CACHE[key] = {"copy_GBps": _copy_GBps(device, nbytes), "fp32_TFLOPs": fp32, "fp16_TFLOPs": fp16}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(_CACHE[key])


def floor_ms(spec: ConvSpec, density: float, dtype: str, ceilings: Dict[str, float]) -> float:
    """Roofline floor in ms of `spec` with a weight of `density` at dtype name `dtype`:
    max(spec.min_bytes / copy bandwidth, density * dense_flops / math rate), the rate being
    fp32_TFLOPs for "fp32"/"tf32" and fp16_TFLOPs for "fp16"/"bf16"."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    rate = ceilings["fp16_TFLOPs" if _ELEM_BYTES[dtype] == 2 else "fp32_TFLOPs"]
    memory_s = spec.min_bytes(_ELEM_BYTES[dtype], density) / (ceilings["copy_GBps"] * 1e9)
    compute_s = density * spec.dense_flops / (rate * 1e12)
    return max(memory_s, compute_s) * 1e3
