"""Backend `staged`: its kernels (CUDA C per geometry and config, nvcc + ptxas) compiled ahead of
tuning in worker processes, into the disk cache where the first call finds them, and the job taken
by `bind`. Pools here run jobs inline or hold them running (`helpers.pools`); no GPU is needed."""
import logging

import pytest
import torch
from helpers.codegen import needs_tools
from helpers.pools import HeldPool, InlinePool

from sparsecnn import settings
from sparsecnn.backends import get_backend
from sparsecnn.backends.staged import backend as staged_backend
from sparsecnn.backends.staged import kernel as staged
from sparsecnn.core import toolchain
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.workers import WorkerPool, job_times, reset_job_times

SPEC = ConvSpec(32, 16, 64, 28, 28, 3, 3, 1, 1)
SAME_GEOMETRY = ConvSpec(32, 64, 128, 14, 14, 3, 3, 1, 1)  # another layer of 3x3 kernels at stride 1


def _workers(monkeypatch, pool):
    workers = WorkerPool("staged compile", settings.compile_workers, logging.getLogger("test"),
                         new_pool=lambda count: pool)
    monkeypatch.setattr(staged_backend, "_WORKERS", workers)
    monkeypatch.setenv(settings.COMPILE_WORKERS.name, "2")
    return workers


@pytest.fixture
def compiles(monkeypatch):
    """Each compile the workers run, as (geometry, config, arch), none of them real."""
    seen = []
    monkeypatch.setattr(staged, "compile_into_cache", lambda spec, config, arch: seen.append(
        (staged.geometry(spec), config, arch)))
    return seen


def test_prefetch_compiles_each_geometry_and_config_once_and_bind_takes_it(monkeypatch, compiles):
    pool = InlinePool()
    workers = _workers(monkeypatch, pool)
    backend = get_backend("staged")
    configs = staged.auto_configs(SPEC)
    weight = torch.randn(64, 16, 3, 3)
    backend.prefetch(SPEC, weight, torch.float32, True)
    backend.prefetch(SAME_GEOMETRY, torch.randn(128, 64, 3, 3), torch.float32, True, configs)
    assert len(configs) >= 2 and pool.jobs == len(configs) == len(compiles)  # the second layer shares them
    assert {config for _, config, _ in compiles} == set(configs)
    assert all(geometry == staged.geometry(SPEC) and arch == staged.target_arch() for geometry, _, arch in compiles)
    reset_job_times()
    backend.bind(backend.prepare(weight, configs[0]), SPEC, configs[0], torch.float32, True)
    assert len(workers.pending) == len(configs) - 1 and job_times()["staged compile"].jobs == 1


def test_nothing_is_prefetched_where_staged_does_not_run(monkeypatch, compiles):
    pool = InlinePool()
    _workers(monkeypatch, pool)
    backend = get_backend("staged")
    backend.prefetch(SPEC, torch.randn(64, 16, 3, 3).half(), torch.float16, True)  # fp32 only
    backend.prefetch(ConvSpec(8, 16, 64, 28, 28, 3, 3, 1, 1), torch.randn(64, 16, 3, 3), torch.float32, True)  # N % 32
    assert pool.jobs == 0 and compiles == []


def test_pending_while_a_prefetched_compile_runs(monkeypatch, compiles):
    pool = HeldPool()
    _workers(monkeypatch, pool)
    backend = get_backend("staged")
    weight = torch.randn(64, 16, 3, 3)
    config = staged.auto_configs(SPEC)[0]
    assert not backend.pending(SPEC, weight, torch.float32, True, config)  # nothing submitted
    backend.prefetch(SPEC, weight, torch.float32, True, [config])
    assert backend.pending(SPEC, weight, torch.float32, True, config)
    assert backend.pending(SAME_GEOMETRY, weight, torch.float32, True, config)  # the same kernel
    assert not backend.pending(ConvSpec(32, 16, 64, 28, 28, 1, 1, 1, 0), weight, torch.float32, True, config)
    pool.finish()
    assert not backend.pending(SPEC, weight, torch.float32, True, config)


@needs_tools
def test_a_compile_ahead_leaves_the_cubin_the_first_call_takes(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.CACHE.name, str(tmp_path))
    config = staged.auto_configs(SPEC)[0]
    arch = staged.target_arch()
    staged.compile_into_cache(SPEC, config, arch)
    compiled = staged.cubin(staged.geometry(SPEC), config, arch)

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again although the cubin was in the disk cache")

    monkeypatch.setattr(toolchain, "nvcc_ptx", no_compiling)
    assert staged.cubin(staged.geometry(SPEC), config, arch) == compiled and compiled[:4] == b"\x7fELF"
