"""SplitKLinear: split-K values against F.linear, fallbacks, extra state, the swap in
prepare_for_inference, and tune_linears' choice (fake timings on CPU, real ones on a GPU)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.models import build_model
from sparsecnn.nn import SplitKLinear
from sparsecnn.nn.linear import split_candidates
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.tuning import MeasuringTimer, tf32_flags
from sparsecnn.tuning import linears as linear_module
from sparsecnn.tuning.linears import time_splits, tune_linears
from sparsecnn.tuning.sparsify import autotune_model


class LabelTimer:
    """Scripted median ms per candidate label ("linear:<path>[<splits>]"), 1.0 otherwise; runs each
    candidate once (so its computation really works) and records the labels it timed."""

    def __init__(self, ms=None):
        self.ms, self.timed = ms or {}, []

    def measure(self, candidate, fn):
        self.timed.append(candidate.label())
        fn()
        return self.ms.get(candidate.label(), 1.0)

    probe = measure


class ForbiddenTimer:
    def measure(self, candidate, fn):
        raise AssertionError(f"timed {candidate.label()} on the CPU")

    probe = measure


def _lenet():
    return prepare_for_inference(build_model("lenet5").eval())


def _time_on_cpu(monkeypatch):
    """Let tune_linears time CPU layers, as it times CUDA ones."""
    monkeypatch.setattr(linear_module, "_may_tune", lambda layer: len(split_candidates(layer.in_features)) > 1)
    monkeypatch.setattr(linear_module, "_tunable", lambda layer, x: linear_module._may_tune(layer) and x.dim() == 2)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [3, 32])
@pytest.mark.parametrize("in_features", [256, 512])
@pytest.mark.parametrize("bias", [True, False])
def test_split_k_equals_f_linear(splits, batch, in_features, bias):
    layer = SplitKLinear(in_features, 48, bias=bias, splits=splits)
    if bias:
        nn.init.normal_(layer.bias)
    x = torch.randn(batch, in_features)
    with torch.no_grad():
        out = layer(x)
    reference = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert out.shape == (batch, 48) and out.dtype == torch.float32
    assert relative_error(out, reference) < 1e-5
    assert relative_error(out, F.linear(x, layer.weight, layer.bias)) < 1e-5


def test_other_ranks_fall_back_to_f_linear(monkeypatch):
    layer = SplitKLinear(256, 16, splits=4)

    def refuse(*args):
        raise AssertionError("split-K ran on a 3-D input")

    monkeypatch.setattr(linear_module, "split_k_linear", refuse)
    for x in (torch.randn(2, 3, 256), torch.randn(256)):
        with torch.no_grad():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("splits", [0, -2, 3, 2.0, True, "4", None])
def test_invalid_splits_are_a_clear_error(splits):
    with pytest.raises(ValueError, match="splits"):
        SplitKLinear(256, 8, splits=splits)
    with pytest.raises(ValueError, match="splits"):
        SplitKLinear(256, 8).set_extra_state({"splits": splits})


def test_extra_state_without_splits_is_a_clear_error():
    with pytest.raises(ValueError, match="splits"):
        SplitKLinear(256, 8).set_extra_state({})


def test_splits_travel_in_the_state_dict_and_from_module_shares_parameters():
    layer = SplitKLinear(512, 16, splits=8)
    copy = SplitKLinear(512, 16)
    copy.load_state_dict(layer.state_dict())
    assert copy.splits == 8 and "splits=8" in repr(copy) and torch.equal(copy.weight, layer.weight)
    dense = nn.Linear(512, 16, bias=False).eval()
    swapped = SplitKLinear.from_module(dense)
    assert swapped.weight is dense.weight and swapped.bias is None and swapped.splits == 1 and not swapped.training
    assert [name for name, _ in swapped.named_parameters()] == ["weight"]


@pytest.mark.parametrize("name, shape, swapped", [("lenet5", (2, 1, 28, 28), ["fc1", "fc2"]),
                                                  ("alexnet-cifar", (2, 3, 32, 32), ["fc"])])
def test_prepare_for_inference_swaps_the_linears(name, shape, swapped):
    model = build_model(name).eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.swapped_linears == swapped
    assert f"{len(swapped)} linears" in gm.fuse_report.summary()
    for path in swapped:
        layer = gm.get_submodule(path)
        assert type(layer) is SplitKLinear and layer.splits == 1
        assert torch.equal(layer.weight, model.get_submodule(path).weight)
    x = torch.randn(shape)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6
    again = prepare_for_inference(gm)  # SplitKLinear traces as a leaf and is not swapped twice
    assert again.fuse_report.swapped_linears == []
    assert all(type(again.get_submodule(path)) is SplitKLinear for path in swapped)


def test_a_shared_linear_subclass_is_swapped_once_and_one_with_its_own_forward_is_kept():
    fake_quantised = torch.ao.nn.qat.Linear(8, 4, qconfig=torch.ao.quantization.get_default_qat_qconfig())

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.custom = nn.modules.linear.NonDynamicallyQuantizableLinear(8, 8), fake_quantised

        def forward(self, x):
            return self.custom(self.shared(self.shared(x)))

    model = Model().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.swapped_linears == ["shared"]
    assert type(gm.shared) is SplitKLinear and type(gm.custom) is type(fake_quantised)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


def test_split_candidates_keep_slices_of_at_least_128_features():
    assert split_candidates(25088) == [1, 2, 4, 8, 16, 32]
    assert split_candidates(2048) == [1, 2, 4, 8, 16]
    assert split_candidates(800) == [1, 2, 4]
    assert split_candidates(200) == [1]


@pytest.mark.parametrize("ms, chosen", [({"linear:fc[4]": 0.4, "linear:fc[2]": 0.7}, 4),
                                        ({"linear:fc[1]": 0.5, "linear:fc[2]": 0.5, "linear:fc[4]": 0.6}, 1)])
def test_time_splits_keeps_the_fastest(ms, chosen):
    layer = SplitKLinear(800, 10)
    timer = LabelTimer(ms)
    result = time_splits("fc", layer, torch.randn(4, 800), timer)
    assert timer.timed == ["linear:fc[1]", "linear:fc[2]", "linear:fc[4]"]
    assert layer.splits == chosen and result == {"splits": chosen, "ms": ms.get(f"linear:fc[{chosen}]", 1.0),
                                                 "dense_ms": ms.get("linear:fc[1]", 1.0)}


def test_tune_linears_times_nothing_on_the_cpu():
    gm = _lenet()
    assert tune_linears(gm, (torch.randn(2, 1, 28, 28),), ForbiddenTimer()) == ({}, None)
    assert gm.fc1.splits == gm.fc2.splits == 1


def test_tune_linears_sets_each_layers_fastest_split(monkeypatch):
    _time_on_cpu(monkeypatch)
    gm, x = _lenet(), torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        reference = gm(x)
        timer = LabelTimer({"linear:fc1[4]": 0.25, "linear:fc1[1]": 0.5})
        results, output = tune_linears(gm, (x,), timer)
    assert results == {"fc1": {"splits": 4, "ms": 0.25, "dense_ms": 0.5},
                       "fc2": {"splits": 1, "ms": 1.0, "dense_ms": 1.0}}
    assert timer.timed == ["linear:fc1[1]", "linear:fc1[2]", "linear:fc1[4]", "linear:fc2[1]", "linear:fc2[2]"]
    assert (gm.fc1.splits, gm.fc2.splits) == (4, 1)
    assert relative_error(output, reference) < 1e-5


def test_autotune_model_reports_the_linears(tmp_path, monkeypatch):
    gm, x = _lenet(), torch.randn(2, 1, 28, 28)
    report = autotune_model(gm, x, cache_dir=tmp_path, timer=LabelTimer(), progress=False)
    assert report.linears == {} and "linears" in report.phase_s and "linears (" not in report.format()
    _time_on_cpu(monkeypatch)
    gm = _lenet()
    with torch.no_grad():
        reference = gm(x)
    report = autotune_model(gm, x, cache_dir=tmp_path / "timed", timer=LabelTimer({"linear:fc1[2]": 0.25}),
                            progress=False)
    assert report.linears["fc1"] == {"splits": 2, "ms": 0.25, "dense_ms": 1.0} and gm.fc1.splits == 2
    assert "fc1 splits=2 4.00x" in report.format() and report.max_rel_error < 1e-5
    with torch.no_grad():
        assert relative_error(gm(x), reference) < 1e-5
    reloaded, timer = _lenet(), LabelTimer()
    report = autotune_model(reloaded, x, cache_dir=tmp_path / "timed", timer=timer, progress=False)
    assert timer.timed == [] and reloaded.fc1.splits == 2 and report.linears["fc1"]["splits"] == 2


@pytest.mark.gpu
@pytest.mark.timing
def test_tune_linears_on_cuda_picks_a_split_that_matches_f_linear():
    model = nn.Sequential(SplitKLinear(4096, 1024), nn.ReLU(), SplitKLinear(1024, 1000)).cuda().eval()
    x = torch.randn(32, 4096, device="cuda")
    with torch.no_grad(), tf32_flags(False):
        results, output = tune_linears(model, (x,), MeasuringTimer(torch.device("cuda")))
    assert set(results) == {"0", "2"}
    for name, result in results.items():
        layer = model.get_submodule(name)
        assert result["splits"] == layer.splits and result["splits"] in split_candidates(layer.in_features)
        assert result["ms"] <= result["dense_ms"]
    with torch.no_grad(), tf32_flags(False):
        hidden = torch.relu(F.linear(x, model[0].weight, model[0].bias))
        expected = F.linear(hidden, model[2].weight, model[2].bias)
        assert relative_error(model(x), expected) < 1e-5 and relative_error(output, expected) < 1e-5
