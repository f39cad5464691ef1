"""The digits data and the masked training loop every pruning method fine-tunes with."""
import pytest
import torch

from sparsecnn.data import Batches, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import magnitude_mask
from sparsecnn.prune.training import (
    accuracy,
    apply_masks_,
    mean_gradients,
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
    train_epochs(model, Batches(digits.train_x, digits.train_y, 64, shuffle=True), epochs=2, lr=0.02, masks=masks)
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
