"""`reprune-select` over tensor-core unit shapes (prune/unit_selection.py): config checks, the plans
made from measured gains, the search over them, and the method end to end on lenet5 (CPU; the
gains given, as `tensorcore` does not run on a CPU without the interpreter)."""
import pytest
import torch

from sparsecnn.data import load_digits_split
from sparsecnn.data.digits import DigitsSplit
from sparsecnn.models import build_model
from sparsecnn.prune import UnitSelectionConfig, magnitude_mask, prune_with, search_units, unit_plans
from sparsecnn.prune.unit_selection import measure_unit_gains
from sparsecnn.tuning import tensorcore_gains


@pytest.fixture(scope="module")
def small_digits():
    split = load_digits_split((1, 28, 28), seed=0)
    return DigitsSplit(split.train_x[:240], split.train_y[:240], split.test_x, split.test_y)


def partial_units(mask, tile, chunk):
    """Units (a tile of `tile` output channels x `chunk` input channels at one tap, cut off at K and
    C) that hold some kept weights but not all."""
    K, C, R, S = mask.shape
    tiles, chunks = -(-K // tile), -(-C // chunk)
    padded = torch.ones(tiles * tile, chunks * chunk, R, S, dtype=torch.bool)  # outside K, C: counts as kept
    padded[:K, :C] = mask
    inside = torch.zeros_like(padded)
    inside[:K, :C] = True
    kept = (padded & inside).reshape(tiles, tile, chunks, chunk, R, S).any(dim=3).any(dim=1)
    full = padded.reshape(tiles, tile, chunks, chunk, R, S).all(dim=3).all(dim=1)
    return int((kept & ~full).sum())


def pruned_lenet5():
    """lenet5 (conv1 20 x 1 x 5 x 5, conv2 50 x 20 x 5 x 5) with conv2 and fc1 magnitude-pruned to 0.9."""
    torch.manual_seed(0)
    model = build_model("lenet5")
    masks = {name: magnitude_mask(getattr(model, name).weight, 0.9) for name in ("conv2", "fc1")}
    with torch.no_grad():
        for name, mask in masks.items():
            getattr(model, name).weight.mul_(mask)
    return model, masks


@pytest.mark.parametrize("field, value", [("shapes", ()), ("shapes", ((16, 1),)), ("shapes", ((8, 16),)),
                                          ("shapes", ((16, 16, 1),)), ("gain_threshold", 0),
                                          ("gain_threshold", True), ("accuracy_budget", -0.5), ("holdout", 1.0),
                                          ("steps", 0), ("steps", True), ("steps", 1.5)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"UnitSelectionConfig.{field}"):
        UnitSelectionConfig(**{field: value})


def test_config_keeps_each_shape_once_in_order():
    assert UnitSelectionConfig(shapes=[[32, 32], (16, 16), (32, 32)]).shapes == ((32, 32), (16, 16))


def test_plans_back_off_from_the_fastest_qualifying_shape():
    gains = {"a": {(16, 16): 1.2, (32, 32): 1.8, (64, 32): 2.5},
             "b": {(16, 16): 1.1, (32, 32): 0.9, (64, 32): 1.4},
             "c": {(16, 16): 0.5, (32, 32): 0.7, (64, 32): 0.0}}
    assert unit_plans(gains, 1.0) == [{"a": (64, 32), "b": (64, 32)}, {"a": (32, 32), "b": (16, 16)},
                                      {"a": (16, 16)}]
    assert unit_plans(gains, 3.0) == []


def _scripted_top1(scores):
    calls = iter(scores)
    return lambda model: next(calls)


def test_search_takes_the_first_plan_within_the_budget_and_loads_it():
    model, masks = pruned_lenet5()
    plans = [{"conv2": (16, 16)}, {"conv2": (16, 8)}]
    retrained = []
    chosen, report = search_units(model, masks, plans, UnitSelectionConfig(accuracy_budget=0.5),
                                  lambda trial, m: retrained.append(m), _scripted_top1([90.0, 88.0, 89.6]))
    assert [top1 for _, top1 in report.trials] == [88.0, 89.6] and report.plan == {"conv2": (16, 8)}
    assert retrained[-1] is chosen and chosen["fc1"] is masks["fc1"]
    assert not model.conv2.weight[~chosen["conv2"]].any()
    assert chosen["conv2"].float().mean().item() == pytest.approx(0.1, abs=0.03)  # C = 20: units of 8, 8 and 4
    assert partial_units(chosen["conv2"], 16, 8) <= 1  # whole units, but for the kept count's last
    assert "kept [conv2 16x8]" in report.summary() and "gains" not in report.summary()  # none measured
    report.gains = {"conv1": {}, "conv2": {(16, 16): 1.5, (16, 8): 1.25}}
    assert report.summary().endswith("; tensorcore gains over dense: conv2 16x16 1.50x, 16x8 1.25x")


def test_search_keeps_the_unstructured_model_when_no_plan_is_within_the_budget():
    model, masks = pruned_lenet5()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    chosen, report = search_units(model, masks, [{"conv2": (16, 16)}], UnitSelectionConfig(),
                                  lambda trial, m: None, _scripted_top1([90.0, 80.0]))
    assert chosen is masks and report.plan is None and len(report.trials) == 1
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert "unstructured masks kept" in report.summary()


def test_the_method_needs_a_unit_speed_measurement(small_digits):
    with pytest.raises(ValueError, match="measure_unit_speed"):
        prune_with("reprune-select", build_model("lenet5"), small_digits, 0.9, epochs=0,
                   units=UnitSelectionConfig())


def test_unit_gains_time_a_re_pruned_copy_per_shape():
    model, masks = pruned_lenet5()
    before = model.conv2.weight.detach().clone()
    seen = []

    def speed(copy, inputs, convs):
        seen.append(partial_units(copy.conv2.weight.detach() != 0, 16, 16))
        return {conv: float(len(seen)) for conv in convs}

    gains = measure_unit_gains(model, masks, (torch.randn(2, 1, 28, 28),), ["conv2"], [(16, 16), (32, 16)], speed)
    assert gains == {"conv2": {(16, 16): 1.0, (32, 16): 2.0}}
    assert seen[0] <= 1 and torch.equal(model.conv2.weight, before)  # the first copy in 16 x 16 units


def test_reprune_select_with_units_end_to_end(small_digits):
    """Measured speeds stand in for `tensorcore_gains` (lenet5's convs would run dense on a CPU): conv2
    is fastest at 16x16, conv1 at no shape; any top-1 is within the budget, so the first plan is kept."""
    torch.manual_seed(0)
    model = build_model("lenet5")
    speeds = iter([{"conv1": 0.5, "conv2": 2.0}, {"conv1": 0.5, "conv2": 1.5}])  # per shape, in order

    def speed(copy, inputs, convs):
        assert convs == ["conv1", "conv2"] and inputs[0].shape[0] == 16
        return next(speeds)

    units = UnitSelectionConfig(shapes=((16, 16), (16, 8)), accuracy_budget=100.0)
    masks = prune_with("reprune-select", model, small_digits, 0.9, epochs=1, retrain_epochs=1, batch_size=16,
                       units=units, measure_unit_speed=speed)
    report = model.sparsecnn_selection
    assert report.plan == {"conv2": (16, 16)} and report.gains["conv2"] == {(16, 16): 2.0, (16, 8): 1.5}
    for name, mask in masks.items():
        assert not getattr(model, name).weight[~mask].any()
    assert partial_units(masks["conv2"], 16, 16) <= 1  # re-pruned into 16 x 16 units (a magnitude mask is not)


def test_reprune_select_with_units_in_rounds(small_digits, monkeypatch):
    """steps=3: the kept plan is re-pruned from the dense model in three rounds of rising sparsity
    (epochs 2 + retrain_epochs 1 = one epoch each) instead of a re-training of the magnitude model;
    the last round ends at the target's kept count in 16 x 16 units on the convs, magnitude on fc1."""
    from sparsecnn.prune import rounds as rounds_module

    torch.manual_seed(0)
    model = build_model("lenet5")
    trained = []
    real_train = rounds_module.train_epochs

    def recording_train(model, batches, config, masks=None, description=""):
        trained.append((description, config.epochs, round(float(masks["conv2"].float().mean()), 3)))
        return real_train(model, batches, config, masks=masks, description=description)

    monkeypatch.setattr(rounds_module, "train_epochs", recording_train)
    units = UnitSelectionConfig(shapes=((16, 16),), accuracy_budget=100.0, steps=3)
    masks = prune_with("reprune-select", model, small_digits, 0.9, epochs=2, retrain_epochs=1, batch_size=16,
                       units=units, measure_unit_speed=lambda copy, inputs, convs: {conv: 2.0 for conv in convs})
    assert model.sparsecnn_selection.plan == {"conv1": (16, 16), "conv2": (16, 16)}
    assert [(description, epochs) for description, epochs, _ in trained] == \
        [(f"reprune-select round {i}/3", 1) for i in (1, 2, 3)]
    densities = [density for _, _, density in trained]
    assert densities[0] > densities[1] > densities[2] < 0.2  # 0.1 kept, in units of 16 of conv2's 20 channels
    for name, mask in masks.items():
        assert not getattr(model, name).weight[~mask].any()
    assert partial_units(masks["conv2"], 16, 16) <= 1
    assert partial_units(masks["fc1"].reshape(*masks["fc1"].shape, 1, 1), 16, 16) > 1  # fc1: magnitude


def test_tensorcore_gains_are_zero_where_tensorcore_does_not_run():
    """On a CPU without the interpreter `tensorcore` is not a candidate: every gain is 0.0, so no
    shape qualifies and reprune-select keeps the unstructured masks."""
    if torch.cuda.is_available():
        pytest.skip("tensorcore runs on a GPU")
    model, _ = pruned_lenet5()
    assert tensorcore_gains(model, (torch.randn(2, 1, 28, 28),), ["conv2"]) == {"conv2": 0.0}


def test_cli_reprune_select_takes_unit_shapes(tmp_path, monkeypatch, caplog):
    """`--unit-shapes` hands the shapes and `tuning.tensorcore_gains` (here one that measures every
    shape 0.9x, as a CPU's dense-only run would) to the method: no shape qualifies, and the
    unstructured masks are kept (said in the log)."""
    import logging

    import sparsecnn.tuning
    from sparsecnn.cli import main
    from sparsecnn.prune import load_pruned

    measured = []

    def slower(copy, inputs, convs):
        measured.append(convs)
        return {conv: 0.9 for conv in convs}

    monkeypatch.setattr(sparsecnn.tuning, "tensorcore_gains", slower)
    output = tmp_path / "units.pt"
    with caplog.at_level(logging.INFO, logger="sparsecnn.prune.selection"):
        assert main(["prune", "lenet5", "--method", "reprune-select", "--unit-shapes", "16x16,16x8", "--sparsity",
                     "0.9", "--epochs", "1", "--finetune-epochs", "1", "--device", "cpu", "-o", str(output)]) == 0
    assert measured == [["conv1", "conv2"]] * 2  # one re-pruned copy per shape
    _, masks, _ = load_pruned(output)
    assert partial_units(masks["conv2"], 16, 16) > 1  # magnitude masks, not units
    assert "tried none (no shape qualified); no plan within the budget" in caplog.text
    assert "tensorcore gains over dense: conv1 16x16 0.90x, 16x8 0.90x; conv2 16x16 0.90x" in caplog.text


def test_cli_unit_shapes_take_steps():
    from sparsecnn.cli import _unit_selection

    assert _unit_selection("16x16,64x32", 3) == UnitSelectionConfig(shapes=((16, 16), (64, 32)), steps=3)
