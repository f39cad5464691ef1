"""scripts/warm_dense_compile.py: how a model is cut into units and dealt to parts (CPU)."""
import importlib.util

import torch
from torch import nn

from helpers.common import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("warm_dense_compile", ROOT / "scripts" / "warm_dense_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _features_model() -> nn.Module:
    """Every conv in one `features` child (as torchvision's mobilenet_v2 and vgg16_bn), then a head."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.ReLU()) for i in range(5)]
    return nn.Sequential(nn.Sequential(*blocks), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).eval()


def test_one_features_child_is_split_into_as_many_units_as_parts():
    script = _script()
    units = script.conv_units(_features_model(), 4)
    assert len(units) == 5 and [name for name, _ in units] == [f"0.{i}" for i in range(5)]
    assert sum(script.conv_count(module) for _, module in units) == 5


def test_parts_cover_every_unit_once_with_the_input_it_receives():
    script = _script()
    model, x = _features_model(), torch.randn(2, 3, 9, 9)
    parts = [script.assigned_units(model, x, index, 3) for index in range(3)]
    names = sorted(name for part in parts for name, _, _ in part)
    assert names == [f"0.{i}" for i in range(5)]
    assert all(part for part in parts)
    for part in parts:
        for name, unit, args in part:
            assert args[0].shape == ((2, 3, 9, 9) if name == "0.0" else (2, 8, 9, 9))


def test_a_model_that_cannot_be_split_further_stays_whole():
    script = _script()
    model = nn.Sequential(nn.Conv2d(3, 4, 1)).eval()
    assert [name for name, _ in script.conv_units(model, 8)] == [""]
    assert [name for name, _, _ in script.assigned_units(model, torch.randn(1, 3, 5, 5), 0, 8)] == [""]
