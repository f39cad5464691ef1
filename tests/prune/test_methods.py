"""ADMM, gradual and one-shot magnitude pruning, the method registry, checkpoints and `sparsecnn prune`."""
import copy

import pytest
import torch

import sparsecnn
from sparsecnn.cli import main
from sparsecnn.data import Batches, DigitsSplit, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import (
    TrainConfig,
    layer_sparsities,
    load_pruned,
    method_names,
    polynomial_sparsity,
    project_onto_sparsity,
    prune_and_finetune,
    prune_with,
    pruned_layers,
    register_method,
    save_pruned,
    top1_evaluator,
    train_epochs,
)
from sparsecnn.prune import registry
from sparsecnn.prune.methods import top1_accuracy, train_dense_, training_batches


@pytest.fixture(scope="module")
def digits():
    return load_digits_split((1, 28, 28), seed=0)


@pytest.fixture(scope="module")
def small_split(digits):
    """600 training samples keep each pruning run to a second or two; the test split stays whole."""
    return DigitsSplit(digits.train_x[:600], digits.train_y[:600], digits.test_x, digits.test_y)


@pytest.fixture(scope="module")
def dense_lenet(digits):
    torch.manual_seed(0)
    model = build_model("lenet5")
    train_dense_(model, digits, epochs=3, seed=0)
    return model, top1_accuracy(model, digits)


def _measured_sparsity(model, masks) -> dict:
    modules = dict(model.named_modules())
    return {name: 1 - modules[name].weight.count_nonzero().item() / modules[name].weight.numel() for name in masks}


def test_projection_keeps_exactly_the_top_k_with_ties_by_index():
    x = torch.tensor([3.0, -3.0, 1.0, 3.0, 0.5, -2.0])
    assert torch.equal(project_onto_sparsity(x, 0.5), torch.tensor([3.0, -3.0, 0.0, 3.0, 0.0, 0.0]))
    assert torch.equal(project_onto_sparsity(torch.full((2, 4), 7.0), 0.75), torch.tensor([[7.0, 7.0] + [0.0] * 6]).reshape(2, 4))


def test_projection_is_the_nearest_point_with_k_nonzeros():
    x = torch.randn(20, 10, 3, 3, dtype=torch.float64)
    z = project_onto_sparsity(x, 0.9)
    kept = z != 0
    assert kept.sum().item() == round(0.1 * x.numel()) and z.shape == x.shape and z.dtype == x.dtype
    assert torch.equal(z[kept], x[kept])
    assert x[~kept].abs().max() <= x[kept].abs().min()
    assert project_onto_sparsity(x, 0.0).equal(x) and project_onto_sparsity(x, 1.0).count_nonzero() == 0


def test_polynomial_schedule_endpoints_shape_and_monotonicity():
    assert polynomial_sparsity(0, 100, 0.9) == 0.0 and polynomial_sparsity(100, 100, 0.9) == 0.9
    assert polynomial_sparsity(500, 100, 0.9, 0.2) == 0.9 and polynomial_sparsity(-5, 100, 0.9, 0.2) == 0.2
    assert polynomial_sparsity(50, 100, 0.8, 0.0) == pytest.approx(0.8 - 0.8 / 8)
    values = [polynomial_sparsity(step, 40, 0.95, 0.1) for step in range(41)]
    gains = [b - a for a, b in zip(values, values[1:])]
    assert all(gain > 0 for gain in gains) and gains[0] > gains[-1]
    with pytest.raises(ValueError, match="total_steps"):
        polynomial_sparsity(1, 0, 0.9)
    with pytest.raises(ValueError, match="sparsity"):
        polynomial_sparsity(1, 10, 1.5)


def test_default_pruned_layers_leave_out_the_classifier():
    assert [name for name, _ in pruned_layers(build_model("lenet5"))] == ["conv1", "conv2", "fc1"]
    assert [name for name, _ in pruned_layers(build_model("alexnet-cifar"))] == ["conv1", "conv2", "conv3"]
    with pytest.raises(ValueError, match="fc9"):
        layer_sparsities(build_model("lenet5"), {"fc9": 0.5})


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("method, options", [
    ("magnitude", dict(epochs=1)),
    ("gradual", dict(prune_epochs=2, finetune_epochs=1, prune_every=3)),
    ("admm", dict(admm_epochs=2, finetune_epochs=1, rho=3.0)),
])
def test_methods_reach_the_exact_target_and_keep_accuracy(method, options, dense_lenet, small_split):
    dense, dense_top1 = dense_lenet
    model = copy.deepcopy(dense)
    masks = prune_with(method, model, small_split, 0.9, seed=0, **options)
    assert sorted(masks) == ["conv1", "conv2", "fc1"]
    for name, mask in masks.items():
        assert mask.sum().item() == round(0.1 * mask.numel())
        assert torch.equal(model.get_submodule(name).weight != 0, mask)
    assert top1_accuracy(model, small_split) > dense_top1 - 6


