"""What every test file may use: the interpreter and GPU markers, sparse weights that are never all
zero, and a fresh interpreter with sparsecnn importable."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")

# Triton reads TRITON_INTERPRET when first imported: CPU runs of its kernels need it set beforehand.
INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="CPU runs of the Triton kernel need TRITON_INTERPRET=1 in the environment "
                          "before triton is imported (the GPU variants of these tests run without it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA GPU and TRITON_INTERPRET unset")


def run_python(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with sparsecnn importable (for checks on what a process imports)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s)


def sparse_weight(shape, sparsity: float, generator=None) -> torch.Tensor:
    """Normal weights with a uniform random `sparsity` fraction set to exactly zero."""
    weight = torch.randn(shape, generator=generator)
    keep = torch.rand(shape, generator=generator) >= sparsity
    return weight * keep
