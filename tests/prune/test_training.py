"""The digits data and the masked training loop every pruning method fine-tunes with."""
import weakref

import pytest
import torch

from sparsecnn.data import Batches, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import magnitude_mask
from sparsecnn.prune.training import (
    TrainConfig,
    accuracy,
    apply_masks_,
    classification_loss,
    mean_gradients,
    top1_evaluator,
    train_epochs,
)


@pytest.fixture(scope="module")
def digits():
    return load_digits_split((1, 28, 28), seed=0)


def test_digits_split_is_stratified_seeded_and_standardised(digits):
    assert digits.train_x.shape[1:] == (1, 28, 28) and digits.train_x.shape[0] + digits.test_x.shape[0] == 1797
    assert set(digits.test_y.tolist()) == set(range(10))
    assert abs(digits.train_x.mean().item()) < 1e-4 and abs(digits.train_x.std().item() - 1) < 1e-3
    again = load_digits_split((1, 28, 28), seed=0)
    assert torch.equal(again.test_y, digits.test_y)
    assert not torch.equal(load_digits_split((1, 28, 28), seed=1).test_y, digits.test_y)


def test_digits_repeat_channels_for_rgb_models():
    split = load_digits_split((3, 32, 32))
    assert split.train_x.shape[1:] == (3, 32, 32)
    assert torch.equal(split.train_x[:, 0], split.train_x[:, 2])


def test_batches_cover_every_sample_once_and_reject_mismatch():
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    seen = torch.cat([yb for _, yb in Batches(x, y, 3, shuffle=True, seed=1)])
    assert sorted(seen.tolist()) == list(range(10)) and len(Batches(x, y, 3)) == 4
    with pytest.raises(ValueError, match="samples"):
        Batches(x, y[:5], 3)


def test_short_training_improves_accuracy_and_keeps_masks(digits):
    model = build_model("lenet5")
    test = Batches(digits.test_x, digits.test_y, 512)
    before = accuracy(model, test)
    masks = {"conv2": magnitude_mask(model.conv2.weight, 0.9)}
    train_epochs(model, Batches(digits.train_x, digits.train_y, 64, shuffle=True), TrainConfig(epochs=2, lr=0.02), masks=masks)
    assert accuracy(model, test) > before + 50
    assert torch.equal(model.conv2.weight != 0, masks["conv2"])


def test_apply_masks_rejects_unknown_modules_and_shapes():
    model = build_model("lenet5")
    with pytest.raises(KeyError, match="conv9"):
        apply_masks_(model, {"conv9": torch.ones(1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="shape"):
        apply_masks_(model, {"conv1": torch.ones(3, dtype=torch.bool)})


def test_mean_gradients_match_one_batch_backward(digits):
    model = build_model("lenet5")
    x, y = digits.train_x[:32], digits.train_y[:32]
    grads = mean_gradients(model, [(x, y)], ["conv1"])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(grads["conv1"], model.conv1.weight.grad)


# Any model, any re-iterable batches, any loss (issue 34, item 1).

def _regression_data(n=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=generator)
    return x, x @ torch.randn(6, 3, generator=generator)


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 3)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


class _NoLength(torch.utils.data.IterableDataset):
    """Yields the samples of `x, y` in order and has no `__len__`."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


class _Streamed:
    """Re-iterable batches without a length that count how many of the batches they made are alive."""

    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.alive = self.max_alive = self.made = self.passes = 0

    def _released(self):
        self.alive -= 1

    def __iter__(self):
        self.passes += 1
        for start in range(0, self.x.shape[0], self.batch_size):
            x = self.x[start:start + self.batch_size].clone()
            weakref.finalize(x, self._released)
            self.alive += 1
            self.made += 1
            self.max_alive = max(self.max_alive, self.alive)
            yield x, self.y[start:start + self.batch_size]
            x = None


def test_dataloaders_with_and_without_length_train_like_in_memory_batches():
    x, y = _regression_data()
    as_list = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)]
    config = TrainConfig(epochs=3, lr=0.05, momentum=0.5, weight_decay=1e-4, seed=2)
    reference = _linear()
    first = _mse(reference, (x, y)).item()
    train_epochs(reference, as_list, config, _mse)
    assert _mse(reference, (x, y)).item() < first / 2
    # A DataLoader with a length: the same batches, the same cosine schedule, the same weights.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = _linear()
    train_epochs(model, loader, config, _mse)
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
    # Without a length (len() raises TypeError on such a loader) the learning rate stays constant:
    # the same as a list wrapped so that it hides its length.
    no_length = torch.utils.data.DataLoader(_NoLength(x, y), batch_size=16)
    with pytest.raises(TypeError):
        len(no_length)
    hidden = _Streamed(x, y, 16)
    model, constant_lr = _linear(), _linear()
    last = train_epochs(model, no_length, config, _mse)
    train_epochs(constant_lr, hidden, config, _mse)
    torch.testing.assert_close(model.weight, constant_lr.weight, rtol=0, atol=0)
    assert last < first / 2 and not torch.equal(model.weight, reference.weight)


def test_batches_are_streamed_one_at_a_time_and_iterated_once_per_epoch():
    x, y = _regression_data(n=160)
    batches = _Streamed(x, y, 8)
    masks = {"": torch.rand(3, 6) > 0.5}
    model = _linear()
    train_epochs(model, batches, TrainConfig(epochs=3, lr=0.05), _mse, masks=masks)
    assert batches.passes == 3 and batches.made == 60
    assert batches.max_alive == 1 and batches.alive == 0
    assert torch.equal(model.weight != 0, masks[""])
    assert mean_gradients(model, batches, [""], loss=_mse)[""].shape == (3, 6) and batches.max_alive == 1


def test_one_shot_iterators_are_refused_by_name():
    x, y = _regression_data()
    generator = ((x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16))
    with pytest.raises(TypeError, match="batches must be re-iterable.*generator"):
        train_epochs(_linear(), generator, TrainConfig(epochs=1), _mse)
    with pytest.raises(TypeError, match="batches must be re-iterable"):
        top1_evaluator(iter([(x, y)]))
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        train_epochs(_linear(), [(x, y)], 2, _mse)


@pytest.mark.parametrize("field, value, error", [
    ("epochs", -1, ValueError),
    ("epochs", 1.5, TypeError),
    ("lr", 0.0, ValueError),
    ("lr", float("nan"), TypeError),
    ("momentum", 1.0, ValueError),
    ("weight_decay", -0.1, ValueError),
    ("seed", "0", TypeError),
    ("progress", 1, TypeError),
])
def test_train_config_errors_name_the_field(field, value, error):
    with pytest.raises(error, match=f"TrainConfig.{field} "):
        TrainConfig(**{field: value})
    assert TrainConfig().replace(epochs=2).epochs == 2
    with pytest.raises(error, match=f"TrainConfig.{field} "):
        TrainConfig().replace(**{field: value})


def test_classification_loss_and_top1_evaluator(digits):
    model = build_model("lenet5")
    x, y = digits.train_x[:64], digits.train_y[:64]
    torch.testing.assert_close(classification_loss(model, (x, y)), torch.nn.functional.cross_entropy(model(x), y))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(digits.test_x, digits.test_y), batch_size=100)
    evaluate = top1_evaluator(loader)
    assert evaluate(model) == accuracy(model, Batches(digits.test_x, digits.test_y, 512))
