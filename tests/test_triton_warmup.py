"""Triton kernels compiled ahead of tuning in worker processes (backends/triton_warmup.py)."""
from concurrent.futures import Future

import pytest
import torch

from conftest import sparse_weight
from sparsecnn.backends import direct as direct_backend
from sparsecnn.backends import get_backend, triton_warmup
from sparsecnn.layers import ConvSpec

SPEC = ConvSpec(2, 5, 12, 9, 11, 3, 3, 1, 1)


class _RecordingPool:
    """Keeps each submitted job without running it."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append(args)
        return Future()

    def shutdown(self, wait=True, cancel_futures=False):
        pass


@pytest.fixture
def pool(monkeypatch):
    recording = _RecordingPool()
    monkeypatch.setattr(triton_warmup, "_WORKERS",
                        triton_warmup.WorkerPool("triton compile", triton_warmup.WORKERS_ENV_VAR, triton_warmup._LOG,
                                                 new_pool=lambda count: recording))
    monkeypatch.setenv(triton_warmup.WORKERS_ENV_VAR, "2")
    return recording


def test_direct_prefetch_submits_one_warmup_per_auto_config(pool, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(direct_backend, "interpreting", lambda: False)
    weight = sparse_weight((12, 5, 3, 3), 0.8)
    get_backend("direct").prefetch(SPEC, weight, torch.float16, True, relu=True, residual=True)
    get_backend("direct").prefetch(SPEC, weight, torch.float16, True, relu=True, residual=True)  # pending: not again
    configs = direct_backend._kernels().auto_configs(SPEC, torch.float16)
    assert [job[4] for job in pool.jobs] == configs  # (fn, backend, spec, weight, config, dtype, bias, relu, residual)
    for fn, name, spec, sent, config, dtype, has_bias, relu, residual in pool.jobs:
        assert (name, spec, dtype, has_bias, relu, residual) == ("direct", SPEC, torch.float16, True, True, True)
        assert sent.device.type == "cpu" and sent.dtype == torch.float16 and torch.equal(sent, weight.half())
    triton_warmup.cancel_warmups()
    assert not triton_warmup._WORKERS.pending


def test_no_warmups_under_the_interpreter(pool, monkeypatch):
    monkeypatch.setattr(direct_backend, "interpreting", lambda: True)
    get_backend("direct").prefetch(SPEC, sparse_weight((12, 5, 3, 3), 0.8), torch.float32, True)
    assert pool.jobs == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("relu, residual", [(False, False), (True, True)])
def test_gpu_warmup_runs_every_auto_config(relu, residual):
    weight = sparse_weight((12, 5, 3, 3), 0.8)
    for config in direct_backend._kernels().auto_configs(SPEC, torch.float32):
        triton_warmup._warm_in_worker("direct", SPEC, weight, config, torch.float32, True, relu, residual)
