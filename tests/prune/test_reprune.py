"""Performance-aware re-pruning (paper 000, Sec. 5): knapsack, benefit model, budget, masks, lenet5."""
import importlib.util
import itertools
import json

import numpy as np
import pytest
import torch
from helpers.common import ROOT, sparse_weight

from sparsecnn.backends.blocks.extraction import clear_provided_blocks, extraction, provided_blocks
from sparsecnn.backends.blocks.format import BlockParams, extract_blocks
from sparsecnn.data import Batches, load_digits_split
from sparsecnn.data.digits import DigitsSplit
from sparsecnn.models import build_model
from sparsecnn.prune import magnitude_mask, prune_with
from sparsecnn.prune.reprune import (
    ReorganisedLayer,
    benefits,
    knapsack,
    reprune_,
    reprune_layer,
)
from sparsecnn.prune.training import TrainConfig, train_epochs

SMALL_BLOCKS = BlockParams(t1=4, t2=3, b1=3, b2=3, partitioner="jaccard")


def _brute_force(values, weights, budget):
    best = 0.0
    for size in range(len(values) + 1):
        for subset in itertools.combinations(range(len(values)), size):
            if sum(weights[i] for i in subset) <= budget:
                best = max(best, sum(values[i] for i in subset))
    return best


# --- knapsack --------------------------------------------------------------------------------

@pytest.mark.parametrize("values, weights, budget, expected", [
    ([6, 10, 12], [1, 2, 3], 5, [1, 2]),            # the textbook case: 22, not the greedy 16
    ([1, 1, 1, 1], [2, 2, 2, 2], 5, [0, 1]),         # equal items: lowest indices first
    ([2, 1, 3], [0, 4, 4], 3, [0]),                  # a free item is taken, others do not fit
    ([0, 5], [1, 1], 1, [1]),                        # value 0 is never taken
    ([3, 3], [1, 1], 0, []),
])
def test_knapsack_hand_built_cases(values, weights, budget, expected):
    assert knapsack(values, weights, budget).tolist() == expected


def test_knapsack_matches_brute_force_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 11))
        values = rng.choice([0.0, 1.0, 2.0, 2.5, 3.0], n)
        weights = rng.integers(0, 7, n)  # repeats exercise the merged, power-of-two-split items
        budget = int(rng.integers(0, 20))
        chosen = knapsack(values, weights, budget)
        assert weights[chosen].sum() <= budget
        assert values[chosen].sum() == pytest.approx(_brute_force(values, weights, budget))
        assert len(set(chosen.tolist())) == chosen.size


def test_knapsack_rejects_bad_input():
    with pytest.raises(ValueError, match="integers"):
        knapsack([1.0], [0.5], 3)
    with pytest.raises(ValueError, match="budget"):
        knapsack([1.0], [1], -1)
    with pytest.raises(ValueError, match="finite"):
        knapsack([-1.0], [1], 3)
    with pytest.raises(ValueError, match="one length"):
        knapsack([1.0, 2.0], [1], 3)


# --- the paper's example (Fig. 3b, Fig. 7) ----------------------------------------------------

def _paper_example() -> ReorganisedLayer:
    """Fig. 3b: 5 kernels; dense blocks rows {0, 1, 3} x cols {0, 1} and rows {2, 3, 4} x cols
    {4, 5} (12 non-zeros); a sparse block of 4 non-zeros in 3 rows and 4 columns: #6 alone in
    row 1 (input row 6), #8 and #9 sharing row 2 (#8 reads input row 3), one more in row 4."""
    matrix = np.zeros((5, 8))
    for row in (0, 1, 3):
        matrix[row, [0, 1]] = 0.5
    for row in (2, 3, 4):
        matrix[row, [4, 5]] = 0.5
    matrix[1, 6] = 0.1   # #6
    matrix[2, 3] = 0.1   # #8
    matrix[2, 7] = 0.2   # #9
    matrix[4, 2] = 0.3
    return ReorganisedLayer.from_blocks(matrix, [([0, 1, 3], [0, 1]), ([2, 3, 4], [4, 5])])


def _benefit_of(candidates, layer, row, col) -> float:
    cell = row * layer.values.shape[1] + col
    (entry,) = np.flatnonzero((candidates.block < 0) & (candidates.index == cell))
    return float(candidates.benefit[entry])


