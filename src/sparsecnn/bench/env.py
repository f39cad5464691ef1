"""What a measurement ran on: device, library versions, driver, code version, date."""
from __future__ import annotations

import datetime
import functools
import platform
import subprocess
import uuid
from pathlib import Path
from typing import Optional

import torch

import sparsecnn.settings as settings


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def new_run_id() -> str:
    """A fresh id for one benchmark invocation, e.g. "20250101T120000Z-3fa2c1"."""
    return f"{_utc_now():%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _command_output(args, cwd: Optional[Path] = None) -> Optional[str]:
    """stdout of `args` stripped, or None if it cannot run, fails, or takes over 10 s."""
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """$SPARSECNN_COMMIT when set (a copied tree's own git data can be stale), else the short commit
    of the git checkout holding this package, else "unknown"."""
    commit = settings.commit()
    if commit:
        return commit
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent)
    return commit or "unknown"


@functools.lru_cache(maxsize=None)
def _driver_version() -> Optional[str]:
    """NVIDIA driver version reported by nvidia-smi (one driver serves every GPU), None without it."""
    out = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device | str) -> dict:
    """The environment fields of a results row for `device`: device, torch, cudnn, triton, driver,
    commit, date (ISO 8601, UTC). cudnn and driver are None off CUDA."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return {
        "device": _device_name(device),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "triton": _triton_version(),
        "driver": _driver_version() if cuda else None,
        "commit": git_commit(),
        "date": _utc_now().isoformat(timespec="seconds"),
    }
