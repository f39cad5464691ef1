"""The whole-model decisions cached beside the layers' (`tuning.model_decision`): a reload of the
same model from the same cache times nothing and ends as the first tuning ended; anything that could
change the model's decisions (retune, a layer tuned anew, another structure or input, a damaged
entry) times the model again. Timings are fake (an injected timer)."""
import copy
import json

import pytest
import torch
from helpers.common import sparse_weight
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning import model_decision
from sparsecnn.tuning import sparsify as sparsify_module
from sparsecnn.tuning import whole_model
from sparsecnn.tuning.model_decision import ModelDecision
from sparsecnn.tuning.sparsify import autotune_model

LAYERS = {"dense": 2.0, "im2col-cublas": 1.0, "im2col-cusparse": 3.0}


class ScriptedTimer:
    """Scripted ms per candidate backend (1.0 when not scripted; 100 for the model as given); runs
    each candidate once and records what it timed."""

    def __init__(self, ms):
        self.ms, self.timed = ms, []

    def probe(self, candidate, fn):
        return self.measure(candidate, fn)

    def measure(self, candidate, fn):
        self.timed.append(candidate.backend)
        fn()
        return self.ms.get(candidate.backend, 100.0 if candidate.backend == "model:given" else 1.0)


def _model(activation=nn.ReLU):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), activation(), nn.Conv2d(8, 8, 3, stride=2, padding=1))
    with torch.no_grad():
        for conv in (model[0], model[2]):
            conv.weight.copy_(sparse_weight(conv.weight.shape, 0.8))
    return model.eval()


def _tune(model, x, cache_dir, ms, **kwargs):
    timer = ScriptedTimer({**LAYERS, **ms})
    return autotune_model(model, x, cache_dir=cache_dir, timer=timer, progress=False, **kwargs), timer


@pytest.fixture
def given_checked(monkeypatch):
    monkeypatch.setattr(whole_model, "GIVEN_CHECK_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("ms, kept, running", [
    ({"model:tuned": 3.0, "model:dense": 4.0, "model:switch 0": 3.5, "model:switch 2": 2.5}, "tuned",
     ["im2col-cublas", "dense"]),
    ({"model:tuned": 5.0, "model:dense": 4.0, "model:switch 0": 3.0, "model:switch 2": 4.5}, "dense",
     ["im2col-cublas", "dense"]),
    ({"model:tuned": 5.0, "model:dense": 4.0, "model:switch 0": 10.0, "model:switch 2": 10.0, "model:given": 2.0},
     "given", [nn.Conv2d, nn.Conv2d]),
])
def test_a_reload_times_nothing_and_ends_as_the_first_tuning(tmp_path, given_checked, ms, kept, running):
    x = torch.randn(2, 3, 12, 12)
    first_model = _model()
    ref = first_model(x)
    first, first_timer = _tune(first_model, x, tmp_path, ms)
    assert first.model_check.kept == kept and not first.model_check.cached
    assert "model:given" in first_timer.timed and "model:tuned" in first_timer.timed

    model = _model()
    report, timer = _tune(model, x, tmp_path, ms)
    assert timer.timed == []
    check = report.model_check
    assert check.cached and "from the cache" in check.format()
    assert (check.kept, check.switched, check.final_ms, check.given_ms) == (
        first.model_check.kept, first.model_check.switched, first.model_check.final_ms, first.model_check.given_ms)
    if kept == "given":
        assert [type(model[0]), type(model[2])] == running
    else:
        assert [model[0].backend, model[2].backend] == running == [first_model[0].backend, first_model[2].backend]
    assert [layer.cache for layer in report.layers] == ["hit", "hit"]
    assert {"linears", "layouts", "model as given", "model check"}.isdisjoint(report.phase_s)
    assert relative_error(model(x), ref) < 1e-6 and report.max_rel_error < 1e-6


def test_retune_times_the_model_again(tmp_path, given_checked):
    x = torch.randn(2, 3, 12, 12)
    _tune(_model(), x, tmp_path, {})
    report, timer = _tune(_model(), x, tmp_path, {}, retune=True)
    assert "model:tuned" in timer.timed and "model:given" in timer.timed and not report.model_check.cached


@pytest.mark.parametrize("change", ["structure", "input shape", "layer tuned anew", "model as given"])
def test_what_could_change_the_decision_times_the_model_again(tmp_path, given_checked, change):
    x = torch.randn(2, 3, 12, 12)
    _tune(_model(), x, tmp_path, {})
    model = _model(nn.Tanh if change == "structure" else nn.ReLU)
    if change == "input shape":
        x = torch.randn(2, 3, 14, 14)
    if change == "layer tuned anew":  # one layer's entry gone: it is tuned again, and so is the model
        layer_files = [path for path in tmp_path.glob("*.json") if not path.name.startswith("model-")]
        min(layer_files).unlink()
    if change == "model as given":  # a model already sparsified on another backend runs otherwise as given
        first = copy.deepcopy(_model())
        autotune_model(first, x, cache_dir=tmp_path / "elsewhere", timer=ScriptedTimer({"im2col-cublas": 5.0}),
                       progress=False)
        model = first
    report, timer = _tune(model, x, tmp_path, {})
    assert "model:tuned" in timer.timed and not report.model_check.cached


