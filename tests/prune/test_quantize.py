"""UnSparse-Opt quantisation: fixed point, fp16, k-means codebook, and the scheme registry."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.data import Batches, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import prune_magnitude_
from sparsecnn.prune.quantize import (
    QUANTIZERS,
    FixedPointFormat,
    calibrate_input_formats,
    fixed_point_format,
    kmeans_1d,
    quantize_fixed_point,
    quantize_fp16,
    quantize_kmeans,
)
from sparsecnn.prune.training import TrainConfig, accuracy, train_epochs


def pruned_net(seed: int = 0) -> nn.Sequential:
    """Two convs and a Linear head, 80% magnitude-pruned (Linear included)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(2, 6, 3), nn.ReLU(), nn.Conv2d(6, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    prune_magnitude_(model, 0.8, include_linear=True)
    return model


def layer_weights(model: nn.Module):
    return {name: m.weight.detach() for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


def test_fixed_point_format_follows_eq_20_21():
    fmt = fixed_point_format(3.2, 8)
    assert (fmt.int_bits, fmt.frac_bits, fmt.step) == (2, 5, 1 / 32)
    assert (fmt.low, fmt.high) == (-4.0, 4.0 - 1 / 32)
    small = fixed_point_format(0.3, 8)
    assert (small.int_bits, small.frac_bits) == (-1, 8)


def test_fixed_point_rounding_within_half_step_and_saturates():
    fmt = FixedPointFormat(6, 1)
    inside = torch.empty(10_000, dtype=torch.float64).uniform_(fmt.low, fmt.high)
    error = (fmt.quantize(inside) - inside).abs()
    assert error.max() <= fmt.step / 2 and error.max() > fmt.step / 4
    grid = fmt.quantize(inside) / fmt.step
    assert torch.equal(grid, grid.round()) and grid.unique().numel() <= 2 ** 6
    outside = torch.tensor([-100.0, -2.5, 2.5, 100.0])
    assert fmt.quantize(outside).tolist() == [fmt.low, fmt.low, fmt.high, fmt.high]


def test_calibration_saturates_outliers_and_hooks_round_inputs():
    model = nn.Sequential(nn.Conv2d(1, 3, 3))
    x = 0.05 * torch.randn(64, 1, 32, 32)
    x[0, 0, 0, 0] = 3.0
    fmt = calibrate_input_formats(model, x, bits=8)["0"]
    assert fmt.int_bits < fixed_point_format(3.0, 8).int_bits and fmt.high < 3.0
    assert fmt.quantize(x).max() == fmt.high
    quantized, _ = quantize_fixed_point(model, x, bits=8)
    conv = quantized[0]
    expected = F.conv2d(fmt.quantize(x), conv.weight, conv.bias)
    torch.testing.assert_close(quantized(x), expected, rtol=0, atol=0)


def test_fixed_point_weights_keep_zeros_and_lie_on_grid():
    model = pruned_net()
    quantized, report = quantize_fixed_point(model, torch.randn(16, 2, 8, 8), bits=6)
    for (name, weight), row in zip(layer_weights(model).items(), report.layers):
        q = layer_weights(quantized)[name]
        fmt = fixed_point_format(weight.abs().max().item(), 6)
        assert not q[weight == 0].any()
        assert (q - weight).abs().max() <= fmt.step / 2 + 1e-7
        assert row.name == name and row.distinct_values <= 2 ** 6


def test_kmeans_1d_finds_obvious_clusters():
    values = torch.tensor([5.2, 0.0, 1.1, 0.1, 5.0, 1.0])
    centroids, assignment = kmeans_1d(values, 3)
    torch.testing.assert_close(centroids, torch.tensor([0.05, 1.05, 5.1]))
    assert assignment.tolist() == [2, 0, 1, 0, 2, 1]


@pytest.mark.parametrize("centroid_bits", [8, 16])
def test_kmeans_codebook_has_at_most_16_values_and_keeps_zeros(centroid_bits):
    model = pruned_net()
    quantized, report = quantize_kmeans(model, centroids=16, centroid_bits=centroid_bits)
    for name, weight in layer_weights(model).items():
        q = layer_weights(quantized)[name]
        assert not q[weight == 0].any()
        assert q[q != 0].unique().numel() <= 16
        if centroid_bits == 16:
            assert torch.equal(q, q.half().float())
    assert all(row.weight_bits == 4 and row.distinct_values <= 16 for row in report.layers)
    assert all(0 < row.max_abs_error < layer_weights(model)[row.name].abs().max() for row in report.layers)


def test_fp16_keeps_lenet5_digits_accuracy():
    split = load_digits_split((1, 28, 28), seed=0)
    model = build_model("lenet5")
    train_epochs(model, Batches(split.train_x[:600], split.train_y[:600], 64, shuffle=True), TrainConfig(epochs=2, lr=0.02))
    test = Batches(split.test_x, split.test_y, 512)
    quantized, report = quantize_fp16(model)
    assert accuracy(model, test) > 80
    assert abs(accuracy(quantized, test) - accuracy(model, test)) <= 0.6
    assert all(row.max_abs_error <= 1e-3 for row in report.layers)


def test_every_registered_scheme_runs_and_keeps_zeros():
    model, x = pruned_net(), torch.randn(8, 2, 8, 8)
    reference = model(x)
    for name, quantize in QUANTIZERS.items():
        quantized, report = quantize(model, x)
        assert [row.name for row in report.layers] == ["0", "2", "4"], name
        for layer, weight in layer_weights(model).items():
            assert not layer_weights(quantized)[layer][weight == 0].any(), name
        relative = (quantized(x) - reference).norm() / reference.norm()
        assert relative < 0.2, name
    assert torch.equal(model(x), reference)


def test_bad_arguments_raise_clear_errors():
    model, x = pruned_net(), torch.randn(4, 2, 8, 8)
    with pytest.raises(ValueError, match="bits must be an int in"):
        quantize_fixed_point(model, x, bits=0)
    with pytest.raises(ValueError, match="total_bits"):
        fixed_point_format(1.0, 0)
    with pytest.raises(ValueError, match="centroids must be an int >= 2"):
        quantize_kmeans(model, centroids=1)
    with pytest.raises(ValueError, match="centroid_bits"):
        quantize_kmeans(model, centroid_bits=12)
    with pytest.raises(ValueError, match="calibration_x"):
        calibrate_input_formats(model, x[:0], bits=8)
