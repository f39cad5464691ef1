"""Triton compiles in tests: what Triton's binder makes of a launch on an sm_90 GPU (computed
without a GPU), and Python code run in a fresh interpreter with Triton compiling (not interpreting)
into a given cache directory."""
import os
import subprocess
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature


def specialization(kernel, args, meta):
    """(specialization, options) of launching `kernel` (a `triton.jit` function; the interpreter's
    wrapper is unwrapped) with `args` (tensors, or dtypes standing for aligned tensors) and `meta`."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, options = binder(*map(MockTensor.wrap_dtype, args), **meta)
    return spec, options


def run_compiling(code: str, cache_dir, *args: str) -> str:
    """Run `code` in a fresh Python (this one's sys.path, TRITON_INTERPRET unset, TRITON_CACHE_DIR =
    cache_dir) with `args`; asserts it exits 0 and returns its stdout."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
