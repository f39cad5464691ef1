"""What every test file may use: the interpreter and GPU markers, what a test needs from the machine
(`require`, `needs`: skipped locally, failed in CI), sparse weights that are never all zero, a fresh
interpreter with sparsecnn importable, and model-level tolerances from the dense model's own error."""
import copy
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
GPU_SKIP = "needs a CUDA GPU"  # how every GPU-only skip reason starts (conftest counts them apart)

# Triton reads TRITON_INTERPRET when first imported: CPU runs of its kernels need it set beforehand.
INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="CPU runs of the Triton kernel need TRITON_INTERPRET=1 in the environment "
                          "before triton is imported (the GPU variants of these tests run without it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason=f"{GPU_SKIP} and TRITON_INTERPRET unset")

# --- what a test needs from the machine ---------------------------------------------------------------
# CI (CI=true, as the CI host sets it and .ci/run does when unset) must have every tool, package and
# data set below that it is meant to have: a test that needs one fails there instead of skipping.
# Locally a missing one skips the test, as before. GPU-only skips (`gpu` marker, `needs_cuda`) stay
# skips everywhere; conftest counts the skips by kind in the summary, and in CI fails the run on any
# skip that is neither GPU-only nor of an OPTIONAL requirement.
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _cuda_tool(name: str) -> bool:
    from sparsecnn.core import toolchain

    return toolchain.find_tool(name) is not None


def _sputnik() -> bool:
    from sparsecnn import settings

    path = settings.sputnik_lib()
    return path is not None and path.is_file()


def _dlmc() -> bool:
    from sparsecnn.prune.dlmc import dlmc_root

    try:
        dlmc_root()
    except FileNotFoundError:
        return False
    return True


# name -> (check, what to do when it is missing)
REQUIREMENTS = {
    "g++": (lambda: shutil.which("g++") is not None,
            "needs g++ (C++20) to run generated kernels on the CPU: install the system's g++"),
    "nvcc": (lambda: _cuda_tool("nvcc"),
             "needs nvcc (looked at $SPARSECNN_NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /usr/local/bin "
             "and NVIDIA's pip wheel): `make test` installs requirements-cuda-tools.txt where none is found"),
    "ptxas": (lambda: _cuda_tool("ptxas"), "needs ptxas (looked where nvcc is looked for)"),
    "safetensors": (lambda: _module("safetensors"), "needs the safetensors package (requirements-ci.txt)"),
    "triton": (lambda: _module("triton"), "needs the triton package (requirements-ci.txt)"),
    "dlmc": (_dlmc, "needs the DLMC ResNet-50 masks: $SPARSECNN_DLMC, or shared/data/dlmc-rn50 in or above "
                    "the checkout"),
    # Optional, skipped everywhere and counted apart in the summary: extras CI does not install
    # (mtkahypar: with it, the "auto" partitioner turns slow), and the DLMC masks, shared data that
    # is never committed, so a clone holds them only where ../shared happens to sit beside it.
    "mtkahypar": (lambda: _module("mtkahypar"), "needs the optional mtkahypar package (`pip install mtkahypar`)"),
    # A peer system built outside the repository (benchmarks/peers), never part of CI.
    "sputnik": (_sputnik, "needs Sputnik's SpMM library: build it with benchmarks/peers/build_sputnik.sh and set "
                          "SPARSECNN_SPUTNIK_LIB to the libsputnik_spmm.so it prints"),
}
OPTIONAL = frozenset({"mtkahypar", "dlmc", "sputnik"})
OPTIONAL_PREFIX = "optional: "  # how the skip reason of an OPTIONAL requirement starts


@functools.lru_cache(maxsize=None)
def available(name: str) -> bool:
    """Whether the machine has requirement `name` (a key of REQUIREMENTS)."""
    return bool(REQUIREMENTS[name][0]())


def missing(*names: str):
    """None if the machine has each of `names` (keys of REQUIREMENTS), else ("skip", reason) or, in
    CI for a requirement that is not OPTIONAL, ("fail", reason), for the first one missing."""
    for name in names:
        if available(name):
            continue
        message = REQUIREMENTS[name][1]
        if name in OPTIONAL:
            return "skip", OPTIONAL_PREFIX + message
        if IN_CI:
            return "fail", f"CI=true and {name} is missing: {message}"
        return "skip", message
    return None


def require(*names: str) -> None:
    """Call in a test or fixture: go on if the machine has each of `names` (keys of REQUIREMENTS),
    else skip the test, or fail it in CI unless the requirement is OPTIONAL."""
    verdict = missing(*names)
    if verdict is not None and verdict[0] == "fail":
        pytest.fail(verdict[1], pytrace=False)
    if verdict is not None:
        pytest.skip(verdict[1])


def needs(*names: str):
    """Decorator form of `require` (conftest skips such a test at collection, after the `gpu`
    marker's skip, or in CI fails it when it is set up)."""
    return pytest.mark.requires(*names)


def run_python(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with sparsecnn importable (for checks on what a process imports)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s)


def sparse_weight(shape, sparsity: float, generator=None) -> torch.Tensor:
    """Normal weights with a uniform random `sparsity` fraction set to exactly zero."""
    weight = torch.randn(shape, generator=generator)
    keep = torch.rand(shape, generator=generator) >= sparsity
    return weight * keep


# --- model-level tolerances -----------------------------------------------------------------------------
def dense_reference(model: torch.nn.Module, x: torch.Tensor, dtype, factor: float = 2.0):
    """(fp64 output, tolerance) for a model about to be sparsified in `dtype` (torch.float16,
    torch.bfloat16, or "tf32"): the output of a copy of the dense masked `model` in float64, and
    `factor` times the relative error against it of the same dense model run in `dtype` by PyTorch
    (TF32: fp32 with cuDNN's and cuBLAS's TF32 allowed). A sparsified model whose error passes the
    tolerance is as close to the exact answer as the dense model in that precision, give or take 2x;
    a wrong structure (a missing residual add, a lost ReLU) is far outside it."""
    from sparsecnn.core.reference import relative_error

    run_dtype = torch.float32 if dtype == "tf32" else dtype
    tf32 = dtype == "tf32"
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
                out = copy.deepcopy(model).to(run_dtype)(x.to(run_dtype))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    error = relative_error(out, ref)
    assert 0 < error < 0.1, f"the dense model's own error in {dtype} is {error:.2e}: no tolerance to derive"
    return ref, factor * error

