"""UnSparse-Opt Algorithm 2: importance, kept-count arithmetic, mutation/crossover, whole runs."""
import random

import pytest
import torch

from sparsecnn.data import DigitsSplit, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import prune_with
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
