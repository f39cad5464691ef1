"""Backend `codegen` in `backend="auto"`: only its default config, in emit mode, compiled ahead of
tuning in worker processes at the input shape each layer will see, and taken by `bind` instead of compiling again;
compiled in-process whenever a worker cannot help. Pools here run jobs inline (spawned workers
import torch: seconds), except where a real process pool is the point."""
import dataclasses
import logging

import pytest
import torch
from helpers.codegen import needs_tools, sparse
from helpers.pools import HeldPool, InlinePool
from torch import nn

from sparsecnn import settings
from sparsecnn.backends import get_backend
from sparsecnn.backends.codegen import backend as codegen_backend
from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.workers import job_times, reset_job_times
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.tuning import POLICIES
from sparsecnn.tuning import sparsify as sparsify_module
from sparsecnn.tuning.select import candidates_for
from sparsecnn.tuning.sparsify import autotune_model

FP32 = POLICIES["fp32"]
SPEC = ConvSpec(2, 5, 12, 9, 11, 3, 3, 1, 1)
pytestmark = pytest.mark.usefixtures("generated_backends_ready")   # what is offered, not this machine


@pytest.fixture
def inline_workers(monkeypatch):
    pool = InlinePool()
    workers = codegen_backend._new_workers(new_pool=lambda count: pool)
    monkeypatch.setattr(codegen_backend, "_WORKERS", workers)
    monkeypatch.setenv(settings.COMPILE_WORKERS.name, "2")
    return workers, pool


def _labels(candidates, backend="codegen"):
    return [c.config for c in candidates if c.backend == backend]


def test_auto_offers_the_default_config_in_emit_mode_on_cuda_and_every_config_when_named():
    every = codegen.candidate_configs(SPEC, torch.float32)
    assert len(every) >= 3 and every[0] == codegen.default_config(SPEC) and every[0].mode == "rewrite"
    emit = dataclasses.replace(every[0], mode="emit")
    assert _labels(candidates_for(SPEC, FP32, "cuda")) == [emit] and emit in every
    assert _labels(candidates_for(SPEC, FP32, "cuda", ["codegen"])) == every
    assert _labels(candidates_for(SPEC, FP32, "cpu")) == []  # CUDA only
    too_big = ConvSpec(1, 1024, 2048, 7, 7, 1, 1)  # 2M weights to unroll: over the cap
    assert _labels(candidates_for(too_big, FP32, "cuda")) == []


def test_auto_leaves_out_strided_1x1_layers():
    shortcut = ConvSpec(32, 128, 256, 16, 16, 1, 1, 2, 0)
    assert codegen.make_plan(shortcut, codegen.candidate_configs(shortcut)[0]).n_slices <= codegen_backend.MAX_AUTO_SLICES
    assert _labels(candidates_for(shortcut, FP32, "cuda")) == []
    assert _labels(candidates_for(shortcut, FP32, "cuda", ["codegen"]))  # named: still offered


def test_auto_leaves_out_layers_of_many_slices(inline_workers):
    workers, pool = inline_workers
    many = ConvSpec(32, 256, 256, 14, 14, 3, 3, 1, 1)  # ResNet-50's layer3 3x3
    default = codegen.candidate_configs(many)[0]
    assert codegen.make_plan(many, default).n_slices > codegen_backend.MAX_AUTO_SLICES
    assert _labels(candidates_for(many, FP32, "cuda")) == []
    assert _labels(candidates_for(many, FP32, "cuda", ["codegen"]))[0] == default  # named: still offered
    get_backend("codegen").prefetch(many, torch.randn(many.weight_shape), torch.float32, True)
    assert pool.jobs == 0


def _weight():
    return torch.from_numpy(sparse(SPEC.weight_shape, 0.8))


def _auto(dtype=torch.float32):
    """The config `backend="auto"` compiles for SPEC, which `prefetch` compiles ahead."""
    return get_backend("codegen").auto_configs(SPEC, dtype)[0]


@needs_tools
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bind_takes_the_prefetched_compile(inline_workers, monkeypatch, dtype):
    workers, pool = inline_workers
    backend = get_backend("codegen")
    weight = _weight().to(dtype)
    backend.prefetch(SPEC, weight, dtype, True)
    backend.prefetch(SPEC, weight, dtype, True)  # pending already: not submitted twice
    assert pool.jobs == 1 and len(workers.pending) == 1
    config = _auto(dtype)
    expected = codegen.compile_conv(weight, SPEC, config, has_bias=True, dtype=dtype)

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled in-process although a worker had compiled it")

    monkeypatch.setattr(codegen, "compile_conv", no_compiling)
    reset_job_times()
    call = backend.bind(backend.prepare(weight, None), SPEC, config, dtype, True)
    assert not workers.pending
    assert call.keepalive.cubins == expected.cubins and call.keepalive.plan == expected.plan
    times = job_times()["codegen compile"]
    assert times.jobs == 1 and times.ran_s > 0 and times.max_ran_s == times.ran_s and times.waited_s >= 0


@needs_tools
def test_a_different_weight_shape_or_bias_is_compiled_in_process(inline_workers):
    workers, pool = inline_workers
    backend = get_backend("codegen")
    weight = _weight()
    backend.prefetch(SPEC, weight, torch.float32, True)
    other = weight.clone()
    other[0, 0, 0, 0] += 1.0
    packed = backend.prepare(other, None)
    compiled = packed.compiled(SPEC, _auto(), True, torch.float32)
    assert len(workers.pending) == 1  # the prefetched one is still owed: a different weight
    assert compiled.cubins == codegen.compile_conv(other, SPEC, _auto(), has_bias=True).cubins
    backend.prepare(weight, None).compiled(SPEC, _auto(), False, torch.float32)  # no bias: another kernel
    assert len(workers.pending) == 1