def test_paper_example_prefers_6_to_8_and_9_gains_c1_once_8_is_gone():
    layer, c1, c2 = _paper_example(), 3.0, 0.5  # unequal C's: a swapped C1/C2 would show
    assert int(layer.remainder.sum()) == 4 and sum(int(b.owned.sum()) for b in layer.blocks) == 12
    candidates = benefits(layer, c1, c2)
    assert _benefit_of(candidates, layer, 1, 6) == c1 + c2          # #6: input row 6 and output row 1
    assert _benefit_of(candidates, layer, 2, 3) == c2               # #8: input row 3 only
    assert _benefit_of(candidates, layer, 2, 7) == c2               # #9, while #8 is there
    # With #6 and #8 equally heavy and room for one, the knapsack removes #6.
    costs = np.array([1 if (b < 0 and i in (1 * 8 + 6, 2 * 8 + 3)) else 5
                      for b, i in zip(candidates.block, candidates.index)])
    chosen = knapsack(candidates.benefit, costs, 1)
    assert chosen.size == 1 and candidates.index[chosen[0]] == 1 * 8 + 6
    eight = np.flatnonzero((candidates.block < 0) & (candidates.index == 2 * 8 + 3))
    layer.remove(candidates, eight)
    assert _benefit_of(benefits(layer, c1, c2), layer, 2, 7) == c1 + c2


def test_block_row_benefit_counts_columns_it_empties_and_removal_shrinks_the_block():
    matrix = np.zeros((4, 6))
    matrix[np.ix_([0, 1, 2], [0, 1, 2])] = 1.0
    matrix[0, 3] = 2.0               # row 0 holds column 3's only non-zero
    matrix[1, 3] = 0.0
    layer = ReorganisedLayer.from_blocks(matrix, [([0, 1, 2], [0, 1, 2, 3])])
    candidates = benefits(layer, c1=3.0, c2=0.5)
    assert candidates.benefit[candidates.block == 0].tolist() == [3.5, 3.0, 3.0]
    row0 = np.flatnonzero((candidates.block == 0) & (candidates.index == 0))
    layer.remove(candidates, row0)
    (block,) = layer.blocks
    assert block.rows.tolist() == [1, 2] and block.cols.tolist() == [0, 1, 2]
    assert not layer.values[0].any() and layer.values[1:3, :3].all()


# --- re-pruning a layer -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clustered_weight():
    """32 x (8*3*3) weight, 85% sparse, with two planted dense regions so Algorithm 1 finds blocks."""
    generator = torch.Generator().manual_seed(3)
    weight = sparse_weight((32, 8, 3, 3), 0.85, generator) * 0.1
    matrix = weight.view(32, -1)
    matrix[:10, :12] = torch.randn(10, 12, generator=generator) * 0.1
    matrix[16:26, 40:50] = torch.randn(10, 10, generator=generator) * 0.1
    return weight


@pytest.mark.parametrize("b3", [0.3, 0.2, 0.1])
def test_reprune_layer_keeps_the_l2_budget_and_builds_consistent_masks(clustered_weight, b3):
    weight = clustered_weight
    decomposition = extract_blocks(weight, SMALL_BLOCKS)
    assert decomposition.blocks, "the planted regions should form blocks"
    result = reprune_layer(weight, decomposition, b3)
    nonzero = weight != 0
    removed = weight.double()[nonzero & ~result.mask]
    assert (removed ** 2).sum() <= b3 * (weight.double() ** 2).sum()
    assert result.stats["removed_l2_share"] > 0.5 * b3  # the budget is used, not just respected
    assert not (result.mask & ~nonzero).any() and (result.mask <= result.retrain_mask).all()
    assert torch.equal(result.decomposition.to_dense(), weight * result.mask)
    cells = torch.zeros(32, 72, dtype=torch.bool)
    for block in result.decomposition.blocks:
        cells[block.rows[:, None], block.cols[None, :]] = True
    assert torch.equal(result.retrain_mask.view(32, -1), result.mask.view(32, -1) | cells)
    assert result.stats["model_cost_after"] < result.stats["model_cost_before"]
    assert result.stats["remainder_nnz_after"] < result.stats["remainder_nnz_before"]


def test_reprune_layer_with_zero_budget_removes_nothing(clustered_weight):
    result = reprune_layer(clustered_weight, extract_blocks(clustered_weight, SMALL_BLOCKS), 0.0)
    assert torch.equal(result.mask, clustered_weight != 0)