def test_admm_leaves_little_for_hard_pruning_to_remove(dense_lenet, small_split):
    """At 98%, hard pruning after three ADMM epochs keeps far more accuracy than pruning the dense model."""
    one_shot, admm = copy.deepcopy(dense_lenet[0]), copy.deepcopy(dense_lenet[0])
    prune_with("magnitude", one_shot, small_split, 0.98, epochs=0)
    prune_with("admm", admm, small_split, 0.98, admm_epochs=3, finetune_epochs=0, rho=3.0, rho_growth=1.5)
    assert top1_accuracy(admm, small_split) > top1_accuracy(one_shot, small_split) + 8


def test_per_layer_targets_prune_only_the_named_layers(dense_lenet, small_split):
    model = copy.deepcopy(dense_lenet[0])
    masks = prune_with("admm", model, small_split, {"conv2": 0.8, "fc1": 0.95}, admm_epochs=1, finetune_epochs=0)
    assert _measured_sparsity(model, masks) == pytest.approx({"conv2": 0.8, "fc1": 0.95}, abs=1e-6)
    assert model.conv1.weight.count_nonzero() == model.conv1.weight.numel()


def test_registering_a_method_is_one_line_and_names_are_checked(monkeypatch, small_split):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    calls = []
    register_method("record", lambda model, split, sparsity, seed, progress, **options: calls.append(options) or {})
    assert "record" in method_names()
    assert prune_with("record", build_model("lenet5"), small_split, 0.5, extra=1) == {} and calls == [{"extra": 1}]
    with pytest.raises(ValueError, match="already registered"):
        register_method("record", print)
    with pytest.raises(ValueError, match="unknown pruning method 'nope'"):
        prune_with("nope", build_model("lenet5"), small_split, 0.5)


def test_checkpoint_round_trip_and_dense_sparsify(tmp_path, dense_lenet, small_split):
    model = copy.deepcopy(dense_lenet[0])
    masks = prune_with("magnitude", model, small_split, 0.9, epochs=0)
    path = tmp_path / "lenet5.pt"
    save_pruned(path, "lenet5", model, masks, {"top1": 97.5, "layers": [{"layer": "conv1", "shape": (20, 1, 5, 5)}]})
    loaded, loaded_masks, report = load_pruned(path)
    assert report["top1"] == 97.5 and list(report["layers"][0]["shape"]) == [20, 1, 5, 5]
    assert loaded_masks.keys() == masks.keys() and all(torch.equal(loaded_masks[k], masks[k]) for k in masks)
    x = small_split.test_x[:16]
    model.eval()
    expected = model(x).double()
    sparsecnn.sparsify_(loaded.eval(), x, backend="dense", masks=loaded_masks)
    assert isinstance(loaded.conv2, sparsecnn.nn.SparseConv2d)
    assert (loaded(x).double() - expected).norm() / expected.norm() < 1e-6


def test_checkpoint_load_refuses_pickled_objects_and_foreign_files(tmp_path):
    pickled = tmp_path / "evil.pt"
    torch.save({"format": "sparsecnn-pruned", "payload": _Custom()}, pickled)
    with pytest.raises(ValueError, match="refused"):
        load_pruned(pickled)
    state_dict_only = tmp_path / "state.pt"
    torch.save(build_model("lenet5").state_dict(), state_dict_only)
    with pytest.raises(ValueError, match="not a sparsecnn"):
        load_pruned(state_dict_only)
    with pytest.raises(TypeError, match="JSON"):
        save_pruned(tmp_path / "x.pt", "lenet5", build_model("lenet5"), {}, {"bad": _Custom()})


class _Custom:
    pass


@pytest.mark.slow
def test_cli_prune_writes_a_checkpoint_that_loads_and_continues(tmp_path, capsys):
    first, second = tmp_path / "gradual.pt", tmp_path / "magnitude.pt"
    assert main(["prune", "lenet5", "--method", "gradual", "--sparsity", "0.8", "--data", "digits", "-o", str(first),
                 "--epochs", "1", "--finetune-epochs", "1", "--seed", "1", "--device", "cpu",
                 "--quantize", "kmeans16-int8"]) == 0
    out = capsys.readouterr().out
    assert "| fc1 | 500x800 | 400000 | 80000 | 0.8000 |" in out and "after kmeans16-int8" in out
    model, masks, report = load_pruned(first)
    assert report["method"] == "gradual" and report["top1"] > 50 and report["quantized_top1"] > 50
    assert sorted(masks) == ["conv1", "conv2", "fc1"] and model.fc1.weight.unique().numel() <= 17
    assert main(["prune", "lenet5", "--method", "magnitude", "--sparsity", "0.9", "--from", str(first),
                 "-o", str(second), "--finetune-epochs", "0", "--device", "cpu"]) == 0
    model, masks, report = load_pruned(second)
    assert report["start"] == str(first) and _measured_sparsity(model, masks) == pytest.approx(
        {"conv1": 0.9, "conv2": 0.9, "fc1": 0.9}, abs=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--sparsity", "1.5"], "sparsity must be in [0, 1], got 1.5"),
    (["--method", "nope"], "unknown pruning method 'nope'"),
    (["--from", "missing.pt"], "missing.pt"),
    (["--quantize", "int3"], "unknown scheme 'int3'"),
    (["--tile", "32"], "--tile applies to --method reprune-tiles only, got --method magnitude"),
    (["--method", "reprune-tiles", "--tile", "8"], "--tile must be one of 16, 32, 64 or auto, got '8'"),
    (["--steps", "3"], "--steps applies to --method reprune-tiles or reprune-select (with --unit-shapes), got "
                       "--method magnitude"),
    (["--method", "reprune-select", "--steps", "3"], "--steps applies to --method reprune-select only with "
                                                     "--unit-shapes"),
    (["--method", "reprune-select", "--unit-shapes", "16x16", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--method", "reprune-tiles", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--unit-shapes", "16x16"], "--unit-shapes applies to --method reprune-select only, got --method magnitude"),
    (["--method", "reprune-select", "--unit-shapes", "16x4"], "--unit-shapes must be TILExCHUNK pairs"),
    (["--method", "reprune-select", "--unit-shapes", "16by16"], "--unit-shapes must be TILExCHUNK pairs"),
])
def test_cli_prune_bad_arguments_are_clear_errors(argv, message, tmp_path, capsys):
    assert main(["prune", "lenet5", "-o", str(tmp_path / "x.pt"), "--epochs", "0", "--device", "cpu"] + argv) == 2
    assert message in capsys.readouterr().err


