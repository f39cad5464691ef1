"""The autotuner: cache keys, persistence, early exit, damaged caches, concurrent writers, precision
policies, the summary, and sparsify_ on models that are already sparse. Timings are fake (an
injected timer), so nothing here measures anything."""
import copy
import dataclasses
import json
import logging
import math
import multiprocessing
import threading
import time

import pytest
import torch
from helpers.common import dense_reference, sparse_weight
from torch import nn

from sparsecnn import SparseConv2d, sparsify_
from sparsecnn.backends import get_backend
from sparsecnn.core import registry
from sparsecnn.core.reference import relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.workers import WorkerPool
from sparsecnn.tuning import (
    POLICIES,
    Candidate,
    LayerResult,
    PhaseClock,
    TuneCache,
    TuneReport,
    candidates_for,
    layer_key,
    pick_fastest,
    tune_layer,
)
from sparsecnn.tuning.cache import CachedDecision
from sparsecnn.tuning.precision import uses_tf32
from sparsecnn.tuning.select import SLOWER_MARGIN, EagerTimer, pending_candidates
from sparsecnn.tuning.timing import CHECK_REPS, benchmark
from sparsecnn.tuning import sparsify as sparsify_module
from sparsecnn.tuning import whole_model
from sparsecnn.tuning.precision import resolve_policy
from sparsecnn.tuning.sparsify import autotune_model
from sparsecnn.tuning.timing import eager_wall_ms
from sparsecnn.tuning.tuner import finish_deferred

FP32 = POLICIES["fp32"]
ENV_A = {"device": "GPU A", "torch": "1.0", "triton": "3.0", "driver": "580"}
ENV_B = {**ENV_A, "device": "GPU B"}
CPU_CANDIDATES = [Candidate("dense"), Candidate("im2col-cublas"), Candidate("im2col-cusparse")]


class FakeTimer:
    """Scripted timings per backend name: probe (one run) and measure (full benchmark) in ms.

    Each call runs the candidate once (so its kernel really works); a backend in `failing` raises."""

    def __init__(self, probe_ms=None, measure_ms=None, failing=()):
        self.probe_ms, self.measure_ms, self.failing = probe_ms or {}, measure_ms or {}, set(failing)
        self.probed, self.measured = [], []

    def probe(self, candidate, fn):
        self.probed.append(candidate.backend)
        if candidate.backend in self.failing:
            raise RuntimeError("this GPU refuses the config")
        fn()
        return self.probe_ms.get(candidate.backend, 1.0)

    def measure(self, candidate, fn):
        """The scripted ms; the model as given is slow unless scripted ("model:given")."""
        self.measured.append(candidate.backend)
        fn()
        default = 100.0 if candidate.backend == "model:given" else 1.0
        return self.measure_ms.get(candidate.backend, self.probe_ms.get(candidate.backend, default))


def _layer(c=8, k=16, size=9, sparsity=0.8, batch=2):
    weight = sparse_weight((k, c, 3, 3), sparsity)
    spec = ConvSpec(batch, c, k, size, size, 3, 3, 1, 1)
    return torch.randn(batch, c, size, size), weight, torch.randn(k), spec


def _tune(cache, timer, layer=None, candidates=CPU_CANDIDATES, **kwargs):
    x, weight, bias, spec = layer or _layer()
    return tune_layer("conv", x, weight, bias, spec, FP32, candidates, timer, cache, **kwargs)


def _model():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1))
    with torch.no_grad():
        for conv in (model[0], model[2]):
            conv.weight.copy_(sparse_weight(conv.weight.shape, 0.8))
    return model.eval()


def test_cache_key_changes_with_each_component_but_not_with_weight_values():
    x, weight, bias, spec = _layer()
    saved = [c.saved() for c in CPU_CANDIDATES]
    base = layer_key(spec, "fp32", weight, True, "none", False, saved)
    fewer_zeros = weight.clone()
    fewer_zeros[weight == 0] = 1.0
    variants = [
        layer_key(spec.with_batch(3), "fp32", weight, True, "none", False, saved),
        layer_key(ConvSpec(2, 8, 16, 9, 9, 3, 3, 2, 1), "fp32", weight, True, "none", False, saved),
        layer_key(spec, "tf32", weight, True, "none", False, saved),
        layer_key(spec, "fp32", fewer_zeros, True, "none", False, saved),
        layer_key(spec, "fp32", weight, False, "none", False, saved),
        layer_key(spec, "fp32", weight, True, "relu", False, saved),
        layer_key(spec, "fp32", weight, True, "none", True, saved),
        layer_key(spec, "fp32", weight, True, "none", False, saved[:2]),
        layer_key(spec, "fp32", weight, True, "none", False, saved, "eager"),
    ]
    assert all(variant != base for variant in variants)
    assert len({json.dumps(v, sort_keys=True) for v in variants}) == len(variants)
    assert layer_key(spec, "fp32", weight * 3, True, "none", False, saved) == base  # pattern, not values
    assert TuneCache("/tmp/x", ENV_A).path(base) != TuneCache("/tmp/x", ENV_B).path(base)
    assert TuneCache("/tmp/x", ENV_A).path(base) != TuneCache("/tmp/x", ENV_A).path(variants[0])


def test_decision_is_persisted_and_reused_without_timing(tmp_path):
    layer = _layer()
    first = _tune(TuneCache(tmp_path, ENV_A), FakeTimer(measure_ms={"im2col-cublas": 0.5}), layer)
    assert first.cache == "tuned" and first.backend == "im2col-cublas"
    timer = FakeTimer()
    again = _tune(TuneCache(tmp_path, ENV_A), timer, layer)
    assert timer.probed == [] and timer.measured == []
    assert again.cache == "hit" and again.choice == first.choice
    assert again.time_ms == 0.5 and again.dense_ms == 1.0 and again.times_ms == first.times_ms
    forced = _tune(TuneCache(tmp_path, ENV_A), FakeTimer(), layer, retune=True)
    assert forced.cache == "tuned" and forced.backend == "dense"


