"""Re-pruning into tensor-core tiles (issue 32, item 1): exact sparsity, tile shape, l2 kept, saving,
the "reprune-tiles" method on lenet5 digits."""
import copy
import itertools
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from sparsecnn.data import DigitsSplit, load_digits_split
from sparsecnn.models import build_model
from sparsecnn.prune import (
    TileDecomposition,
    TileParams,
    load_pruned,
    magnitude_mask,
    method_names,
    prune_with,
    reprune_tiles,
    reprune_tiles_,
)
from sparsecnn.backends.blocks.extraction import clear_provided_blocks, extraction, provided_blocks
from sparsecnn.cli import main
from sparsecnn.prune.methods import top1_accuracy, train_dense_


def _matrix(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(tensor.shape[0], -1).numpy()


def _check_structure(decomposition: TileDecomposition, params: TileParams, keep: int) -> None:
    """Exact count, every group's rows share its columns, groups are contiguous slices of one tile of
    the permutation, at most one tile split (one column ragged), the remainder within its bound."""
    shape = decomposition.shape
    rows, cols = shape[0], math.prod(shape[1:])
    mask = _matrix(decomposition.mask)
    assert decomposition.mask.dtype == torch.bool and tuple(decomposition.mask.shape) == shape
    assert mask.sum() == keep == decomposition.kept
    assert sorted(decomposition.permutation) == list(range(rows))
    tile = decomposition.tile
    assert tile in (16, 32, 64) and (params.tile == "auto" or tile == params.tile)
    assert decomposition.num_tiles == -(-rows // tile)
    position = {channel: i for i, channel in enumerate(decomposition.permutation)}
    tiles_seen, used_rows = {}, set()
    tiles_mask = np.zeros_like(mask)
    for group in decomposition.groups:
        assert group.rows and group.cols and list(group.cols) == sorted(set(group.cols))
        assert max(group.cols) < cols
        places = [position[r] for r in group.rows]
        assert places == list(range(places[0], places[0] + len(places)))  # contiguous in the permutation
        assert all(p // tile == group.tile for p in places)  # inside one tile
        assert len(group.rows) <= tile
        assert not used_rows & set(group.rows)
        used_rows |= set(group.rows)
        block = mask[list(group.rows)]
        if not decomposition.remainder:
            assert (block == block[0]).all()  # the group's rows are identical mask rows
        assert block[:, list(group.cols)].all()
        tiles_mask[np.ix_(list(group.rows), list(group.cols))] = True
        tiles_seen.setdefault(group.tile, []).append(group)
    split = [groups for groups in tiles_seen.values() if len(groups) > 1]
    assert len(split) <= 1 and all(len(groups) == 2 for groups in split)
    for first, second in split:  # the split tile: one more column on its first rows
        assert set(second.cols) < set(first.cols) and len(first.cols) == len(second.cols) + 1
    assert len(decomposition.remainder) == math.floor(params.remainder * keep)
    flat = tiles_mask.reshape(-1)
    assert not flat[list(decomposition.remainder)].any()
    flat[list(decomposition.remainder)] = True
    assert np.array_equal(flat.reshape(mask.shape), mask)


ODD_SHAPES = [(33, 3, 1, 1), (33, 3, 3, 3), (33, 3, 7, 7), (70, 5, 3, 3), (16, 3, 3, 3), (8, 1, 5, 5)]


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("tile", [16, 32, 64, "auto"])
@pytest.mark.parametrize("sparsity", [0.9, 0.73, 0.5])
def test_exact_sparsity_and_tile_shape_on_odd_shapes(shape, tile, sparsity):
    torch.manual_seed(hash((shape, sparsity)) % 1000)
    weight = torch.randn(shape)
    mask = magnitude_mask(weight, sparsity)
    params = TileParams(tile=tile, sparsity=sparsity)
    decomposition = reprune_tiles(weight, mask, params)
    _check_structure(decomposition, params, round((1 - sparsity) * weight.numel()))


@pytest.mark.parametrize("remainder", [0.1, 0.5])
def test_bounded_remainder_holds_the_largest_leftover_weights(remainder):
    torch.manual_seed(1)
    weight = torch.randn(33, 3, 3, 3)
    params = TileParams(tile=16, sparsity=0.8, remainder=remainder)
    decomposition = reprune_tiles(weight, None, params)
    keep = round(0.2 * weight.numel())
    _check_structure(decomposition, params, keep)
    squares = weight.reshape(-1) ** 2
    in_tiles = decomposition.mask.reshape(-1).clone()
    in_tiles[list(decomposition.remainder)] = False
    leftover = squares[~in_tiles]
    smallest_kept = squares[list(decomposition.remainder)].min()
    assert (leftover >= smallest_kept).sum() == len(decomposition.remainder)  # no larger one left out


def test_mask_none_and_sparsity_none_keep_the_inputs_count():
    torch.manual_seed(2)
    weight = torch.randn(40, 4, 3, 3)
    mask = magnitude_mask(weight, 0.85)
    pruned = weight * mask
    with_mask = reprune_tiles(weight, mask, TileParams(tile=16))
    without = reprune_tiles(pruned, None, TileParams(tile=16))
    assert with_mask.kept == without.kept == int(mask.sum())
    assert torch.equal(with_mask.mask, without.mask)


@pytest.mark.parametrize("order", ["greedy", "none"])
def test_all_zero_groups_keep_nothing(order):
    torch.manual_seed(3)
    weight = torch.randn(48, 3, 3, 3)
    weight[16:32] = 0  # one tile's worth of all-zero output channels
    weight[40:] = 0
    mask = magnitude_mask(weight, 0.7)
    params = TileParams(tile=16, sparsity=0.7, order=order)
    decomposition = reprune_tiles(weight, mask, params)
    _check_structure(decomposition, params, round(0.3 * weight.numel()))
    kept_rows = _matrix(decomposition.mask).any(axis=1)
    zero_rows = ~_matrix(weight).any(axis=1)
    permutation = list(decomposition.permutation)
    tiles = [permutation[start:start + 16] for start in range(0, 48, 16)]
    zero_tiles = [rows for rows in tiles if zero_rows[rows].all()]
    assert len(zero_tiles) == 1  # greedy packs the 24 zero channels into one full tile and half of another
    for rows in zero_tiles:
        assert not kept_rows[rows].any()
    assert kept_rows[~zero_rows].all()
    assert decomposition.l2_kept > 0.5


def test_fully_dense_layer_at_sparsity_zero_keeps_everything():
    torch.manual_seed(4)
    weight = torch.randn(33, 3, 3, 3)
    for tile in (16, 32, 64, "auto"):
        decomposition = reprune_tiles(weight, None, TileParams(tile=tile, sparsity=0.0))
        assert decomposition.mask.all() and decomposition.l2_kept == pytest.approx(1.0)
        assert decomposition.sparsity == 0.0
    everything_pruned = reprune_tiles(weight, None, TileParams(tile=16, sparsity=1.0))
    assert not everything_pruned.mask.any() and everything_pruned.groups == ()


def _l2(squares: np.ndarray, mask: np.ndarray) -> float:
    return float(squares[mask].sum() / squares.sum())


def test_l2_kept_beats_random_columns_for_the_same_groups():
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    weight = torch.randn(70, 6, 3, 3) * torch.rand(70, 1, 1, 1)
    mask = magnitude_mask(weight, 0.9)
    decomposition = reprune_tiles(weight, mask, TileParams(tile=16, sparsity=0.9))
    squares = _matrix(weight * mask).astype(np.float64) ** 2
    assert decomposition.l2_kept == pytest.approx(_l2(squares, _matrix(decomposition.mask)))
    columns = squares.shape[1]
    for _ in range(20):
        random_mask = np.zeros_like(squares, dtype=bool)
        for group in decomposition.groups:
            chosen = rng.choice(columns, len(group.cols), replace=False)
            random_mask[np.ix_(list(group.rows), chosen)] = True
        assert decomposition.l2_kept >= _l2(squares, random_mask)
    # and the ordering by mask similarity beats channels in index order here
    unordered = reprune_tiles(weight, mask, TileParams(tile=16, sparsity=0.9, order="none"))
    assert decomposition.l2_kept >= unordered.l2_kept - 0.02


def test_l2_kept_is_the_optimum_on_a_brute_forceable_case():
    """Two tiles of 16 rows, 4 columns, 3 columns kept in all: every split of the 3 columns between the
    tiles and every choice of them, against the re-pruning (channels in index order)."""
    rng = np.random.default_rng(6)
    for trial in range(10):
        weight = torch.from_numpy(rng.standard_normal((32, 1, 2, 2)) * rng.random((32, 1, 1, 1)) * 3 ** (trial % 3))
        weight[rng.random(weight.shape) < 0.4] = 0
        params = TileParams(tile=16, sparsity=1 - 48 / 128, order="none")
        decomposition = reprune_tiles(weight, None, params)
        _check_structure(decomposition, params, 48)
        squares = _matrix(weight) ** 2
        tiles = [squares[:16], squares[16:]]
        best = 0.0
        for first in range(4):
            for cols_a in itertools.combinations(range(4), first):
                for cols_b in itertools.combinations(range(4), 3 - first):
                    kept = tiles[0][:, list(cols_a)].sum() + tiles[1][:, list(cols_b)].sum()
                    best = max(best, kept / squares.sum())
        assert decomposition.l2_kept == pytest.approx(best)


def test_auto_tile_keeps_the_most_l2_of_the_three_sizes():
    torch.manual_seed(7)
    weight = torch.randn(96, 4, 3, 3)
    mask = magnitude_mask(weight, 0.9)
    fixed = {tile: reprune_tiles(weight, mask, TileParams(tile=tile, sparsity=0.9)).l2_kept for tile in (16, 32, 64)}
    auto = reprune_tiles(weight, mask, TileParams(tile="auto", sparsity=0.9))
    assert auto.l2_kept == pytest.approx(max(fixed.values())) and fixed[auto.tile] == auto.l2_kept
    small = torch.randn(12, 3, 3, 3)  # one short tile for every size: all tie, the largest wins
    assert reprune_tiles(small, None, TileParams(tile="auto", sparsity=0.5)).tile == 64


def test_to_dict_from_dict_round_trip_through_json():
    torch.manual_seed(8)
    weight = torch.randn(33, 3, 3, 3)
    decomposition = reprune_tiles(weight, magnitude_mask(weight, 0.9),
                                  TileParams(tile="auto", sparsity=0.9, remainder=0.2))
    data = json.loads(json.dumps(decomposition.to_dict()))
    restored = TileDecomposition.from_dict(data)
    assert restored == decomposition and torch.equal(restored.mask, decomposition.mask)
    assert restored.to_dict() == decomposition.to_dict()
    with pytest.raises(ValueError, match="not a sparsecnn tile"):
        TileDecomposition.from_dict({"format": "other"})
    with pytest.raises(ValueError, match="version"):
        TileDecomposition.from_dict(dict(data, version=99))


@pytest.mark.parametrize("changes, field", [
    (dict(tile=8), "TileParams.tile"),
    (dict(tile=True), "TileParams.tile"),
    (dict(tile=16.0), "TileParams.tile"),
    (dict(tile="big"), "TileParams.tile"),
    (dict(sparsity=1.5), "TileParams.sparsity"),
    (dict(sparsity="0.9"), "TileParams.sparsity"),
    (dict(remainder=1.0), "TileParams.remainder"),
    (dict(remainder=-0.1), "TileParams.remainder"),
    (dict(order="spectral"), "TileParams.order"),
    (dict(chunk=4), "TileParams.chunk"),
    (dict(chunk=True), "TileParams.chunk"),
])
def test_tile_params_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        TileParams(**changes)


def test_bad_arguments_are_clear_errors():
    weight = torch.randn(16, 3, 3, 3)
    with pytest.raises(ValueError, match="mask must be bool"):
        reprune_tiles(weight, torch.ones(16, 3, 3, 3), TileParams())
    with pytest.raises(ValueError, match="mask must be bool"):
        reprune_tiles(weight, torch.ones(16, 3, 3, 1, dtype=torch.bool), TileParams())
    with pytest.raises(TypeError, match="TileParams"):
        reprune_tiles(weight, None, {"tile": 16})


def test_reprune_tiles_model_touches_only_plain_convs():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Conv2d(3, 40, 3), nn.Conv2d(40, 40, 3, groups=40), nn.Flatten(), nn.Linear(40, 10))
    masks = {name: magnitude_mask(model.get_submodule(name).weight, 0.8) for name in ("0", "1", "3")}
    for name, mask in masks.items():
        model.get_submodule(name).weight.data.mul_(mask)
    before = copy.deepcopy(model)
    new_masks, decompositions = reprune_tiles_(model, masks, TileParams(tile=16))
    assert sorted(decompositions) == ["0"]
    assert new_masks["1"] is masks["1"] and new_masks["3"] is masks["3"]
    assert torch.equal(model[1].weight, before[1].weight) and torch.equal(model[3].weight, before[3].weight)
    assert new_masks["0"].sum() == masks["0"].sum()
    assert torch.equal(new_masks["0"], decompositions["0"].mask)
    assert not model[0].weight[~new_masks["0"]].any()
    assert provided_blocks(new_masks["0"]) == decompositions["0"].blocks  # handed to backend blocks
    assert extraction(model[0].weight.detach(), 8).report.partitioner == "given"
    with pytest.raises(KeyError, match="nope"):
        reprune_tiles_(model, {"nope": masks["0"]}, TileParams())


def test_registered_method_runs_on_lenet5_digits_with_exact_sparsity():
    digits = load_digits_split((1, 28, 28), seed=0)
    split = DigitsSplit(digits.train_x[:600], digits.train_y[:600], digits.test_x, digits.test_y)
    torch.manual_seed(0)
    model = build_model("lenet5")
    train_dense_(model, split, epochs=2, seed=0)
    assert "reprune-tiles" in method_names()
    masks = prune_with("reprune-tiles", model, split, 0.9, seed=0, epochs=1, tile=16)
    assert sorted(masks) == ["conv1", "conv2", "fc1"]
    for name, mask in masks.items():
        weight = model.get_submodule(name).weight
        assert mask.sum().item() == round(0.1 * mask.numel())
        assert not weight[~mask].any()
    for name, channels in (("conv1", 20), ("conv2", 50)):  # rows of a tile share their columns
        rows = _matrix(masks[name])
        assert rows.shape[0] == channels
        assert len({tuple(row) for row in rows}) <= -(-channels // 16) + 1  # one tile may be split once
    assert top1_accuracy(model, split) > 50


def test_gradual_rounds_rise_to_the_target_in_tiles(monkeypatch):
    """steps=3: three rounds of magnitude masks at rising sparsity, re-pruned into tiles, each trained
    epochs // steps; the last round ends at the target exactly, in tiles."""
    from sparsecnn.prune import rounds as rounds_module

    digits = load_digits_split((1, 28, 28), seed=0)
    split = DigitsSplit(digits.train_x[:300], digits.train_y[:300], digits.test_x, digits.test_y)
    torch.manual_seed(0)
    model = build_model("lenet5")
    train_dense_(model, split, epochs=1, seed=0)
    rounds = []
    real_train = rounds_module.train_epochs

    def recording_train(model, batches, config, masks=None, description=""):
        rounds.append((description, config.epochs, round(sum(int(m.sum()) for m in masks.values())
                                                          / sum(m.numel() for m in masks.values()), 2)))
        return real_train(model, batches, config, masks=masks, description=description)

    monkeypatch.setattr(rounds_module, "train_epochs", recording_train)
    masks = prune_with("reprune-tiles", model, split, 0.9, seed=0, epochs=1, retrain_epochs=2, tile=16, steps=3)
    assert [(d, e) for d, e, _ in rounds] == [(f"reprune-tiles round {i}/3", 1) for i in (1, 2, 3)]
    densities = [density for _, _, density in rounds]
    assert densities[0] > densities[1] > densities[2] == 0.1
    for name, mask in masks.items():
        assert mask.sum().item() == round(0.1 * mask.numel())
        assert not model.get_submodule(name).weight[~mask].any()
    rows = _matrix(masks["conv2"])
    assert len({tuple(row) for row in rows}) <= -(-50 // 16) + 1
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        prune_with("reprune-tiles", model, split, 0.9, seed=0, epochs=1, tile=16, steps=0)


@pytest.mark.slow
def test_cli_reprune_tiles_takes_the_tile_size(tmp_path):
    output = tmp_path / "tiles.pt"
    assert main(["prune", "lenet5", "--method", "reprune-tiles", "--tile", "16", "--sparsity", "0.9", "--epochs", "1",
                 "--finetune-epochs", "1", "--device", "cpu", "-o", str(output)]) == 0
    clear_provided_blocks()
    model, masks, report = load_pruned(output)
    assert report["method"] == "reprune-tiles"
    for name in ("conv1", "conv2"):  # the checkpoint's tiles reach backend blocks again
        blocks = provided_blocks(masks[name])
        assert blocks is not None and all(len(rows) <= 16 for rows, _ in blocks)
        decomposition = extraction(model.get_submodule(name).weight.detach(), 8)
        assert decomposition.report.partitioner == "given" and len(decomposition.blocks) == len(blocks)
    for name, channels in (("conv1", 20), ("conv2", 50)):  # tiles of 16 rows share their columns
        rows = _matrix(masks[name])
        assert len({tuple(row) for row in rows}) <= -(-channels // 16) + 1
        assert masks[name].sum().item() == round(0.1 * masks[name].numel())


@pytest.mark.parametrize("shape,chunk", [((33, 20, 3, 3), 8), ((64, 64, 1, 1), 16), ((40, 3, 5, 5), 32),
                                         ((64, 96, 3, 3), 32)])
def test_chunked_tiles_keep_whole_units_near_the_target(shape, chunk):
    """With chunks every group keeps whole units (all channels of a chunk at a tap, cut at C), and
    the cells come from units only. The kept count is within one tile x chunk of the target when
    chunk divides C; a short last chunk is counted at the mean unit width, so within a quarter."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(shape, generator=gen)
    decomposition = reprune_tiles(weight, None, TileParams(tile=16, sparsity=0.8, chunk=chunk))
    K, C = shape[:2]
    taps = math.prod(shape[2:])
    target = round(0.2 * weight.numel())
    slack = 16 * chunk if C % chunk == 0 else target // 4
    assert abs(int(decomposition.mask.sum()) - target) <= slack
    for group in decomposition.groups:
        units = {(col // taps // chunk, col % taps) for col in group.cols}
        expected = sorted(c * taps + tap for first, tap in units
                          for c in range(first * chunk, min(C, (first + 1) * chunk)))
        assert list(group.cols) == expected
    rows = decomposition.mask.reshape(K, -1)
    assert torch.equal(rows, _groups_mask(decomposition))


def _groups_mask(decomposition):
    matrix = torch.zeros(decomposition.shape[0], math.prod(decomposition.shape[1:]), dtype=torch.bool)
    for group in decomposition.groups:
        matrix[torch.tensor(group.rows)[:, None], torch.tensor(group.cols)[None, :]] = True
    return matrix


def test_chunked_tiles_keep_more_l2_than_a_random_unit_choice():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 32, 3, 3, generator=gen)
    weight[:, :8] *= 4  # the first chunk of 8 channels carries most of the energy
    decomposition = reprune_tiles(weight, None, TileParams(tile=32, sparsity=0.75, chunk=8))
    assert decomposition.l2_kept > 0.5
    kept = decomposition.mask.reshape(64, 4, 8, 9).any(dim=2)
    assert kept[:, 0].all()  # every row keeps the strong chunk at every tap


@pytest.mark.slow
def test_cli_reprune_tiles_takes_the_chunk(tmp_path):
    output = tmp_path / "units.pt"
    assert main(["prune", "lenet5", "--method", "reprune-tiles", "--tile", "16", "--chunk", "8", "--sparsity", "0.8",
                 "--epochs", "1", "--finetune-epochs", "1", "--device", "cpu", "-o", str(output)]) == 0
    _, masks, _ = load_pruned(output)
    mask = masks["conv2"]
    padded = torch.zeros(50, 24, 5, 5, dtype=torch.bool)
    padded[:, :20] = mask
    chunks = padded.reshape(50, 3, 8, 25)
    full = chunks[:, :2]  # whole chunks of 8 channels: all kept or all pruned at each tap
    assert torch.equal(full.all(dim=2), full.any(dim=2))
    units = full.any(dim=2)  # with --chunk, tiles are runs of 16 consecutive channels (order "none")
    for start in range(0, 48, 16):
        assert torch.equal(units[start:start + 16], units[start].expand(16, -1, -1))


def test_cli_refuses_a_bad_chunk(tmp_path, capsys):
    assert main(["prune", "lenet5", "--method", "reprune-tiles", "--chunk", "4", "--device", "cpu",
                 "-o", str(tmp_path / "x.pt")]) == 2
    assert "--chunk must be one of 1, 8, 16, 32" in capsys.readouterr().err
    assert main(["prune", "lenet5", "--chunk", "8", "--device", "cpu", "-o", str(tmp_path / "x.pt")]) == 2
    assert "--chunk applies to --method reprune-tiles only" in capsys.readouterr().err
    assert main(["prune", "lenet5", "--method", "reprune-tiles", "--order", "random", "--device", "cpu",
                 "-o", str(tmp_path / "x.pt")]) == 2
    assert "--order must be one of greedy, none" in capsys.readouterr().err
