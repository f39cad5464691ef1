"""UnSparse-Opt Algorithm 2: importance, kept-count arithmetic, mutation/crossover, whole runs,
killed runs resumed from their run state."""
import logging
import math
import random

import pytest
import torch
from torch import nn

from sparsecnn.data import DigitsSplit, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import RunState, TrainConfig, prune_with
from sparsecnn.prune.evolutionary import (
    EvolutionSettings,
    PrunedLayer,
    crossover_keep_counts,
    evolutionary_prune_,
    fit_keep_counts,
    importance,
    importance_mask,
    increment_keep_counts,
    layers_under_pruning,
    mutate_keep_counts,
)

TINY = dict(population=3, generations=2, final_epochs=0, batch_size=128)


@pytest.fixture(scope="module")
def small_digits():
    """A 400-image training subset keeps each tiny run to about a second."""
    split = load_digits_split((1, 28, 28), seed=0)
    return DigitsSplit(split.train_x[:400], split.train_y[:400], split.test_x, split.test_y)


def layers_for(uniform: bool):
    return [PrunedLayer("a", 60, 5, 5 if uniform else 1, 5), PrunedLayer("b", 700, 7, 7 if uniform else 1, 7),
            PrunedLayer("c", 33, 3, 3 if uniform else 1, 3)]


def assert_valid(layers, keep, target_keep):
    for layer in layers:
        assert layer.min_keep <= keep[layer.name] <= layer.numel
        assert keep[layer.name] % layer.unit == 0
    assert sum(keep.values()) > target_keep - max(layer.unit for layer in layers)


def test_importance_is_eq_12_on_hand_built_tensors():
    weight = torch.tensor([[1.0, -2.0], [0.0, 0.5]])
    gradient = torch.tensor([[-0.5, 0.0], [3.0, 0.1]])
    expected = torch.tensor([[0.05 + 0.9, 1.8], [0.3, 0.01 + 0.45]])
    torch.testing.assert_close(importance(weight, gradient, 0.1), expected)
    with pytest.raises(ValueError, match="mean_gradient shape"):
        importance(weight, gradient[0], 0.1)


def test_importance_mask_keeps_top_scores_globally_or_per_channel():
    scores = torch.rand(4, 3, 2, 2)
    mask = importance_mask(scores, 20)
    assert int(mask.sum()) == 20 and scores[mask].min() >= scores[~mask].max()
    per_channel = importance_mask(scores, 8, per_channel=True)
    assert per_channel.reshape(4, -1).sum(dim=1).tolist() == [2, 2, 2, 2]
    for row_scores, row_mask in zip(scores.reshape(4, -1), per_channel.reshape(4, -1)):
        assert row_scores[row_mask].min() >= row_scores[~row_mask].max()
    with pytest.raises(ValueError, match="multiple of 4"):
        importance_mask(scores, 9, per_channel=True)


def test_fit_keep_counts_lands_exactly_or_within_one_unit():
    layers = layers_for(uniform=False)
    current = {"a": 60, "b": 700, "c": 33}
    fitted = fit_keep_counts(layers, current, {"a": 10, "b": 100, "c": 33}, target_keep=400)
    assert sum(fitted.values()) == 400 and fitted["c"] == 33
    uniform = layers_for(uniform=True)
    fitted = fit_keep_counts(uniform, current, {"a": 10, "b": 105, "c": 3}, target_keep=401)
    assert_valid(uniform, fitted, 401)
    assert sum(fitted.values()) <= 401
    assert fit_keep_counts(layers, current, {"a": 50, "b": 690, "c": 33}, 400) == {"a": 50, "b": 690, "c": 33}


@pytest.mark.parametrize("uniform", [False, True])
def test_increment_mutation_and_crossover_keep_valid_counts(uniform):
    layers, rng = layers_for(uniform), random.Random(0)
    names = [layer.name for layer in layers]
    target_keep = 200
    keep = {layer.name: layer.numel for layer in layers}
    parent = dict(keep)
    for _ in range(200):
        steps = {name: rng.uniform(0.01, 0.5) for name in names}
        chosen = rng.sample(names, rng.randint(1, 3))
        move = rng.choice(["increment", "mutate", "cross"])
        if move == "increment":
            keep = increment_keep_counts(layers, keep, steps, chosen, target_keep)
        elif move == "mutate":
            keep = mutate_keep_counts(layers, keep, steps, chosen, rng.gauss(0, 1), target_keep)
        else:
            for name in crossover_keep_counts(layers, keep, parent, chosen, target_keep):
                keep[name] = parent[name]
        assert_valid(layers, keep, target_keep)
        if rng.random() < 0.3:
            parent = dict(keep)


