"""backends/direct/compile_ahead.py: the launches compiled ahead in worker processes are the ones the
launcher makes (same Triton specialization, so the same cache key), on CPU without running a kernel."""
import dataclasses

import pytest
import torch
from helpers.common import needs_cuda, needs_interpreter
from helpers.triton_compiles import run_compiling, specialization

from sparsecnn.backends.direct import compile_ahead
from sparsecnn.backends.direct.format import ChunkedCSRWeight
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_ahead import epilogues

# Padded 3x3 stride 2 (odd sizes: C=5, K=7, H=W=9; the masked "batch" path too) and 1x1 stride 2 unpadded.
SPECS = [ConvSpec(8, 5, 7, 9, 9, 3, 3, 2, 1, name="padded"), ConvSpec(8, 6, 16, 7, 7, 1, 1, 2, 0, name="1x1")]


def _launched(monkeypatch, spec, config, relu, residual, layouts):
    """The launches `direct_conv2d` makes for each (input batch-innermost?, output layout) of `layouts`."""
    from sparsecnn.backends.direct import kernel, kernel_batch

    launches = []
    record = lambda fn, grid, args, **meta: launches.append((fn, args, meta))  # noqa: E731
    monkeypatch.setattr(kernel, "launch", record)
    monkeypatch.setattr(kernel_batch, "launch", record)
    monkeypatch.setattr(kernel, "padded_batch_inner", lambda x, ph, pw, step: torch.empty(
        x.shape[1], x.shape[2] + 2 * ph, x.shape[3] + 2 * pw, x.shape[0]))  # its own pack kernel is not ours here
    weight = torch.randn(spec.K, spec.C, spec.R, spec.S)
    weight[torch.rand_like(weight) < 0.7] = 0
    packed = ChunkedCSRWeight.from_dense(weight, config.chunk)
    for inner, out_layout in layouts:
        x = torch.randn(spec.C, spec.H, spec.W, spec.N).permute(3, 0, 1, 2) if inner else torch.randn(spec.input_shape)
        run = config if config.variant != "batch" else dataclasses.replace(config, out_layout=out_layout)
        kernel.direct_conv2d(x, packed, torch.randn(spec.K), spec.stride, spec.padding, run, relu=relu,
                             residual=torch.randn(spec.output_shape) if residual else None)
    monkeypatch.undo()
    return launches


@needs_interpreter
@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
@pytest.mark.parametrize("relu_only", [True, False])
def test_each_launch_compiled_ahead_specializes_as_the_launcher_does(monkeypatch, spec, relu_only):
    from sparsecnn.backends.direct import kernel

    configs = kernel.auto_configs(spec, torch.float32)
    assert {config.variant for config in configs} == {"chunk", "batch"}
    for config in configs:
        masked = config.variant == "batch" and spec.padding != (0, 0)
        layouts = [(False, "nchw")] + ([(True, "nchw"), (True, "batch_inner")] if masked else [])
        ahead = compile_ahead.ahead_launches(spec, torch.float32, True, config, relu_only)
        launched = []
        for relu, residual in epilogues(relu_only):
            launched += _launched(monkeypatch, spec, config, relu, residual, layouts)
        assert len(ahead) == len(launched) == len(layouts) * len(epilogues(relu_only))
        for (path, args, meta), (fn, call_args, call_meta) in zip(ahead, launched):
            assert path.rpartition(":")[2] == fn.__name__ and meta == call_meta, config
            assert specialization(fn, args, meta) == specialization(fn, call_args, call_meta), config


@needs_interpreter
def test_nothing_is_compiled_ahead_for_a_cpu_weight():
    """Triton's interpreter runs a CPU weight: no job, and bind settles nothing."""
    spec = SPECS[0]
    compile_ahead.prefetch(spec, torch.randn(spec.K, spec.C, 3, 3), torch.float32, True)
    assert not compile_ahead._COMPILES.pool.pending and not compile_ahead._COMPILES._by_layer


_FIRST_CALL_AFTER_WORKERS = """
import sys
import torch
from sparsecnn.backends import get_backend
from sparsecnn.backends.direct import compile_ahead, kernel
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from pathlib import Path
cache = Path(sys.argv[1])
spec = ConvSpec(32, 24, 40, 13, 13, 3, 3, 2, 1)
weight = torch.randn(40, 24, 3, 3, device="cuda")
weight[torch.rand_like(weight) < 0.9] = 0
bias = torch.randn(40, device="cuda")
configs = kernel.auto_configs(spec, torch.float32)
compile_ahead.prefetch(spec, weight, torch.float32, True, configs, relu_only=True)
pool = compile_ahead._COMPILES.pool
for key in list(pool.pending):
    pool.take(key)  # wait for every compile
assert pool.times.jobs >= len(configs), pool.times
before = {path.parent.name for path in cache.rglob("*.cubin")}
backend, x = get_backend("direct"), torch.randn(spec.input_shape, device="cuda")
for config in configs:
    call = backend.bind_for(backend.prepare(weight, config), spec, config, torch.float32, True, True)
    y = call(x, bias, None, True)
    ref = reference_conv(x.cpu(), weight.cpu(), bias.cpu(), stride=2, padding=1, fp64=True).clamp(min=0)
    assert relative_error(y.cpu(), ref) < 1e-5, config
after = {path.parent.name for path in cache.rglob("*.cubin")}
new = {path for path in after - before if "direct" in "".join(p.name for p in (cache / path).iterdir())}
assert not new, new  # every direct kernel the calls ran came from the workers' compiles
print("ok", len(before), "kernels compiled ahead")
"""


@pytest.mark.gpu
@needs_cuda
def test_gpu_first_calls_find_the_kernels_compiled_ahead(tmp_path):
    """In a fresh process with an empty Triton cache: prefetch one layer's auto configs, wait for the
    workers, then bind and call each config: correct, and no direct kernel compiled in-process."""
    assert run_compiling(_FIRST_CALL_AFTER_WORKERS, tmp_path, str(tmp_path)).startswith("ok")