def test_a_damaged_model_entry_is_timed_again_and_rewritten(tmp_path, given_checked):
    x = torch.randn(2, 3, 12, 12)
    _tune(_model(), x, tmp_path, {})
    (entry,) = tmp_path.glob("model-*.json")
    entry.write_text(entry.read_text()[:40])
    report, timer = _tune(_model(), x, tmp_path, {})
    assert "model:tuned" in timer.timed and not report.model_check.cached
    assert json.loads(entry.read_text())["decision"]["check"]["kept"] == report.model_check.kept
    _, timer = _tune(_model(), x, tmp_path, {})
    assert timer.timed == []


def test_the_model_entry_names_every_layer_key(tmp_path):
    x = torch.randn(2, 3, 12, 12)
    report, _ = _tune(_model(), x, tmp_path, {})
    (entry,) = tmp_path.glob("model-*.json")
    saved = json.loads(entry.read_text())
    assert saved["model"]["layers"] == [[layer.name, layer.key] for layer in report.layers]
    assert all(len(layer.key) == 32 for layer in report.layers)


def test_apply_sets_the_recorded_linear_splits():
    model = nn.Sequential(nn.Flatten(), SplitKLinear(64, 10))
    decision = ModelDecision({}, {}, {"1": {"splits": 4, "ms": 1.0, "dense_ms": 2.0}}, [], {})
    decision = ModelDecision(dict(CHECK), *list(vars(decision).values())[1:])
    assert model_decision.apply(decision, model, {}, lambda: None).cached
    assert model[1].splits == 4


CHECK = {"tuned_ms": 1.0, "dense_ms": 2.0, "dense_backend": "dense", "kept": "tuned", "tuned_eager_ms": None,
         "dense_eager_ms": None, "switched": [], "final_ms": 1.0, "given_ms": None, "shortcuts": [],
         "channels_last_outputs": []}


def test_a_well_formed_decision_is_taken_and_apply_sets_the_channels_last_outputs():
    model = _model()
    tuned = {"0": SparseConv2d.from_dense(model[0]), "2": SparseConv2d.from_dense(model[2])}
    tuned["2"].channels_last_output = True
    saved = {"check": {**CHECK, "channels_last_outputs": ["0"]}, "backends": {}, "linears": {}, "batch_inner": [],
             "layout_ms": {}}
    check = model_decision.apply(ModelDecision.from_json(saved), model, tuned, lambda: None)
    assert check.cached and check.channels_last_outputs == ["0"]
    assert [tuned[name].channels_last_output for name in ("0", "2")] == [True, False]


@pytest.mark.parametrize("saved", [
    None, [], {"check": {}, "backends": {}, "linears": {}, "batch_inner": []},
    {"check": {"kept": "tuned"}, "backends": {}, "linears": {}, "batch_inner": [], "layout_ms": {}},
    {"check": {**CHECK, "kept": "faster"}, "backends": {}, "linears": {}, "batch_inner": [], "layout_ms": {}},
    {"check": {**CHECK, "shortcuts": [["a"]]}, "backends": {}, "linears": {}, "batch_inner": [], "layout_ms": {}},
    {"check": {**CHECK, "channels_last_outputs": [1]}, "backends": {}, "linears": {}, "batch_inner": [],
     "layout_ms": {}},
    {"check": {k: v for k, v in CHECK.items() if k != "channels_last_outputs"}, "backends": {}, "linears": {},
     "batch_inner": [], "layout_ms": {}},
    {"check": CHECK, "backends": {"0": ["dense"]}, "linears": {}, "batch_inner": [], "layout_ms": {}},
])
def test_a_malformed_decision_is_refused(saved):
    with pytest.raises(ValueError, match="model decision"):
        ModelDecision.from_json(saved)


def test_a_reload_prepares_only_the_cached_choices(tmp_path, monkeypatch):
    prefetched = []
    real = sparsify_module.prefetch_candidates

    def recording(*args, candidates, **kwargs):
        prefetched.append([candidate.label() for candidate in candidates])
        return real(*args, candidates=candidates, **kwargs)

    monkeypatch.setattr(sparsify_module, "prefetch_candidates", recording)
    x = torch.randn(2, 3, 12, 12)
    first, _ = _tune(_model(), x, tmp_path, {})
    assert all(len(offered) > 1 for offered in prefetched) and len(prefetched) == 2
    prefetched.clear()
    _tune(_model(), x, tmp_path, {})
    assert prefetched == [[layer.choice] for layer in first.layers]
    prefetched.clear()
    _tune(_model(), x, tmp_path, {}, retune=True)
    assert all(len(offered) > 1 for offered in prefetched)