def test_deferred_candidates_are_timed_later_and_stored_under_the_full_key(tmp_path):
    layer = _layer()
    x, weight, bias, spec = layer
    cusparse = Candidate("im2col-cusparse")
    timer = FakeTimer(measure_ms={"im2col-cublas": 0.5, "im2col-cusparse": 0.2})
    first = _tune(TuneCache(tmp_path, ENV_A), timer, layer, deferred=[cusparse])
    assert "im2col-cusparse" not in timer.probed and first.backend == "im2col-cublas"
    assert first.deferred == (cusparse,)
    key = layer_key(spec, "fp32", weight, True, "none", False, [c.saved() for c in CPU_CANDIDATES])
    assert TuneCache(tmp_path, ENV_A).lookup(key)[0] is None  # nothing stored before the deferred run
    timer.probed.clear()
    final = finish_deferred(first, x, weight, bias, spec, FP32, CPU_CANDIDATES, timer, TuneCache(tmp_path, ENV_A))
    assert sorted(timer.probed) == ["dense", "im2col-cublas", "im2col-cusparse"]  # the choice re-timed beside it
    assert final.backend == "im2col-cusparse" and final.deferred == () and final.time_ms == 0.2
    assert set(final.times_ms) == {"dense", "im2col-cublas", "im2col-cusparse"}
    again_timer = FakeTimer()
    again = _tune(TuneCache(tmp_path, ENV_A), again_timer, layer, deferred=[cusparse])
    assert again.cache == "hit" and again.backend == "im2col-cusparse" and again.deferred == ()
    assert again_timer.probed == []
    assert finish_deferred(again, x, weight, bias, spec, FP32, CPU_CANDIDATES, again_timer) is again


def test_deferred_candidate_that_loses_leaves_the_choice(tmp_path):
    x, weight, bias, spec = layer = _layer()
    timer = FakeTimer(measure_ms={"im2col-cublas": 0.5, "im2col-cusparse": 0.9})
    first = _tune(TuneCache(tmp_path, ENV_A), timer, layer, deferred=[Candidate("im2col-cusparse")])
    final = finish_deferred(first, x, weight, bias, spec, FP32, CPU_CANDIDATES, timer, TuneCache(tmp_path, ENV_A))
    assert final.backend == "im2col-cublas" and final.times_ms["im2col-cusparse"] == 0.9


def _pending_backend(monkeypatch, name, is_pending):
    backend = dataclasses.replace(get_backend(name), pending=is_pending)
    monkeypatch.setitem(registry._REGISTRY, name, backend)


def test_pending_candidates_asks_each_backend(monkeypatch):
    x, weight, bias, spec = _layer()
    asked = []

    def pending(*args):
        asked.append(args)
        return True

    _pending_backend(monkeypatch, "im2col-cusparse", pending)
    found = pending_candidates(CPU_CANDIDATES, spec, weight, torch.float32, has_bias=True, relu_only=True)
    assert found == [Candidate("im2col-cusparse")]
    assert asked == [(spec, weight, torch.float32, True, None, True)]