def test_registered_method_reaches_weighted_target_exactly(small_digits):
    model = build_model("lenet5")
    masks = prune_with("evolutionary", model, small_digits, 0.8, seed=1, epochs=0, population=3, generations=2,
                       batch_size=128)
    total = sum(mask.numel() for mask in masks.values())
    assert list(masks) == ["conv1", "conv2", "fc1"]
    assert sum(int(mask.sum()) for mask in masks.values()) == round(0.2 * total)
    for name, mask in masks.items():
        assert not model.get_submodule(name).weight[~mask].any()


def test_evolutionary_prune_uniform_per_channel(small_digits):
    model = build_model("lenet5")
    targets = {"conv1": 0.5, "conv2": 0.9}
    masks = evolutionary_prune_(model, small_digits, targets, seed=0, uniform_per_channel=True,
                                initial_step=0.5, **TINY)
    for name, mask in masks.items():
        per_channel = mask.reshape(mask.shape[0], -1).sum(dim=1)
        assert (per_channel == per_channel[0]).all()
        assert abs(per_channel[0].item() - (1 - targets[name]) * mask[0].numel()) <= 0.5


def test_per_layer_targets_are_exact_and_floats_cap_each_layer():
    model = build_model("lenet5")
    layers = layers_under_pruning(model, {"conv2": 0.8, "fc2": 0.5}, EvolutionSettings())
    assert [(layer.name, layer.min_keep) for layer in layers] == [("conv2", 5000), ("fc2", 2500)]
    capped = layers_under_pruning(model, 0.9, EvolutionSettings(max_layer_sparsity=0.95, uniform_per_channel=True))
    assert [(layer.name, layer.unit, layer.min_keep) for layer in capped] == [
        ("conv1", 20, 40), ("conv2", 50, 1250), ("fc1", 500, 20000)]


def test_bad_arguments_raise_clear_errors(small_digits):
    model = build_model("lenet5")
    with pytest.raises(ValueError, match="sparsity must be in"):
        evolutionary_prune_(model, small_digits, 1.5)
    with pytest.raises(ValueError, match="population must be >= 1"):
        evolutionary_prune_(model, small_digits, 0.5, population=0)
    with pytest.raises(ValueError, match="alpha must be in"):
        EvolutionSettings(alpha=2.0)
    with pytest.raises(TypeError, match="no_such_option"):
        evolutionary_prune_(model, small_digits, 0.5, no_such_option=1)


class Killed(Exception):
    """Stands for the process being killed."""


# On the tiny CNN from its random start, generations 1-3 are accepted (the ranked list fills), 4 is
# a mutation and 5 a crossover, each rewound. Steps of at most 2 * initial_step cannot reach 0.8 in 5
# generations, so every run makes all five, the last step to the target and 2 epochs of final
# retraining: run-state saves 1-5 follow the generations, 6 the finished search, 7 and 8 the epochs.
RESUMABLE = dict(population=3, generations=5, initial_step=0.05, final_epochs=2, batch_size=128, lr=0.1,
                 min_accuracy_change=2.0)


@pytest.fixture(scope="module")
def digits_8x8():
    return load_digits_split((1, 8, 8), seed=0)


