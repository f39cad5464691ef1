"""Where a tuning decision was measured: the device and the toolchain versions that change timings.

Nothing here runs at import: CUDA is touched (device name) only when a fingerprint of a CUDA device
is asked for, and the driver version comes from nvidia-smi, run once per process.
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from typing import Dict, Optional

import torch

Fingerprint = Dict[str, Optional[str]]


@functools.lru_cache(maxsize=None)
def _nvidia_driver() -> Optional[str]:
    """The NVIDIA driver version from nvidia-smi, None where it is missing or fails."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else None


def _package_version(name: str) -> Optional[str]:
    """Installed version of `name` without importing it (importing triton fixes its interpreter mode)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    """The CPU model ("model name" in /proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else (platform.processor() or platform.machine())


def environment_fingerprint(device: torch.device | str) -> Fingerprint:
    """{"device", "capability", "threads", "torch", "cuda", "cudnn", "triton", "driver"} for `device`,
    all strings or None (CUDA fields are None on CPU, "threads" None on CUDA). Decisions tuned under
    one fingerprint are reused only under an equal one."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    cudnn = torch.backends.cudnn.version() if cuda else None
    return {
        "device": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "threads": None if cuda else str(torch.get_num_threads()),
        "capability": "%d.%d" % torch.cuda.get_device_capability(device) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": None if cudnn is None else str(cudnn),
        "triton": _package_version("triton"),
        "driver": _nvidia_driver() if cuda else None,
    }


def describe_difference(cached: Fingerprint, current: Fingerprint) -> str:
    """"device: 'A' -> 'B', torch: ..." over the fields that differ ("" when none do)."""
    fields = sorted(set(cached) | set(current))
    return ", ".join(f"{field}: {cached.get(field)!r} -> {current.get(field)!r}" for field in fields
                     if cached.get(field) != current.get(field))
