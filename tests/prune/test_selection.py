"""OptPrune's selection rule (paper 000, Sec. 5): config checks, which layers, the B3 search, and
method "reprune-select" end to end on lenet5 (CPU; `blocks` timed under the interpreter)."""
import pytest
import torch
from helpers.common import needs_interpreter

from sparsecnn.data import load_digits_split
from sparsecnn.data.digits import DigitsSplit
from sparsecnn.models import build_model
from sparsecnn.prune import (
    SelectionConfig,
    layers_to_reprune,
    magnitude_mask,
    prune_with,
    search_b3,
)
from sparsecnn.tuning import block_gains


@pytest.fixture(scope="module")
def small_digits():
    split = load_digits_split((1, 28, 28), seed=0)
    return DigitsSplit(split.train_x[:240], split.train_y[:240], split.test_x, split.test_y)


def pruned_lenet5():
    torch.manual_seed(0)
    model = build_model("lenet5")
    masks = {name: magnitude_mask(getattr(model, name).weight, 0.9) for name in ("conv1", "conv2", "fc1")}
    with torch.no_grad():
        for name, mask in masks.items():
            getattr(model, name).weight.mul_(mask)
    return model, masks


@pytest.mark.parametrize("field, value", [("gain_threshold", 0), ("b3_values", ()), ("b3_values", (0.2, 1.5)),
                                          ("accuracy_budget", -1), ("holdout", 1.0), ("holdout", 0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SelectionConfig.{field}"):
        SelectionConfig(**{field: value})


def test_config_tries_the_largest_b3_first():
    assert SelectionConfig(b3_values=(0.1, 0.3, 0.2)).b3_values == (0.3, 0.2, 0.1)


def test_layers_below_the_gain_threshold_are_re_pruned():
    gains = {"conv1": 2.0, "conv2": 1.2, "layer.conv": 0.0, "last": 1.5}
    assert layers_to_reprune(gains, 1.5) == ["conv2", "layer.conv"]


def test_the_method_needs_a_gain_measurement(small_digits):
    with pytest.raises(ValueError, match="measure_gains"):
        prune_with("reprune-select", build_model("lenet5"), small_digits, 0.9, epochs=0)


def _scripted_top1(scores):
    """top1(model) returning the next of `scores` per call (the first is the baseline's)."""
    calls = iter(scores)
    return lambda model: next(calls)


def test_search_takes_the_first_b3_within_the_budget_and_loads_it():
    model, masks = pruned_lenet5()
    conv1_before = model.conv1.weight.detach().clone()
    retrained = []
    config = SelectionConfig(b3_values=(0.3, 0.2, 0.1), accuracy_budget=0.5)
    chosen, report = search_b3(model, masks, ["conv2"], config, lambda trial, m: retrained.append(m),
                               _scripted_top1([90.0, 88.0, 89.6, 95.0]))
    assert report.trials == [(0.3, 88.0), (0.2, 89.6)] and report.b3 == 0.2 and report.baseline_top1 == 90.0
    assert len(retrained) == 2 and retrained[-1] is chosen
    assert torch.equal(model.conv1.weight, conv1_before) and chosen["conv1"] is masks["conv1"]
    assert not model.conv2.weight[~chosen["conv2"]].any()
    assert int(torch.count_nonzero(model.conv2.weight)) < int(masks["conv2"].sum())  # re-pruning removed weights
    assert "B3 = 0.2" in report.summary()


def test_search_keeps_the_unstructured_model_when_no_b3_is_within_the_budget():
    model, masks = pruned_lenet5()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    chosen, report = search_b3(model, masks, ["conv1", "conv2"], SelectionConfig(b3_values=(0.2, 0.1)),
                               lambda trial, m: None, _scripted_top1([90.0, 80.0, 89.0]))
    assert chosen is masks and report.b3 is None and [b3 for b3, _ in report.trials] == [0.2, 0.1]
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert "unstructured masks kept" in report.summary()


@needs_interpreter
@pytest.mark.slow
def test_reprune_select_method_end_to_end(small_digits):
    torch.manual_seed(0)
    model = build_model("lenet5")
    selection = SelectionConfig(gain_threshold=1e9, b3_values=(0.2,), accuracy_budget=100.0)  # every conv, any top-1
    def gains_on_two_images(model, inputs, convs):  # real `blocks` timings; 2 images keep the interpreter short
        return block_gains(model, (inputs[0][:2],), convs)

    masks = prune_with("reprune-select", model, small_digits, 0.9, epochs=1, retrain_epochs=1,
                       batch_size=16, selection=selection, measure_gains=gains_on_two_images)
    report = model.sparsecnn_selection
    assert set(report.gains) == {"conv1", "conv2"} and report.layers == ["conv1", "conv2"] and report.b3 == 0.2
    assert set(masks) == {"conv1", "conv2", "fc1"}
    for name, mask in masks.items():
        assert not getattr(model, name).weight[~mask].any()
    assert int(torch.count_nonzero(model.conv1.weight)) < round(0.1 * model.conv1.weight.numel())  # re-pruned