@needs_tools
def test_a_failed_worker_compile_means_compiling_in_process(inline_workers, monkeypatch, caplog):
    workers, pool = inline_workers
    monkeypatch.setattr(codegen_backend, "_compile_in_worker", lambda *args: 1 / 0)
    backend = get_backend("codegen")
    weight = _weight()
    backend.prefetch(SPEC, weight, torch.float32, True)
    with caplog.at_level(logging.WARNING, logger="sparsecnn.backends.codegen.backend"):
        compiled = backend.prepare(weight, None).compiled(SPEC, _auto(), True, torch.float32)
    assert "ZeroDivisionError" in caplog.text and not workers.pending
    assert compiled.cubins == codegen.compile_conv(weight, SPEC, _auto(), has_bias=True).cubins


def test_unsupported_layers_are_not_prefetched(inline_workers):
    workers, pool = inline_workers
    grouped = ConvSpec(1, 4, 4, 8, 8, 3, 3, groups=2)
    get_backend("codegen").prefetch(grouped, torch.randn(4, 2, 3, 3), torch.float32, True)
    assert pool.jobs == 0


@needs_tools
@pytest.mark.slow
def test_a_real_worker_process_compiles_the_same_kernels(monkeypatch):
    workers = codegen_backend._new_workers()
    monkeypatch.setattr(codegen_backend, "_WORKERS", workers)
    monkeypatch.setenv(settings.COMPILE_WORKERS.name, "1")
    backend = get_backend("codegen")
    weight = _weight()
    try:
        backend.prefetch(SPEC, weight, torch.float32, True)
        assert workers.pool is not None and len(workers.pending) == 1
        compiled = backend.prepare(weight, None).compiled(SPEC, _auto(), True, torch.float32)
    finally:
        workers.shutdown()
    assert not workers.pending
    assert compiled.cubins == codegen.compile_conv(weight, SPEC, _auto(), has_bias=True).cubins


class _DenseTimer:
    def probe(self, candidate, fn):
        return 1.0 if candidate.backend == "dense" else 2.0

    measure = probe


@pytest.mark.parametrize("conv_dims", [1, 2])
def test_autotune_model_prefetches_at_each_layers_input_shape(monkeypatch, tmp_path, conv_dims):
    if conv_dims == 1:
        model = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 4, 3, stride=2, bias=False))
        x = torch.randn(2, 3, 13)
        expected = [(2, 3, 8, 1, 13, 1, 3, (1, 1), (0, 1), True, True), (2, 8, 4, 1, 13, 1, 3, (1, 2), (0, 0), False, False)]
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2, bias=False))
        x = torch.randn(2, 3, 13, 11)
        expected = [(2, 3, 8, 13, 11, 3, 3, (1, 1), (1, 1), True, True), (2, 8, 4, 13, 11, 3, 3, (2, 2), (0, 0), False, False)]
    seen = []

    def record(spec, weight, policy, device_type, backends=None, *, has_bias, relu_only, candidates):
        seen.append((spec.N, spec.C, spec.K, spec.H, spec.W, spec.R, spec.S, spec.stride, spec.padding, has_bias,
                     relu_only))
        assert weight.shape == (spec.K, spec.C, spec.R, spec.S)

    monkeypatch.setattr(sparsify_module, "prefetch_candidates", record)
    fused = prepare_for_inference(model.eval(), example_inputs=x)  # the first conv takes the ReLU
    autotune_model(fused, x, cache_dir=tmp_path, timer=_DenseTimer(), progress=False)
    assert seen == expected


def test_layers_the_inputs_never_reach_are_not_prefetched(monkeypatch, tmp_path):
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.used(x)

    seen = []
    monkeypatch.setattr(sparsify_module, "prefetch_candidates", lambda spec, *args, **kwargs: seen.append(spec))
    autotune_model(Skips().eval(), torch.randn(1, 3, 8, 8), cache_dir=tmp_path, timer=_DenseTimer(), progress=False)
    assert [(spec.H, spec.W) for spec in seen] == [(8, 8)]


def test_pending_while_a_prefetched_compile_runs(monkeypatch):
    pool = HeldPool()
    monkeypatch.setattr(codegen_backend, "_WORKERS", codegen_backend._new_workers(new_pool=lambda count: pool))
    monkeypatch.setenv(settings.COMPILE_WORKERS.name, "2")
    backend = get_backend("codegen")
    weight = _weight()
    config = backend.auto_configs(SPEC, torch.float32)[0]
    assert not backend.pending(SPEC, weight, torch.float32, True, config, False)  # nothing submitted
    backend.prefetch(SPEC, weight, torch.float32, True, [config], False)
    assert pool.jobs == 1
    assert backend.pending(SPEC, weight, torch.float32, True, config, False)
    assert not backend.pending(SPEC, weight, torch.float32, True, config, True)  # another compile: the ReLU in
    assert not backend.pending(SPEC, weight * 2, torch.float32, True, config, False)
    pool.finish()
    assert not backend.pending(SPEC, weight, torch.float32, True, config, False)
