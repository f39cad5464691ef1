"""Backend `blocks` extracting ahead of tuning in worker processes: same decompositions as in-process,
picked up by `prepare` (also through `autotune_model`), and in-process extraction whenever the
workers cannot help. Spawned workers import torch (seconds), so the tests that need real ones share
one pool of two; the failure tests use pools that cannot start or die at once."""
import dataclasses
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from helpers.common import sparse_weight
from torch import nn

from sparsecnn import settings
from sparsecnn.backends import backend_names, get_backend
from sparsecnn.backends.blocks import extraction as block_extraction
from sparsecnn.backends.blocks.format import BlockParams, extract_blocks
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning import POLICIES
from sparsecnn.tuning.select import prefetch_candidates
from sparsecnn.tuning.sparsify import autotune_model

FP32 = POLICIES["fp32"]
SPEC = ConvSpec(1, 32, 64, 3, 3, 3, 3)  # stands in for a (64, 32, 3, 3) weight's layer


@pytest.fixture(scope="module")
def worker_pool():
    """Two real worker processes, shared by this module's tests; no extraction left over."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(settings.BLOCKS_WORKERS.name, "2")
        block_extraction.shutdown_extraction_workers()
        yield
        block_extraction.shutdown_extraction_workers()
        block_extraction.clear_extractions()


@pytest.fixture
def no_extractions():
    block_extraction.clear_extractions()
    yield
    block_extraction.clear_extractions()


def _weight():
    """(64, 32, 3, 3), about 90% sparse: random, plus a denser 16 x 48 region so that blocks exist."""
    weight = sparse_weight((64, 32, 3, 3), 0.93)
    weight.view(64, -1)[:16, :48] = sparse_weight((16, 48), 0.2)
    return weight


def _assert_same(got, expected):
    assert got.kernel_shape == expected.kernel_shape and got.params == expected.params
    assert dataclasses.replace(got.report, seconds=0.0) == dataclasses.replace(expected.report, seconds=0.0)
    assert len(got.blocks) == len(expected.blocks)
    for mine, theirs in zip(got.blocks, expected.blocks):
        assert mine.level == theirs.level
        for field in ("rows", "cols", "values"):
            assert torch.equal(getattr(mine, field), getattr(theirs, field))
    for field in ("row_ptr", "col_idx", "values"):
        assert torch.equal(getattr(got.remainder, field), getattr(expected.remainder, field))


def _in_process_forbidden(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("extract_blocks ran in-process")

    monkeypatch.setattr(block_extraction, "extract_blocks", refuse)


@pytest.mark.slow
def test_prefetched_extractions_equal_in_process_ones_and_are_taken(worker_pool, no_extractions, monkeypatch):
    weight = _weight()
    expected = {t2: extract_blocks(weight, BlockParams(t2=t2)) for t2 in (4, 8)}
    assert all(decomposition.blocks for decomposition in expected.values())
    block_extraction.submit_extractions(weight, [4, 8, 4])
    _in_process_forbidden(monkeypatch)
    for t2 in (4, 8):
        _assert_same(block_extraction.extraction(weight, t2), expected[t2])
    assert not block_extraction._WORKERS.pending  # each taken once, then served from the in-process cache


def test_prefetch_hook_submits_the_t2_values_prepare_uses(worker_pool, no_extractions, monkeypatch):
    weight, backend = _weight().half(), get_backend("blocks")
    default_t2 = backend.configs(SPEC, torch.float16)[0].t2
    expected = extract_blocks(weight, BlockParams(t2=default_t2))
    backend.prefetch(SPEC, weight.double(), torch.float16, True)  # cast to the dtype it will be tuned at
    t2_values = {config.t2 for config in backend.auto_configs(SPEC, torch.float16)}
    assert {key[3] for key in block_extraction._WORKERS.pending} == t2_values == {4, 8}
    assert {config.t2 for config in backend.configs(SPEC, torch.float16)} == {4, 8, 12, 16}  # when named
    _in_process_forbidden(monkeypatch)
    backend.prepare(weight, None)
    assert {key[3] for key in block_extraction._WORKERS.pending} == {4, 8} - {default_t2}
    _assert_same(block_extraction.extraction(weight, default_t2), expected)


def test_auto_tries_only_tf32_blocks_configs_in_fp32(worker_pool, no_extractions):
    """The fp32 policy (no TF32) gets no blocks candidate unasked; the tf32 policy its "tf32" ones."""
    from sparsecnn.tuning.precision import POLICIES
    from sparsecnn.tuning.select import candidates_for, prefetch_candidates

    backend = get_backend("blocks")
    assert {config.precision for config in backend.auto_configs(SPEC, torch.float32)} == {"tf32"}
    assert not any(c.backend == "blocks" for c in candidates_for(SPEC, POLICIES["fp32"], "cuda"))
    assert any(c.backend == "blocks" for c in candidates_for(SPEC, POLICIES["tf32"], "cuda"))
    assert {config.t2 for config in backend.configs(SPEC, torch.float32)} == {4, 8, 12, 16}  # when named
    prefetch_candidates(SPEC, _weight(), POLICIES["fp32"], "cuda", has_bias=True)
    assert not block_extraction._WORKERS.pending


class _NoRunTimer:
    """Times nothing and runs nothing: dense is fastest, so the tuned model runs densely."""

    def probe(self, candidate, fn):
        return 1.0 if candidate.backend == "dense" else 2.0

    measure = probe


def _conv1d_model():
    return nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 16, 3, stride=2))


def _conv2d_model():
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2))


@pytest.mark.parametrize("conv_dims", [1, 2])
@pytest.mark.slow
def test_autotune_model_prepares_blocks_from_prefetched_weights(worker_pool, no_extractions, monkeypatch, tmp_path,
                                                                 conv_dims):
    model = (_conv1d_model() if conv_dims == 1 else _conv2d_model()).eval()
    with torch.no_grad():
        for conv in (model[0], model[2]):
            conv.weight.copy_(sparse_weight(conv.weight.shape, 0.6))
    masks = {"2": torch.rand(model[2].weight.shape) > 0.3}  # leaves negative weights -> -0.0: bytes must match
    x = torch.randn(2, 8, 12) if conv_dims == 1 else torch.randn(2, 8, 12, 12)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # blocks offers CPU only then (nothing here runs a kernel)
    calls = []
    monkeypatch.setattr(block_extraction, "extract_blocks", lambda *args: calls.append(args) or extract_blocks(*args))
    report = autotune_model(model, x, masks=masks, backends=["blocks"], cache_dir=tmp_path, timer=_NoRunTimer(),
                            progress=False)
    assert [layer.backend for layer in report.layers] == ["dense", "dense"]
    assert all(any(label.startswith("blocks[") for label in model[i].timings) for i in (0, 2))
    assert calls == [] and not block_extraction._WORKERS.pending  # every extraction came from a worker


def _failing_workers(monkeypatch, new_pool):
    workers = block_extraction._new_workers(new_pool=new_pool)
    monkeypatch.setattr(block_extraction, "_WORKERS", workers)
    return workers


def test_a_pool_that_cannot_start_means_in_process_extraction(no_extractions, monkeypatch, caplog):
    def cannot_start(count):
        raise OSError("no processes today")

    workers = _failing_workers(monkeypatch, cannot_start)
    weight = _weight()
    with caplog.at_level(logging.WARNING, logger="sparsecnn.backends.blocks.backend"):
        block_extraction.submit_extractions(weight, [4])
    assert workers.failed and not workers.pending and "no processes today" in caplog.text
    _assert_same(block_extraction.extraction(weight, 4), extract_blocks(weight, BlockParams(t2=4)))


def test_workers_that_die_mean_in_process_extraction(no_extractions, monkeypatch, caplog):
    spawn = multiprocessing.get_context("spawn")
    workers = _failing_workers(monkeypatch, lambda count: ProcessPoolExecutor(
        1, mp_context=spawn, initializer=os._exit, initargs=(1,)))
    weight = _weight()
    block_extraction.submit_extractions(weight, [8])
    assert workers.pending
    with caplog.at_level(logging.WARNING, logger="sparsecnn.backends.blocks.backend"):
        got = block_extraction.extraction(weight, 8)
    _assert_same(got, extract_blocks(weight, BlockParams(t2=8)))
    assert "BrokenProcessPool" in caplog.text and workers.failed and workers.pool is None
    block_extraction.submit_extractions(weight, [4])  # no new pool after a failure
    assert workers.pool is None and not workers.pending


def test_backends_without_prefetch_and_ineligible_backends_submit_nothing(monkeypatch):
    prefetching = [name for name in backend_names() if get_backend(name).prefetch is not None]
    assert prefetching == ["codegen", "direct", "blocks", "staged", "unrolled", "tensorcore"]
    asked = []
    workers = _failing_workers(monkeypatch, lambda count: asked.append(count) or ProcessPoolExecutor(0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(settings.BLOCKS_WORKERS.name, "3")
    weight = _weight()
    prefetch_candidates(SPEC, weight, FP32, "cpu", ["direct", "im2col-cublas"], has_bias=True)
    prefetch_candidates(SPEC, weight, FP32, "cpu", has_bias=True)  # blocks is tuned on CPU only when named
    prefetch_candidates(dataclasses.replace(SPEC, C=64, groups=2), weight, FP32, "cpu", ["blocks"], has_bias=True)
    assert asked == [] and workers.pool is None
    prefetch_candidates(SPEC, weight, FP32, "cpu", ["blocks"], has_bias=True)
    assert asked == [3] and workers.failed  # ProcessPoolExecutor(0) refuses: asked, then in-process


class _NoWorkers:
    def submit(self, *args):
        raise AssertionError("an extraction was submitted")

    take = submit

    def forget(self):
        pass


def test_found_blocks_are_kept_on_disk_by_pattern_and_give_the_new_weights_values(no_extractions, monkeypatch):
    weight = _weight()
    first = block_extraction.extraction(weight, 8)
    (kept,) = block_extraction.disk_cache_dir().glob("*.npz")
    block_extraction.clear_extractions()
    _in_process_forbidden(monkeypatch)
    monkeypatch.setattr(block_extraction, "_WORKERS", _NoWorkers())  # neither submitted nor taken
    retrained = torch.where(weight != 0, torch.randn_like(weight), torch.zeros_like(weight))
    block_extraction.submit_extractions(retrained, [8])
    again = block_extraction.extraction(retrained, 8)
    assert len(again.blocks) == len(first.blocks) > 0 and again.report.partitioner == first.report.partitioner
    for mine, theirs in zip(again.blocks, first.blocks):
        assert torch.equal(mine.rows, theirs.rows) and torch.equal(mine.cols, theirs.cols)
        assert mine.level == theirs.level
        assert torch.equal(mine.values != 0, theirs.values != 0)
    assert torch.equal(again.to_dense(), retrained)
    assert list(block_extraction.disk_cache_dir().glob("*.npz")) == [kept]


def test_each_t2_and_pattern_has_its_own_file_and_a_damaged_one_is_extracted_again(no_extractions, caplog):
    weight = _weight()
    block_extraction.extraction(weight, 8)
    block_extraction.extraction(weight, 4)
    other = weight.clone()
    other.view(64, -1)[0, :] = 0  # another pattern
    block_extraction.extraction(other, 8)
    files = sorted(block_extraction.disk_cache_dir().glob("*.npz"))
    assert len(files) == 3
    block_extraction.clear_extractions()
    path = block_extraction._disk_path(weight, 8)
    path.write_bytes(b"not an npz")
    expected = extract_blocks(weight, BlockParams(t2=8))
    with caplog.at_level(logging.WARNING):
        _assert_same(block_extraction.extraction(weight, 8), expected)
    assert "unreadable blocks cache file" in caplog.text
    block_extraction.clear_extractions()
    assert block_extraction._from_disk(weight, 8) is not None  # rewritten