@pytest.mark.parametrize("pending", [False, True])
def test_layers_with_pending_candidates_keep_writing_nchw_while_tuning(tmp_path, monkeypatch, pending):
    from sparsecnn.tuning import sparsify as sparsify_module

    _pending_backend(monkeypatch, "im2col-cusparse", lambda *args: pending)
    switched = []
    monkeypatch.setattr(sparsify_module, "set_tuning_layout", lambda layer: switched.append(layer))
    model = _model()
    autotune_model(model, torch.randn(2, 3, 12, 12), cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert switched == ([] if pending else [model[0], model[2]])


def test_autotune_model_times_pending_candidates_after_the_other_layers(tmp_path, monkeypatch):
    _pending_backend(monkeypatch, "im2col-cusparse", lambda *args: True)
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref, untuned = model(x), copy.deepcopy(model)
    timer = FakeTimer(measure_ms={"im2col-cusparse": 0.5})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    first_pass = timer.probed[:4]  # two layers, dense and im2col-cublas each
    assert "im2col-cusparse" not in first_pass and timer.probed.count("im2col-cusparse") == 2
    assert [layer.backend for layer in report.layers] == ["im2col-cusparse", "im2col-cusparse"]
    assert all(layer.deferred == () for layer in report.layers)
    assert model[0].backend == model[2].backend == "im2col-cusparse"
    assert relative_error(model(x), ref) < 1e-6
    second_timer = FakeTimer()
    again = autotune_model(untuned, x, cache_dir=tmp_path, timer=second_timer, progress=False)
    assert second_timer.probed == [] and [layer.cache for layer in again.layers] == ["hit", "hit"]


def test_worker_pool_says_which_jobs_are_still_running():
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    pool = WorkerPool("test jobs", lambda: 1, logging.getLogger("test"),
                      new_pool=lambda workers: ThreadPoolExecutor(1))
    try:
        pool.submit("slow", release.wait, 10)
        assert pool.running("slow") and not pool.running("absent")
        release.set()
        pool.pending["slow"][0].result(timeout=10)
        assert not pool.running("slow")
    finally:
        release.set()
        pool.shutdown()


def test_a_candidate_much_slower_in_one_run_is_never_benchmarked(tmp_path):
    timer = FakeTimer(probe_ms={"dense": 30.0, "im2col-cublas": 1.0, "im2col-cusparse": 20.0})
    result = _tune(None, timer)
    assert timer.probed == ["dense", "im2col-cublas", "im2col-cusparse"]
    assert timer.measured == ["im2col-cublas", "dense"]  # fastest probe first; dense, the baseline, always
    assert "over 10x" in result.dropped["im2col-cusparse"] and result.backend == "im2col-cublas"
    assert result.dense_ms == 30.0 and result.speedup == 30.0


def test_a_candidate_that_errors_is_dropped(tmp_path):
    timer = FakeTimer(measure_ms={"dense": 2.0, "im2col-cusparse": 1.5}, failing={"im2col-cublas"})
    result = _tune(TuneCache(tmp_path, ENV_A), timer)
    assert timer.measured == ["dense", "im2col-cusparse"]
    assert result.dropped["im2col-cublas"].startswith("error: RuntimeError: this GPU refuses")
    assert result.backend == "im2col-cusparse" and set(result.times_ms) == {"dense", "im2col-cusparse"}


@pytest.mark.parametrize("scale, kept", [(1 + 1e-3, False), (1 + 1e-7, True)])
def test_a_candidate_off_the_fp64_result_by_more_than_twice_dense_is_dropped(monkeypatch, scale, kept):
    """A sparse candidate erring by 1e-3 (e.g. a TF32 kernel summing worse than cuDNN's TF32) is
    dropped before any timing, even when fastest; one within fp32 rounding is kept."""
    from sparsecnn.tuning import select

    real_runner = select._runner

    def skewed(candidate, *args):
        run = real_runner(candidate, *args)
        return (lambda: run() * scale) if candidate.backend == "im2col-cusparse" else run

    monkeypatch.setattr(select, "_runner", skewed)
    x, weight, bias, spec = _layer()
    timer = FakeTimer(probe_ms={"dense": 3.0, "im2col-cublas": 2.0, "im2col-cusparse": 1.0})
    selection = pick_fastest(x, weight, bias, spec, CPU_CANDIDATES, timer)
    assert (selection.best == Candidate("im2col-cusparse")) == kept
    if not kept:
        assert "im2col-cusparse" not in timer.probed
        assert "against fp64, over 2x the dense candidates'" in selection.dropped["im2col-cusparse"]


def test_only_the_fastest_probed_sparse_candidates_are_benchmarked():
    x, weight, bias, spec = _layer()
    timer = FakeTimer(probe_ms={"dense": 3.0, "im2col-cublas": 2.0, "im2col-cusparse": 1.0},
                      measure_ms={"dense": 3.0, "im2col-cusparse": 1.5})
    selection = pick_fastest(x, weight, bias, spec, CPU_CANDIDATES, timer, measure_top=1)
    assert timer.measured == ["im2col-cusparse", "dense"]
    assert "not among the 1 fastest sparse candidates" in selection.dropped["im2col-cublas"]
    assert selection.best == Candidate("im2col-cusparse") and selection.best_ms == 1.5
    with pytest.raises(ValueError, match="measure_top must be >= 1"):
        pick_fastest(x, weight, bias, spec, CPU_CANDIDATES, timer, measure_top=0)


class BoundedTimer(FakeTimer):
    """A FakeTimer whose measure takes the bound pick_fastest may give it (as MeasuringTimer's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = {}

    def measure(self, candidate, fn, slower_than_ms=math.inf):
        self.bounds[candidate.backend] = slower_than_ms
        return super().measure(candidate, fn)


def test_benchmarks_after_the_fastest_may_stop_once_clearly_slower_except_the_baseline():
    x, weight, bias, spec = _layer()
    timer = BoundedTimer(probe_ms={"dense": 3.0, "im2col-cublas": 2.0, "im2col-cusparse": 1.0},
                         measure_ms={"dense": 3.0, "im2col-cublas": 2.5, "im2col-cusparse": 1.5})
    selection = pick_fastest(x, weight, bias, spec, CPU_CANDIDATES, timer)
    assert timer.measured == ["im2col-cusparse", "im2col-cublas", "dense"]
    assert timer.bounds == {"im2col-cusparse": math.inf, "im2col-cublas": SLOWER_MARGIN * 1.5, "dense": math.inf}
    assert selection.best == Candidate("im2col-cusparse") and selection.times_ms["dense"] == 3.0
    plain = FakeTimer(probe_ms=timer.probe_ms, measure_ms=timer.measure_ms)  # a measure without the bound
    assert pick_fastest(x, weight, bias, spec, CPU_CANDIDATES, plain).best == Candidate("im2col-cusparse")


@pytest.mark.parametrize("bound, expected_reps", [(0.0, CHECK_REPS), (math.inf, 40), (None, 40)])
def test_benchmark_stops_after_its_check_repeats_only_when_their_median_is_over_the_bound(bound, expected_reps):
    calls = []
    result = benchmark(lambda: calls.append(1), "cpu", warmup_ms=0.0, rep_ms=1e9, min_rep=1, max_rep=40,
                       stop_above_ms=bound)
    assert len(calls) == 2 + expected_reps and result["median_ms"] >= 0  # 2: the untimed and the per-call runs


def test_first_calls_run_before_any_timing():
    calls = []
    x, weight, bias, spec = _layer()

    class RecordingTimer(FakeTimer):
        def probe(self, candidate, fn):
            calls.append(("probe", candidate.backend))
            return super().probe(candidate, fn)

    candidates = [Candidate("dense"), Candidate("im2col-cublas")]
    original = torch.nn.functional.conv2d
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: calls.append("conv") or original(*a, **k))
        pick_fastest(x, weight, bias, spec, candidates, RecordingTimer())
    assert calls.index(("probe", "dense")) > calls.index("conv")


def test_no_candidate_running_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no candidate ran"):
        _tune(None, FakeTimer(failing={"dense", "im2col-cublas", "im2col-cusparse"}))


def test_no_candidate_at_all_says_why_the_dense_backends_cannot_run():
    spec = ConvSpec(2, 3, 5, 7, 7, 3, 3, 1, 1)
    x = torch.randn(2, 3, 7, 7).half()
    candidates = candidates_for(spec, POLICIES["fp16"], "cpu")
    with pytest.raises(RuntimeError, match="no backend runs .* torch.float16 on cpu: dense does not support"):
        pick_fastest(x, torch.randn(5, 3, 3, 3).half(), None, spec, candidates, FakeTimer())


def _damage_truncate(path):
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


def _damage_garbage(path):
    path.write_bytes(b"\x00\xff not json")


def _damage_fields(path):
    entry = json.loads(path.read_text())
    del entry["decision"]["time_ms"]
    path.write_text(json.dumps(entry))


def _damage_environment(path):
    entry = json.loads(path.read_text())
    entry["environment"]["driver"] = "999"
    path.write_text(json.dumps(entry))


@pytest.mark.parametrize("damage, message", [(_damage_truncate, "corrupt"), (_damage_garbage, "corrupt"),
                                             (_damage_fields, "corrupt"),
                                             (_damage_environment, "driver: '999' -> '580'")])
def test_damaged_cache_entry_is_retuned_with_a_message(tmp_path, damage, message):
    layer = _layer()
    cache = TuneCache(tmp_path, ENV_A)
    _tune(cache, FakeTimer(), layer)
    (path,) = tmp_path.glob("*.json")
    damage(path)
    timer = FakeTimer()
    result = _tune(cache, timer, layer)
    assert result.cache == "retuned" and message in result.cache_note and timer.measured
    assert _tune(cache, FakeTimer(), layer).cache == "hit"  # rewritten whole


def test_decision_from_another_gpu_is_retuned_and_both_are_kept(tmp_path):
    layer = _layer()
    _tune(TuneCache(tmp_path, ENV_A), FakeTimer(), layer)
    other = _tune(TuneCache(tmp_path, ENV_B), FakeTimer(), layer)
    assert other.cache == "retuned" and "another environment (device: 'GPU A' -> 'GPU B')" in other.cache_note
    assert _tune(TuneCache(tmp_path, ENV_A), FakeTimer(), layer).cache == "hit"
    assert _tune(TuneCache(tmp_path, ENV_B), FakeTimer(), layer).cache == "hit"


def test_a_cached_choice_no_longer_offered_is_retuned(tmp_path):
    layer = _layer()
    cache = TuneCache(tmp_path, ENV_A)
    x, weight, bias, spec = layer
    key = layer_key(spec, "fp32", weight, True, "none", False, [c.saved() for c in CPU_CANDIDATES])
    cache.store(key, CachedDecision("blocks", {"t2": 8}, 0.1, 1.0, {}))
    result = _tune(cache, FakeTimer(), layer)
    assert result.cache == "retuned" and "not among this run's candidates" in result.cache_note


def _write_many(directory, key, writer, count):
    cache = TuneCache(directory, ENV_A)
    for i in range(count):
        cache.store(key, CachedDecision("dense", None, float(writer * 1000 + i), 1.0, {"dense": 1.0}))


def test_an_entry_written_while_looking_up_is_not_taken_for_another_environments(tmp_path):
    # lookup checks for its own file, then scans for other environments' files: a process that
    # stores the layer in between must not make the scan report "another environment"
    x, weight, bias, spec = _layer()
    key = layer_key(spec, "fp32", weight, True, "none", False, [])
    cache = TuneCache(tmp_path, ENV_A)
    cache.store(key, CachedDecision("dense", None, 1.0, 1.0, {"dense": 1.0}))
    assert cache._elsewhere(key) is None
    TuneCache(tmp_path, ENV_B).store(key, CachedDecision("dense", None, 1.0, 1.0, {"dense": 1.0}))
    assert "another environment" in cache._elsewhere(key)


def test_concurrent_writers_never_leave_a_corrupt_file(tmp_path):
    x, weight, bias, spec = _layer()
    key = layer_key(spec, "fp32", weight, True, "none", False, [])
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_write_many, args=(tmp_path, key, w, 150)) for w in (1, 2)]
    threads = [threading.Thread(target=_write_many, args=(tmp_path, key, w, 150)) for w in (3, 4)]
    for worker in processes + threads:
        worker.start()
    cache, reads = TuneCache(tmp_path, ENV_A), []
    while any(worker.is_alive() for worker in processes + threads):
        reads.append(cache.lookup(key))
    for worker in processes + threads:
        worker.join()
    assert all(p.exitcode == 0 for p in processes)
    assert all(note is None for _, note in reads)  # every read saw a whole file or none yet
    decision, note = cache.lookup(key)
    assert note is None and decision.time_ms % 1000 == 149
    assert [p.name for p in tmp_path.iterdir()] == [cache.path(key).name]  # no temporary files left


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_policies_offer_only_the_precisions_they_allow(device_type):
    spec = ConvSpec(8, 64, 64, 14, 14, 3, 3, 1, 1)
    offered = {name: candidates_for(spec, POLICIES[name], device_type) for name in ("fp32", "tf32", "fp16")}
    assert not any(uses_tf32(c.backend, c.config) for name in ("fp32", "fp16") for c in offered[name])
    assert Candidate("dense") in offered["fp32"]
    if device_type == "cpu":
        assert offered["tf32"] == offered["fp32"] and offered["fp16"] == []  # no TF32 or fp16 CPU kernels
        return
    tf32 = [c for c in offered["tf32"] if uses_tf32(c.backend, c.config)]
    assert Candidate("dense-tf32") in tf32 and any(c.backend == "blocks" for c in tf32)
    assert not any(c.backend == "blocks" for c in offered["fp32"])  # not unasked in fp32 (blocks.auto_configs)
    named = candidates_for(spec, POLICIES["fp32"], device_type, backends=["blocks"])
    assert any(c.backend == "blocks" and c.config.precision == "tf32x3" for c in named)  # fp32-level
    assert {c for c in offered["fp32"] if c.backend != "staged"} < set(offered["tf32"])  # staged: auto_with_tf32
    assert Candidate("dense-channels-last") in offered["fp16"]
    assert not any(c.backend == "dense-channels-last" for c in offered["fp32"])
    assert all(Candidate("dense-fused") in offered[name] for name in ("fp32", "fp16"))
    default = candidates_for(spec, POLICIES["fp32-default"], device_type)  # dense convs run TF32 already
    assert Candidate("dense") in default and Candidate("dense-tf32") not in default
    assert {c for c in offered["tf32"] if c.backend != "dense-tf32"} == set(default)


def test_a_layer_result_gives_each_backends_fastest_benchmarked_time():
    spec = ConvSpec(1, 3, 8, 8, 8, 3, 3)
    times = {"dense": 0.5, "direct[a]": 0.4, "direct[b]": 0.3, "codegen[x[1]]": 0.6}
    layer = LayerResult("conv", spec, "direct", None, "direct[b]", 0.3, 0.5, times, {}, "tuned")
    assert layer.fastest_per_backend() == {"dense": 0.5, "direct": 0.3, "codegen": 0.6}
    assert LayerResult("conv", spec, "dense", None, "dense", 0.5, 0.5, {}, {}, "hit").fastest_per_backend() == {}


def test_summary_table_lists_choice_time_speedup_and_share():
    spec = ConvSpec(1, 3, 8, 8, 8, 3, 3)
    layers = [LayerResult("features.0", spec, "direct", None, "direct[cfg]", 0.3, 0.6, {}, {}, "tuned"),
              LayerResult("features.3", spec, "dense", None, "dense", 0.1, 0.1, {}, {}, "hit")]
    report = TuneReport(layers, "fp16", max_rel_error=1.5e-3, unreached=["aux.conv"])
    table = report.format()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:4]]
    assert rows[0] == ["features.0", "1x3x8x8 -> 8, 3x3/1", "direct[cfg]", "0.3000", "0.6000", "2.00x", "75.0%",
                       "tuned"]
    assert rows[1] == ["features.3", "1x3x8x8 -> 8, 3x3/1", "dense", "0.1000", "0.1000", "1.00x", "25.0%", "hit"]
    assert "convolutions (fp16, graph times): 0.4000 ms tuned, 0.7000 ms dense, 1.75x" in table
    assert "1.50e-03" in table and "aux.conv" in table and str(report) == table


def test_autotune_model_reuses_the_cache_and_reports_the_error(tmp_path):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref, untuned = model(x), copy.deepcopy(model)
    timer = FakeTimer(measure_ms={"im2col-cusparse": 0.5})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    assert [layer.name for layer in report.layers] == ["0", "2"] and report.policy == "fp32"
    assert all(isinstance(model[i], SparseConv2d) and model[i].backend == "im2col-cusparse" for i in (0, 2))
    assert set(model[0].timings) == {"dense", "im2col-cublas", "im2col-cusparse"}
    assert report.max_rel_error < 1e-6 and relative_error(model(x), ref) < 1e-6
    second_timer = FakeTimer()
    again = autotune_model(untuned, x, cache_dir=tmp_path, timer=second_timer, progress=False)
    assert second_timer.probed == [] and [layer.cache for layer in again.layers] == ["hit", "hit"]


def test_whole_model_timings_replay_a_fresh_cuda_graph_each_time(monkeypatch):
    """In run mode "graph" on CUDA every whole-model timing (model as given, layouts, model check)
    enables CUDA graphs for it alone, so each captures the layers as they are then, and the eager
    timings between them stay eager; an eager run mode or a CPU model keeps the timer as it is."""
    from sparsecnn.tuning import model_check

    events = []
    monkeypatch.setattr(model_check, "enable_cuda_graphs", lambda module: events.append(("on", module)))
    monkeypatch.setattr(model_check, "disable_cuda_graphs", lambda module: events.append(("off", module)))

    class Recording:
        def probe(self, candidate, fn):
            events.append("probe")
            return 1.0

        def measure(self, candidate, fn):
            events.append("measure")
            raise RuntimeError("capture refused")

    model = nn.Linear(2, 2)
    timer = model_check.model_timer(Recording(), model, "cuda", "graph")
    assert timer.probe(Candidate("model:tuned"), lambda: None) == 1.0
    with pytest.raises(RuntimeError, match="capture refused"):
        timer.measure(Candidate("model:tuned"), lambda: None)
    assert events == [("on", model), "probe", ("off", model), ("on", model), "measure", ("off", model)]
    plain = Recording()
    assert model_check.model_timer(plain, model, "cuda", "eager") is plain
    assert model_check.model_timer(plain, model, "cpu", "graph") is plain


def test_autotune_model_reports_where_the_tuning_time_went(tmp_path):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    report = autotune_model(model, x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    phases = report.phase_s
    assert {"reference pass", "prefetch", "bind dense", "bind im2col-cusparse", "first calls", "probes",
            "benchmarks", "layers", "model check", "total"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    inside_layers = sum(phases[name] for name in phases if name.startswith("bind ")) + phases["first calls"]
    assert inside_layers <= phases["layers"] <= phases["total"]
    per_backend = {name: phases[name] for name in phases if name.startswith("first calls ")}
    assert set(per_backend) == {"first calls dense", "first calls im2col-cublas", "first calls im2col-cusparse"}
    assert 0 < sum(per_backend.values()) <= phases["first calls"]  # one at a time on the CPU
    assert list(phases)[-1] == "total" and "tuning time: reference pass" in report.format()
    assert report.worker_jobs == {}  # no backend here prepares in workers
    cached = autotune_model(copy.deepcopy(model), x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert "first calls" not in cached.phase_s and "layers" in cached.phase_s


def test_phase_clock_sums_repeated_phases():
    clock = PhaseClock()
    for _ in range(3):
        with clock.phase("a"):
            time.sleep(0.01)
    with pytest.raises(ValueError), clock.phase("b"):
        raise ValueError("counted anyway")
    assert list(clock.seconds) == ["a", "b"] and clock.seconds["a"] >= 0.03
    clock.add("a", 1.0)
    clock.add("c", 0.5)
    assert list(clock.seconds) == ["a", "b", "c"] and clock.seconds["a"] >= 1.03 and clock.seconds["c"] == 0.5


@pytest.mark.parametrize("model_ms, kept", [({"model:tuned": 3.0, "model:dense": 4.0}, "tuned"),
                                             ({"model:tuned": 5.0, "model:dense": 4.0}, "dense")])
def test_the_whole_model_is_never_slower_than_dense(tmp_path, caplog, model_ms, kept):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref = model(x)
    switches = {"model:switch 0": 10.0, "model:switch 2": 10.0}
    timer = FakeTimer(measure_ms={"dense": 2.0, "im2col-cublas": 1.0, "im2col-cusparse": 3.0, **model_ms, **switches})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    check = report.model_check
    assert timer.measured[-4:] == ["model:tuned", "model:dense", "model:switch 0", "model:switch 2"]
    assert (check.kept, check.dense_backend, check.tuned_ms, check.dense_ms) == (kept, "dense", *model_ms.values())
    assert check.switched == [] and check.final_ms == min(model_ms.values())  # no switch gained
    assert [layer.backend for layer in report.layers] == ["im2col-cublas", "im2col-cublas"]
    running = "im2col-cublas" if kept == "tuned" else "dense"
    assert model[0].backend == running and model[2].backend == running
    assert model[0]._packed is not None  # kept as packed before the check (tuned) or by its dense run
    assert relative_error(model(x), ref) < 1e-6 and "whole model:" in report.format()
    assert ("every tuned layer now runs dense" in caplog.text) == (kept == "dense")


@pytest.mark.parametrize("model_ms, kept, running", [
    ({"model:tuned": 5.0, "model:dense": 4.0, "model:switch 0": 3.0, "model:switch 2": 4.5}, "dense",
     ["im2col-cublas", "dense"]),
    ({"model:tuned": 3.0, "model:dense": 4.0, "model:switch 0": 3.5, "model:switch 2": 2.5}, "tuned",
     ["im2col-cublas", "dense"]),
])
def test_layers_are_switched_one_at_a_time_where_the_whole_model_gets_faster(tmp_path, model_ms, kept, running):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref = model(x)
    timer = FakeTimer(measure_ms={"dense": 2.0, "im2col-cublas": 1.0, "im2col-cusparse": 3.0, **model_ms})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    check = report.model_check
    assert check.kept == kept and check.switched == (["0"] if kept == "dense" else ["2"])
    assert check.final_ms == min(model_ms.values()) and "1 layers switched" in check.format()
    assert [model[0].backend, model[2].backend] == running
    assert relative_error(model(x), ref) < 1e-6


def test_switches_try_the_largest_isolated_gain_first_from_dense_and_the_smallest_from_tuned():
    from sparsecnn.tuning.model_check import _switch_order

    spec = ConvSpec(1, 3, 8, 8, 8, 3, 3)
    results = {name: LayerResult(name, spec, "direct", None, "direct", ms, 1.0, {"dense": 1.0}, {}, "tuned")
               for name, ms in (("a", 0.9), ("b", 0.2), ("c", 0.5), ("d", 0.4))}
    chosen = {name: ("direct",) for name in results}
    chosen["d"] = ("dense",)  # already dense: nothing to switch
    assert _switch_order(results, chosen, "dense", "dense") == ["b", "c", "a"]
    assert _switch_order(results, chosen, "dense", "tuned") == ["a", "c", "b"]


@pytest.mark.parametrize("eager_ms, warned", [((2.0, 3.0), False), ((6.0, 3.0), True)])
def test_the_model_check_warns_when_the_tuned_model_is_slower_in_eager_mode(tmp_path, caplog, monkeypatch,
                                                                             eager_ms, warned):
    import sparsecnn.tuning.model_check as model_check_module

    times = iter(eager_ms)  # tuned, then dense: as if measured on CUDA
    monkeypatch.setattr(model_check_module, "_eager_ms", lambda run, device_type: next(times))
    model, x = _model(), torch.randn(2, 3, 12, 12)
    timer = FakeTimer(measure_ms={"dense": 2.0, "im2col-cublas": 1.0, "im2col-cusparse": 3.0,
                                  "model:tuned": 3.0, "model:dense": 4.0})
    check = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False).model_check
    assert check.kept == "tuned" and (check.tuned_eager_ms, check.dense_eager_ms) == eager_ms
    assert check.slower_in_eager == warned
    assert ("in eager mode the tuned model" in caplog.text) == warned
    assert ("slower in eager mode" in check.format()) == warned


def test_eager_timing_of_the_model_check_is_cuda_only():
    from sparsecnn.tuning.model_check import _eager_ms

    assert _eager_ms(lambda: None, "cpu") is None


def test_eager_wall_time_counts_back_to_back_calls():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.002)

    assert eager_wall_ms(slow, "cpu", calls=4, repeats=3) >= 2.0
    assert len(calls) == 1 + 4 * 3  # one untimed call, then three groups of four


def test_run_mode_eager_times_eager_calls_and_keeps_its_own_decisions(tmp_path, monkeypatch):
    import sparsecnn.tuning.sparsify as sparsify_module

    model, x = _model(), torch.randn(2, 3, 12, 12)
    graph = autotune_model(copy.deepcopy(model), x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    timers = []
    monkeypatch.setattr(sparsify_module, "EagerTimer", lambda device: timers.append(device) or FakeTimer())
    eager = autotune_model(copy.deepcopy(model), x, cache_dir=tmp_path, progress=False, run_mode="eager")
    assert timers == [torch.device("cpu")]  # the default timer of run_mode "eager"
    assert graph.run_mode == "graph" and eager.run_mode == "eager" and "eager times" in eager.format()
    assert [layer.cache for layer in eager.layers] == ["tuned", "tuned"]  # not graph mode's decisions
    with pytest.raises(ValueError, match="run_mode must be one of"):
        autotune_model(copy.deepcopy(model), x, cache_dir=tmp_path, timer=FakeTimer(), run_mode="fast")


def test_eager_timer_measures_wall_time_of_back_to_back_calls():
    calls = []
    timer = EagerTimer(torch.device("cpu"), calls=5, repeats=2)
    assert timer.measure(Candidate("dense"), lambda: calls.append(1)) >= 0 and len(calls) == 1 + 5 * 2
    assert timer.probe(Candidate("dense"), lambda: calls.append(1)) >= 0 and len(calls) == 11 + 1 + 3


def test_autotune_model_says_why_it_retunes(tmp_path, monkeypatch, caplog):
    import sparsecnn.tuning.sparsify as sparsify_module

    model, x = _model(), torch.randn(2, 3, 12, 12)
    monkeypatch.setattr(sparsify_module, "environment_fingerprint", lambda device: ENV_A)
    autotune_model(copy.deepcopy(model), x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    monkeypatch.setattr(sparsify_module, "environment_fingerprint", lambda device: ENV_B)
    with caplog.at_level(logging.WARNING, logger="sparsecnn.tuning"):
        report = autotune_model(model, x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert [layer.cache for layer in report.layers] == ["retuned", "retuned"]
    (record,) = caplog.records  # one line for both layers: they share the reason
    assert "re-tuned 0, 2" in record.message and "'GPU A' -> 'GPU B'" in record.message


def test_cache_dir_comes_from_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECNN_CACHE_DIR", str(tmp_path / "from-env"))
    report = autotune_model(_model(), torch.randn(1, 3, 8, 8), timer=FakeTimer(), progress=False)
    assert report.cache_dir == str(tmp_path / "from-env")
    files = sorted(path.name.startswith("model-") for path in (tmp_path / "from-env").glob("*.json"))
    assert files == [False, False, True]  # two layers, one model


def test_bf16_policy_converts_the_model_and_reports_its_error(tmp_path):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref, tol = dense_reference(model, x, torch.bfloat16)  # 2x the dense model's own bf16 error, vs fp64
    report = autotune_model(model, x, dtype="bf16", cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert report.policy == "bf16" and model[0].weight.dtype == torch.bfloat16
    assert all(layer.backend == "dense" for layer in report.layers)  # the only CPU bf16 backend
    assert 1e-4 < report.max_rel_error < tol
    with torch.no_grad():
        assert relative_error(model(x.bfloat16()), ref) < tol
    with pytest.raises(ValueError, match="dtype must be None or one of fp32, tf32"):
        autotune_model(_model(), x, dtype="int8", cache_dir=tmp_path, timer=FakeTimer())


def test_masks_filter_and_unreached_layers(tmp_path):
    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.main, self.unused, self.skipped = _model(), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            return self.skipped(self.main(x))

    model, x = TwoBranches(), torch.randn(1, 3, 8, 8)
    mask = torch.rand(model.main[0].weight.shape) > 0.5
    report = autotune_model(model, x, masks={"main.0": mask}, filter_fn=lambda name, m: name != "skipped",
                            cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert [layer.name for layer in report.layers] == ["main.0", "main.2"] and report.unreached == ["unused"]
    assert type(model.unused) is nn.Conv2d and type(model.skipped) is nn.Conv2d
    assert torch.equal(model.main[0].mask, mask)


def test_already_sparse_layers_keep_weight_bias_mask_and_activation(tmp_path):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    sparsify_(model, backend="im2col-cublas")
    model[0].activation = "relu"
    model[1] = nn.Identity()  # the ReLU now lives in model[0]
    first = model[0]
    weight, bias, mask = first.weight.clone(), first.bias.clone(), first.mask.clone()
    ref = model(x)
    timer = FakeTimer(measure_ms={"im2col-cusparse": 0.5})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    assert model[0] is first and first.backend == "im2col-cusparse" and first.activation == "relu"
    assert torch.equal(first.weight, weight) and torch.equal(first.bias, bias) and torch.equal(first.mask, mask)
    assert report.max_rel_error < 1e-6 and relative_error(model(x), ref) < 1e-6
    sparsify_(model, backend="dense")
    assert model[0] is first and first.backend == "dense" and first.activation == "relu"


@pytest.mark.slow
def test_prepared_resnet_keeps_its_fused_relus_and_residuals(tmp_path):
    from sparsecnn.models import build_model
    from sparsecnn.passes.fuse import prepare_for_inference
    from sparsecnn.prune import prune_magnitude_

    model = build_model("resnet18-cifar").eval()
    prune_magnitude_(model, 0.8)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = model.double()(x.double())
    prepared = prepare_for_inference(model.float())
    fused = {name: (m.activation, name in prepared.fuse_report.fused_adds)
             for name, m in prepared.named_modules() if isinstance(m, SparseConv2d)}
    report = autotune_model(prepared, x, cache_dir=tmp_path, timer=FakeTimer(measure_ms={"im2col-cublas": 0.5}),
                            progress=False)
    assert all(layer.backend == "im2col-cublas" for layer in report.layers)
    assert any(residual for _, residual in fused.values()) and any(act == "relu" for act, _ in fused.values())
    assert {name: (m.activation, name in prepared.fuse_report.fused_adds) for name, m in prepared.named_modules()
            if isinstance(m, SparseConv2d)} == fused
    with torch.no_grad():
        assert relative_error(prepared(x), ref) < 1e-5 and report.max_rel_error < 1e-5


def test_sparsify_stores_the_report_on_the_model(tmp_path):
    model = sparsify_(_model(), torch.randn(1, 3, 8, 8), cache_dir=tmp_path, progress=False)
    assert isinstance(model.sparsecnn_report, TuneReport) and len(model.sparsecnn_report.layers) == 2


@pytest.mark.gpu
@pytest.mark.timing
def test_autotuned_resnet18_cifar_equals_the_dense_model(tmp_path):
    from sparsecnn.models import build_model
    from sparsecnn.prune import prune_magnitude_

    model = build_model("resnet18-cifar").eval().cuda()
    prune_magnitude_(model, 0.9)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    report = autotune_model(model, x, dtype="fp32", cache_dir=tmp_path, progress=False)
    assert len(report.layers) == 20 and report.max_rel_error < 1e-5
    assert all(not uses_tf32(layer.backend, layer.config) for layer in report.layers)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        assert relative_error(model(x), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.parametrize("dtype", ["tf32", "fp16"])
def test_tf32_and_fp16_policies_on_cuda(tmp_path, dtype):
    model = _model().cuda()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    # The limit: 2x the error of the dense model in that precision (TF32 convs / fp16), against fp64.
    ref, tol = dense_reference(model, x, "tf32" if dtype == "tf32" else torch.float16)
    saved = torch.backends.cudnn.allow_tf32
    report = autotune_model(model, x, dtype=dtype, cache_dir=tmp_path, progress=False)
    assert torch.backends.cudnn.allow_tf32 == saved  # tuning leaves the global flags as they were
    assert report.policy == dtype and report.max_rel_error < tol and not math.isnan(report.total_ms)
    assert model[0].weight.dtype == POLICIES[dtype].dtype
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        assert relative_error(model(x.to(POLICIES[dtype].dtype)), ref) < tol


@pytest.mark.parametrize("given_ms, kept", [(2.0, "given"), (3.5, "tuned")])
def test_the_model_as_given_is_put_back_when_faster(tmp_path, monkeypatch, given_ms, kept):
    monkeypatch.setattr(whole_model, "GIVEN_CHECK_DEVICES", ("cuda", "cpu"))
    model, x = _model(), torch.randn(2, 3, 12, 12)
    ref, given_types = model(x), [type(module) for module in model]
    seen_when_given = []

    class GivenTimer(FakeTimer):
        def measure(self, candidate, fn):
            if candidate.backend == "model:given":
                seen_when_given.extend(type(module) for module in model)
            return super().measure(candidate, fn)

    timer = GivenTimer(measure_ms={"dense": 2.0, "im2col-cublas": 1.0, "im2col-cusparse": 3.0, "model:given": given_ms,
                                   "model:tuned": 3.0, "model:dense": 4.0, "model:switch 0": 10.0,
                                   "model:switch 2": 10.0})
    report = autotune_model(model, x, cache_dir=tmp_path, timer=timer, progress=False)
    check = report.model_check
    assert timer.measured.index("model:given") < timer.measured.index("model:tuned")
    assert seen_when_given == given_types  # timed as given, after the layers were tuned
    assert check.given_ms == given_ms and check.kept == kept
    assert ([type(module) for module in model] == given_types) == (kept == "given")
    assert check.speedup_over_given == pytest.approx(1.0 if kept == "given" else given_ms / 3.0)
    assert relative_error(model(x), ref) < 1e-6
    assert ("kept as given" if kept == "given" else "faster than the model as given") in report.format()


def test_the_model_as_given_is_not_timed_on_the_cpu_by_default(tmp_path):
    timer = FakeTimer()
    report = autotune_model(_model(), torch.randn(2, 3, 12, 12), cache_dir=tmp_path, timer=timer, progress=False)
    assert "model:given" not in timer.measured and report.model_check.given_ms is None


@pytest.mark.parametrize("allow_tf32, device_type, expected", [(True, "cuda", "fp32-default"), (False, "cuda", "fp32"),
                                                             (True, "cpu", "fp32")])
def test_dtype_none_follows_pytorchs_tf32_flag_on_cuda(monkeypatch, allow_tf32, device_type, expected):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    policy = resolve_policy(None, torch.float32, device_type)
    assert policy.name == expected and policy.dense_tf32 == policy.allow_tf32 == (expected == "fp32-default")
    assert resolve_policy("fp32", torch.float32, "cuda").dense_tf32 is False


def test_the_policy_sets_the_tf32_flags_while_tuning(tmp_path, monkeypatch):
    monkeypatch.setattr(sparsify_module, "resolve_policy", lambda dtype, model_dtype, device_type: POLICIES["fp32-default"])
    seen = []

    class FlagTimer(FakeTimer):
        def measure(self, candidate, fn):
            seen.append(torch.backends.cudnn.allow_tf32)
            return super().measure(candidate, fn)

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    report = autotune_model(_model(), torch.randn(2, 3, 12, 12), cache_dir=tmp_path, timer=FlagTimer(), progress=False)
    assert seen and all(seen) and torch.backends.cudnn.allow_tf32 is False
    assert report.policy == "fp32-default" and "convs in TF32, dense and sparse" in report.format()


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_example_inputs_may_come_in_the_models_dtype_or_the_target_dtype(tmp_path, input_dtype):
    model = _model()  # fp32, tuned for bf16 (fp16 convs do not run on the CPU)
    x = torch.randn(2, 3, 12, 12).to(input_dtype)
    report = autotune_model(model, x, dtype="bf16", cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert report.policy == "bf16" and next(model.parameters()).dtype == torch.bfloat16
    assert model(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_sparsified_cuda_model_replays_cuda_graphs_for_plain_calls(tmp_path, dtype):
    from sparsecnn.nn.graphed import cuda_graph_forward

    model = _model().cuda()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    if dtype == "fp16":  # 2x the dense model's own fp16 error, against fp64
        ref, tol = dense_reference(model, x, torch.float16)
    else:
        with torch.no_grad():
            ref, tol = copy.deepcopy(model).double()(x.double()), 1e-5
    sparsify_(model, x.half() if dtype == "fp16" else x, dtype=dtype, cache_dir=tmp_path, progress=False)
    wrapper = cuda_graph_forward(model)
    assert wrapper is not None and not any(p.requires_grad for p in model.parameters())
    x_run = x.to(POLICIES[dtype].dtype)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # dtype "fp32": exact, as asked
        first, second = model(x_run), model(x_run)
        eager = wrapper.original_forward(x_run)
        assert wrapper.counts.get("capture") == 1 and wrapper.counts.get("replay", 0) >= 1
        assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
        assert relative_error(second, eager) < (1e-6 if dtype == "fp32" else 1e-3)
        assert relative_error(second, ref) < tol
        model(torch.randn(4, 3, 32, 32, device="cuda", dtype=x_run.dtype))  # a new shape: a new graph
        assert wrapper.counts.get("capture") == 2
    plain = sparsify_(_model().cuda(), x, backend="dense", cuda_graphs=False)
    assert cuda_graph_forward(plain) is None and all(p.requires_grad for p in plain.parameters())


def test_sparsify_runs_the_forward_itself_on_a_model_that_replays_graphs(tmp_path):
    from sparsecnn.nn.graphed import cuda_graph_forward, enable_cuda_graphs

    model = _model()
    enable_cuda_graphs(model)  # as an earlier sparsify_ on CUDA leaves it
    sparsify_(model, torch.randn(2, 3, 12, 12), backend="dense", cuda_graphs=False)
    assert cuda_graph_forward(model) is None


def test_cuda_graphs_are_not_installed_on_the_cpu(tmp_path):
    from sparsecnn.nn.graphed import cuda_graph_forward

    model = sparsify_(_model(), torch.randn(2, 3, 12, 12), backend="dense")
    assert cuda_graph_forward(model) is None and all(p.requires_grad for p in model.parameters())
