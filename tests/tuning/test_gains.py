"""`tuning.block_gains`: backend `blocks` timed against dense per named conv, the model left alone."""
import pytest
import torch
from helpers.common import needs_cuda, needs_interpreter

from sparsecnn.models import build_model
from sparsecnn.prune import magnitude_mask
from sparsecnn.tuning import block_gains


def pruned_lenet5(device="cpu"):
    torch.manual_seed(0)
    model = build_model("lenet5")
    with torch.no_grad():
        for name in ("conv1", "conv2"):
            weight = getattr(model, name).weight
            weight.mul_(magnitude_mask(weight, 0.9))
    return model.to(device)


@pytest.mark.slow
@needs_interpreter
def test_only_the_named_convs_are_timed_and_the_model_is_left_alone():
    model = pruned_lenet5()
    gains = block_gains(model, (torch.randn(2, 1, 28, 28),), ["conv2"])
    # Under the interpreter blocks is far slower than dense: dropped after one run, gain 0.0.
    assert list(gains) == ["conv2"] and gains["conv2"] >= 0.0
    assert type(model.conv2) is torch.nn.Conv2d


@pytest.mark.gpu
@pytest.mark.timing
@needs_cuda
def test_gains_are_measured_on_cuda():
    model = pruned_lenet5("cuda")
    gains = block_gains(model, (torch.randn(32, 1, 28, 28, device="cuda"),), ["conv1", "conv2"])
    # > 0 where blocks was timed; 0.0 where the tuner dropped it after one run as far slower than dense
    assert set(gains) == {"conv1", "conv2"} and all(0.0 <= gain < float("inf") for gain in gains.values()), gains
    assert type(model.conv1) is torch.nn.Conv2d
