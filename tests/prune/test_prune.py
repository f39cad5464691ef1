"""Pruning v1: magnitude pruning, torch.nn.utils.prune absorption, DLMC masks, reports."""
import json
import math

import pytest
import torch
from helpers.common import require
from torch import nn
from torch.nn.utils import prune as torch_prune

from sparsecnn.prune import (
    absorb_torch_prune_,
    apply_dlmc_,
    dlmc_layer_mask,
    dlmc_root,
    dlmc_sets,
    format_sparsity_report,
    load_dlmc_masks,
    magnitude_mask,
    masks_from_weights,
    prune_magnitude_,
    sparsity_report,
)

DLMC_SET = "magnitude_pruning-0.9"


def small_net(seed: int = 0) -> nn.Sequential:
    """Three Conv2d of odd numels (189, 693, 55) and a Linear head (15)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 7, 3),
        nn.ReLU(),
        nn.Conv2d(7, 11, 3, bias=False),
        nn.ReLU(),
        nn.Conv2d(11, 5, 1),
        nn.Flatten(),
        nn.Linear(5, 3),
    )


def conv_count(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Conv2d))


# --- magnitude_mask -----------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 7, 101, 1000])
@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.5, 0.75, 0.9, 0.999, 1.0])
def test_magnitude_mask_exact_count(numel, sparsity):
    weight = torch.randn(numel)
    mask = magnitude_mask(weight, sparsity)
    assert mask.dtype == torch.bool and mask.shape == weight.shape
    assert int(mask.sum()) == round((1 - sparsity) * numel)


def test_magnitude_mask_keeps_largest_and_breaks_ties():
    weight = torch.randn(4, 5, 3, 3)
    mask = magnitude_mask(weight, 0.7)
    assert weight.abs()[mask].min() >= weight.abs()[~mask].max()
    ties = torch.ones(10)
    assert torch.equal(magnitude_mask(ties, 0.5), magnitude_mask(ties.clone(), 0.5))
    assert int(magnitude_mask(ties, 0.5).sum()) == 5


@pytest.mark.parametrize("sparsity", [-0.1, 1.5])
def test_magnitude_mask_rejects_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="sparsity"):
        magnitude_mask(torch.randn(10), sparsity)


# --- prune_magnitude_ ---------------------------------------------------------------


def test_layer_scope_exact_per_layer():
    model = small_net()
    masks = prune_magnitude_(model, 0.8, scope="layer")
    assert list(masks) == ["0", "2", "4"]
    for name, mask in masks.items():
        weight = dict(model.named_modules())[name].weight
        assert int(mask.sum()) == round(0.2 * weight.numel())
        assert torch.equal(weight != 0, mask)
    assert torch.count_nonzero(model[6].weight) == model[6].weight.numel()


def test_global_scope_exact_total_and_uneven_layers():
    model = small_net()
    with torch.no_grad():
        model[0].weight.mul_(10)  # make one layer dominate the global ranking
    masks = prune_magnitude_(model, 0.8, scope="global")
    total = conv_count(model)
    assert sum(int(m.sum()) for m in masks.values()) == round(0.2 * total)
    densities = [m.float().mean().item() for m in masks.values()]
    assert max(densities) - min(densities) > 0.1
    nonzero = sum(int(torch.count_nonzero(model[i].weight)) for i in (0, 2, 4))
    assert nonzero == round(0.2 * total)


def test_global_scope_keeps_globally_largest():
    model = small_net()
    before = {n: m.weight.detach().abs().clone() for n, m in model.named_modules()
              if isinstance(m, nn.Conv2d)}
    masks = prune_magnitude_(model, 0.6, scope="global")
    kept = torch.cat([before[n][m] for n, m in masks.items()])
    dropped = torch.cat([before[n][~m] for n, m in masks.items()])
    assert kept.min() >= dropped.max()


def test_filter_fn_and_include_linear():
    model = small_net()
    masks = prune_magnitude_(model, 0.5, filter_fn=lambda name, m: name != "2")
    assert list(masks) == ["0", "4"]
    assert torch.count_nonzero(model[2].weight) == model[2].weight.numel()
    masks = prune_magnitude_(small_net(), 0.5, include_linear=True)
    assert list(masks) == ["0", "2", "4", "6"]


def test_conv1d_selected_and_bad_scope():
    model = nn.Sequential(nn.Conv1d(4, 6, 5), nn.Conv1d(6, 2, 3))
    masks = prune_magnitude_(model, 0.5)
    assert [int(m.sum()) for m in masks.values()] == [60, 18]
    with pytest.raises(ValueError, match="scope"):
        prune_magnitude_(model, 0.5, scope="block")


def test_masks_from_weights_matches_prune():
    model = small_net()
    masks = prune_magnitude_(model, 0.7)
    found = masks_from_weights(model)
    assert list(found) == list(masks)
    assert all(torch.equal(found[n], masks[n]) for n in masks)


# --- torch.nn.utils.prune ------------------------------------------------------------


def test_absorb_l1_unstructured():
    model = small_net()
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)
    torch_prune.l1_unstructured(model[2], "weight", amount=0.3)
    masks = absorb_torch_prune_(model)
    assert list(masks) == ["0", "2"]
    for name in masks:
        module = dict(model.named_modules())[name]
        assert isinstance(module.weight, nn.Parameter)
        assert not hasattr(module, "weight_orig") and not hasattr(module, "weight_mask")
        assert masks[name].dtype == torch.bool
        assert torch.equal(module.weight != 0, masks[name])
    assert int(masks["0"].sum()) == model[0].weight.numel() - round(0.5 * model[0].weight.numel())


def test_absorb_global_unstructured():
    model = small_net()
    params = [(model[i], "weight") for i in (0, 2, 4)]
    torch_prune.global_unstructured(params, pruning_method=torch_prune.L1Unstructured, amount=0.75)
    masks = absorb_torch_prune_(model)
    total = conv_count(model)
    assert sum(int(m.sum()) for m in masks.values()) == total - round(0.75 * total)
    assert sum(int(torch.count_nonzero(model[i].weight)) for i in (0, 2, 4)) == total - round(
        0.75 * total
    )


def test_prune_magnitude_refuses_torch_pruned_module():
    model = small_net()
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(ValueError, match="absorb_torch_prune_"):
        prune_magnitude_(model, 0.5)


# --- sparsity_report ----------------------------------------------------------------


def test_sparsity_report_totals():
    model = small_net()
    masks = prune_magnitude_(model, 0.5, include_linear=True)
    rows = sparsity_report(model)
    assert [r["layer"] for r in rows] == ["0", "2", "4", "6", "total"]
    total = rows[-1]
    assert total["numel"] == sum(r["numel"] for r in rows[:-1])
    assert total["nnz"] == sum(int(m.sum()) for m in masks.values())
    assert math.isclose(total["sparsity"], 1 - total["nnz"] / total["numel"])
    assert rows[0]["shape"] == (7, 3, 3, 3)
    from_masks = sparsity_report(model, {"0": masks["0"]})
    assert [r["layer"] for r in from_masks] == ["0", "total"]
    assert from_masks[-1]["nnz"] == int(masks["0"].sum())
    table = format_sparsity_report(rows)
    assert table.count("\n") == len(rows) + 1 and "| 7x3x3x3 |" in table


# --- DLMC ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dlmc_dir():
    require("dlmc")  # skipped without the data locally, failed in CI
    return dlmc_root()


@pytest.fixture(scope="module")
def dlmc_index(dlmc_dir):
    with open(dlmc_dir / "index.json") as f:
        return json.load(f)


def test_dlmc_root_explicit_and_env(dlmc_dir, monkeypatch, tmp_path):
    assert dlmc_root(dlmc_dir) == dlmc_dir
    monkeypatch.setenv("SPARSECNN_DLMC", str(dlmc_dir))
    assert dlmc_root() == dlmc_dir
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        dlmc_root(tmp_path)


def test_dlmc_sets_and_unknown(dlmc_dir):
    sets = dlmc_sets()
    assert DLMC_SET in sets and "variational_dropout-0.5" in sets
    with pytest.raises(ValueError, match=DLMC_SET):
        load_dlmc_masks("magnitude_pruning-0.33")


def test_load_dlmc_masks_shapes_and_nnz(dlmc_index):
    layers = dlmc_index[f"{DLMC_SET}.npz"]["layers"]
    masks = load_dlmc_masks(DLMC_SET)
    assert set(masks) == set(layers) and len(masks) == 54
    for name, mask in masks.items():
        assert mask.dtype == torch.bool
        assert list(mask.shape) == layers[name]["shape"]
        assert int(mask.sum()) == layers[name]["nnz"]
    nnz = sum(int(m.sum()) for m in masks.values())
    numel = sum(m.numel() for m in masks.values())
    assert abs(1 - nnz / numel - 0.9) < 1e-3
    assert torch.equal(load_dlmc_masks(f"dlmc-{DLMC_SET}")["conv1"], masks["conv1"])
    assert torch.equal(dlmc_layer_mask(DLMC_SET, "layer3.1.conv2"), masks["layer3.1.conv2"])


def test_apply_dlmc_resnet50(dlmc_index):
    from sparsecnn.models import build_model

    layers = dlmc_index[f"{DLMC_SET}.npz"]["layers"]
    model = build_model("resnet50")
    masks = apply_dlmc_(model, DLMC_SET, seed=0)
    assert "fc" not in masks and len(masks) == 53
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        weight = modules[name].weight
        assert int(torch.count_nonzero(weight)) == layers[name]["nnz"]
        assert torch.equal(weight != 0, mask)
    std = modules["layer3.1.conv2"].weight[masks["layer3.1.conv2"]].std().item()
    assert abs(std - math.sqrt(2 / (256 * 9))) < 0.1 * std

    same = build_model("resnet50")
    apply_dlmc_(same, DLMC_SET, seed=0)
    other = build_model("resnet50")
    apply_dlmc_(other, DLMC_SET, seed=1)
    for name in ("conv1", "layer4.2.conv3"):
        assert torch.equal(modules[name].weight, dict(same.named_modules())[name].weight)
        assert not torch.equal(modules[name].weight, dict(other.named_modules())[name].weight)


def test_apply_dlmc_missing_layers_warn_and_shape_mismatch(dlmc_dir):
    from sparsecnn.models import build_model

    model = build_model("resnet50")
    dense = model.layer4[0].conv2.weight.detach().clone()
    with pytest.warns(UserWarning, match="layer4.0.conv2"):
        masks = apply_dlmc_(model, "variational_dropout-0.5", include_fc=True)
    assert "layer4.0.conv2" not in masks and "fc" not in masks
    assert torch.equal(model.layer4[0].conv2.weight, dense)

    model.layer1[0].conv1 = nn.Conv2d(64, 32, 1)
    stem = model.conv1.weight.detach().clone()
    with pytest.raises(ValueError, match="layer1.0.conv1"):
        apply_dlmc_(model, DLMC_SET)
    assert torch.equal(model.conv1.weight, stem)  # nothing changed before the error