# prune_and_finetune: any model, any DataLoader, any loss (issue 34, item 1).

def _autoencoder():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 1, 3, padding=1))


def _reconstruction_loss(model, batch):
    (images,) = batch
    return torch.nn.functional.mse_loss(model(images), images)


@pytest.fixture(scope="module")
def autoencoder_data(digits):
    """A trained conv autoencoder of 14x14 digits and a DataLoader of image-only batches."""
    images = torch.nn.functional.avg_pool2d(digits.train_x[:384], 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model = _autoencoder()
    train_epochs(model, loader, TrainConfig(epochs=3, lr=0.05), _reconstruction_loss)
    return model, loader, images


@pytest.mark.parametrize("method, options", [("magnitude", {}), ("gradual", dict(prune_epochs=2, prune_every=4))])
def test_prune_and_finetune_a_non_classifier_with_its_own_loss(method, options, autoencoder_data):
    dense, loader, images = autoencoder_data

    def evaluate(model):
        with torch.no_grad():
            return _reconstruction_loss(model.eval(), (images,)).item()

    one_shot = copy.deepcopy(dense)
    prune_and_finetune(one_shot, 0.5, loader, loss=_reconstruction_loss, train=TrainConfig(epochs=0))
    model = copy.deepcopy(dense)
    masks, report = prune_and_finetune(model, 0.5, loader, method=method, loss=_reconstruction_loss,
                                       train=TrainConfig(epochs=3, lr=0.02, seed=1), evaluate=evaluate, **options)
    assert sorted(masks) == ["0", "2", "4"] and report["method"] == method
    for name, mask in masks.items():
        assert mask.sum().item() == round(0.5 * mask.numel())
        assert torch.equal(model.get_submodule(name).weight != 0, mask)
    assert report["sparsity"] == pytest.approx({"0": 0.5, "2": 0.5, "4": 0.5}, abs=1e-6)
    assert report["metric_before"] == pytest.approx(evaluate(dense))
    assert report["metric"] == evaluate(model) < evaluate(one_shot)
    assert report["loss"] > 0


def test_prune_and_finetune_on_digits_is_the_magnitude_method(dense_lenet, small_split):
    """The registered digits method is one use of prune_and_finetune: the same weights, bit for bit."""
    by_method, direct = copy.deepcopy(dense_lenet[0]), copy.deepcopy(dense_lenet[0])
    masks = prune_with("magnitude", by_method, small_split, 0.9, seed=3, epochs=1)
    test = Batches(small_split.test_x, small_split.test_y, 512)
    direct_masks, report = prune_and_finetune(direct, 0.9, training_batches(direct, small_split, 64, seed=3),
                                              train=TrainConfig(epochs=1, seed=3), evaluate=top1_evaluator(test))
    assert all(torch.equal(masks[name], direct_masks[name]) for name in masks)
    for a, b in zip(by_method.parameters(), direct.parameters()):
        assert torch.equal(a, b)
    assert report["metric"] == top1_accuracy(direct, small_split)


def test_prune_and_finetune_rejects_unknown_methods_options_and_one_shot_batches(small_split):
    model, batches = build_model("lenet5"), [(small_split.train_x[:8], small_split.train_y[:8])]
    with pytest.raises(ValueError, match="unknown method 'admm'"):
        prune_and_finetune(model, 0.5, batches, method="admm")
    with pytest.raises(TypeError, match="no option 'prune_every'"):
        prune_and_finetune(model, 0.5, batches, prune_every=3)
    with pytest.raises(TypeError, match="batches must be re-iterable"):
        prune_and_finetune(model, 0.5, iter(batches))
    with pytest.raises(TypeError, match="batches must have a length"):
        prune_and_finetune(model, 0.5, _Unsized(batches), method="gradual")


class _Unsized:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)