def tiny_cnn() -> nn.Module:
    """Three pruned layers, batch norm buffers and dropout, a few milliseconds a step."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Dropout(0.1), nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10))


def resumable_search(split, state=None, **changes):
    model = tiny_cnn()
    masks = evolutionary_prune_(model, split, changes.pop("sparsity", 0.8), seed=1, train=TrainConfig(state=state),
                                **dict(RESUMABLE, **changes))
    return model, masks


def kill_after_saves(monkeypatch, count):
    """Make the `count`-th run-state write the last: Killed right after it."""
    saves, save = [0], RunState.save

    def save_then_maybe_die(self, *args, **kwargs):
        save(self, *args, **kwargs)
        saves[0] += 1
        if saves[0] == count:
            raise Killed
    monkeypatch.setattr(RunState, "save", save_then_maybe_die)


@pytest.fixture(scope="module")
def uninterrupted(digits_8x8):
    return resumable_search(digits_8x8)


GENERATION = "evolutionary retraining: epoch 1/1"
FINAL = ["evolutionary final retraining: epoch 1/2", "evolutionary final retraining: epoch 2/2"]


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("killed_after_saves, trained_again", [
    (2, [GENERATION] * 3 + FINAL),  # after generation 2: generations 3-5 again
    (3, [GENERATION] * 2 + FINAL),  # after the last accepted one: the mutation rewinds to its weights
    (4, [GENERATION] + FINAL),      # after the mutation: the crossover from the restored ranked list
    (5, FINAL),                     # after the last generation: the last step (no training) again
    (6, FINAL),                     # the search finished
    (7, FINAL[1:]),                 # in the final retraining
    (None, []),                     # never: a finished run does nothing again
])
def test_a_search_killed_after_a_save_resumes_there_and_ends_like_an_uninterrupted_one(
        killed_after_saves, trained_again, digits_8x8, uninterrupted, tmp_path, monkeypatch, caplog):
    path = tmp_path / "run.state"
    with monkeypatch.context() as patch:
        kill_after_saves(patch, killed_after_saves)
        if killed_after_saves is None:
            resumable_search(digits_8x8, RunState(path))
        else:
            with pytest.raises(Killed):
                resumable_search(digits_8x8, RunState(path))
    assert path.exists() and not list(tmp_path.glob(".*.tmp"))
    with caplog.at_level(logging.INFO, logger="sparsecnn.prune"):
        resumed, resumed_masks = resumable_search(digits_8x8, RunState(path))
    assert [record.getMessage().split(",")[0] for record in caplog.records] == trained_again
    model, masks = uninterrupted
    assert sorted(resumed_masks) == sorted(masks) == ["0", "3", "7"]
    for name, mask in masks.items():
        assert torch.equal(resumed_masks[name], mask), name
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("change, named", [
    (dict(population=4), "population=3 there but 4 here"),
    (dict(sparsity=0.7), "sparsity=0.8 there but 0.7 here"),
    (dict(final_epochs=3, initial_step=0.1), "final_epochs=2 there but 3 here, initial_step=0.05 there but 0.1 here"),
])
def test_a_run_state_of_another_search_is_refused_naming_what_differs(change, named, digits_8x8, tmp_path,
                                                                      monkeypatch):
    path = tmp_path / "run.state"
    with monkeypatch.context() as patch:
        kill_after_saves(patch, 1)
        with pytest.raises(Killed):
            resumable_search(digits_8x8, RunState(path))
    with pytest.raises(ValueError, match=rf"phase 0 \('evolutionary search'\) ran with {named}; delete the file"):
        resumable_search(digits_8x8, RunState(path), **change)


def assert_same(first, second, where="state"):
    """Equal nested state: tensors bitwise, nan equal to nan."""
    assert type(first) is type(second), where
    if isinstance(first, torch.Tensor):
        assert torch.equal(first, second), where
    elif isinstance(first, dict):
        assert list(first) == list(second), where
        for key in first:
            assert_same(first[key], second[key], f"{where}[{key!r}]")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for index, (one, other) in enumerate(zip(first, second)):
            assert_same(one, other, f"{where}[{index}]")
    elif not (isinstance(first, float) and math.isnan(first) and math.isnan(second)):
        assert first == second, where


def test_the_state_a_resumed_search_records_is_the_uninterrupted_ones(digits_8x8, tmp_path, monkeypatch):
    """Everything the file holds after generation 4 (ranked list, steps, rewind point, random
    generators, ...), reached straight or through a kill after generation 2."""
    straight, resumed = tmp_path / "straight.state", tmp_path / "resumed.state"
    for path, kills in ((straight, [4]), (resumed, [2, 2])):
        for count in kills:
            with monkeypatch.context() as patch:
                kill_after_saves(patch, count)
                with pytest.raises(Killed):
                    resumable_search(digits_8x8, RunState(path))
    first, second = (torch.load(path, weights_only=True) for path in (straight, resumed))
    assert first["epoch"] == 4 and first["parts"]["search"]["generation"] == 4
    assert_same(first, second)