def test_reprune_layer_rejects_a_foreign_decomposition_and_bad_b3(clustered_weight):
    other = clustered_weight.clone()
    other.view(32, -1)[31, 71] = 1.0 if other.view(32, -1)[31, 71] == 0 else 0.0
    with pytest.raises(ValueError, match="does not match"):
        reprune_layer(clustered_weight, extract_blocks(other, SMALL_BLOCKS), 0.2)
    with pytest.raises(ValueError, match="b3"):
        reprune_layer(clustered_weight, extract_blocks(clustered_weight, SMALL_BLOCKS), 1.5)


# --- lenet5 end to end --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_digits():
    split = load_digits_split((1, 28, 28), seed=0)
    return DigitsSplit(split.train_x[:192], split.train_y[:192], split.test_x, split.test_y)


def test_reprune_lenet5_then_retrain_keeps_masks(small_digits):
    torch.manual_seed(0)
    model = build_model("lenet5")
    train = Batches(small_digits.train_x, small_digits.train_y, 64, shuffle=True)
    masks = {name: magnitude_mask(getattr(model, name).weight, 0.9) for name in ("conv1", "conv2", "fc1")}
    train_epochs(model, train, TrainConfig(epochs=1, lr=0.02), masks=masks)
    new_masks, retrain_masks, report = reprune_(model, masks, 0.2, BlockParams(t2=4))
    assert set(report) == {"conv1", "conv2"} and new_masks["fc1"] is masks["fc1"]
    for name in ("conv1", "conv2"):
        weight = getattr(model, name).weight
        assert not (new_masks[name] & ~masks[name]).any()
        assert torch.equal(weight != 0, new_masks[name])
        assert report[name]["nnz_after"] < report[name]["nnz_before"]
    assert report["conv2"]["num_blocks"] > 0
    train_epochs(model, train, TrainConfig(epochs=1, lr=0.01), masks=retrain_masks)
    for name in ("conv1", "conv2"):
        assert not (getattr(model, name).weight[~retrain_masks[name]]).any()
    # Zeros inside dense blocks are trainable: re-training fills them in.
    assert int(torch.count_nonzero(model.conv2.weight)) > report["conv2"]["nnz_after"]
    # The re-pruned blocks, not a new extraction of the re-trained weight, reach backend blocks.
    kept = extraction(model.conv2.weight.detach(), 4)
    assert kept.report.partitioner == "given" and len(kept.blocks) == report["conv2"]["num_blocks"]
    assert provided_blocks(retrain_masks["conv2"]) == tuple((tuple(block.rows.tolist()), tuple(block.cols.tolist()))
                                                            for block in kept.blocks)
    clear_provided_blocks()
    assert extraction(model.conv2.weight.detach(), 4).report.partitioner != "given"


def test_registered_reprune_method_returns_masks_the_weights_respect(small_digits):
    torch.manual_seed(0)
    model = build_model("lenet5")
    masks = prune_with("reprune", model, small_digits, 0.9, epochs=1, retrain_epochs=1)
    assert set(masks) == {"conv1", "conv2", "fc1"}
    for name, mask in masks.items():
        assert not getattr(model, name).weight[~mask].any()
    assert int(masks["fc1"].sum()) == round(0.1 * model.fc1.weight.numel())  # Linear layers are not re-pruned
    # conv1 (20 kernels) forms no block at B1 = 8, so re-pruning only removes from it.
    assert int(torch.count_nonzero(model.conv1.weight)) < round(0.1 * model.conv1.weight.numel())


def test_reprune_study_script_cpu_path(tmp_path):
    path = ROOT / "scripts" / "reprune_study.py"
    spec = importlib.util.spec_from_file_location("reprune_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    out = tmp_path / "reprune.jsonl"
    study.main(["--seeds", "0", "--b3", "0.2", "--dense-epochs", "1", "--finetune-epochs", "0",
                "--retrain-epochs", "1", "--train-subset", "128", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    variants = [row["variant"] for row in rows]
    assert variants == ["dense", "pruned", "pruned+retrain", "reprune"]
    reprune = rows[-1]
    assert reprune["b3"] == 0.2 and reprune["commit"] and reprune["device"]
    assert reprune["layers"]["conv2"]["remainder_nnz_after"] < reprune["layers"]["conv2"]["remainder_nnz_before"]
