"""Performance-aware re-pruning of OptPrune (paper 000, Sec. 5) on a layer reorganised by Algorithm 1.

Performance model (Sec. 5.1, Fig. 7). The kernel matrix W (K x C*R*S) multiplies an input matrix
with one row per kernel-matrix column into an output matrix with one row per kernel. C1 is the
time to write an output row, C2 to read an input row; the paper sets both to 1 (the two matrices
have the same number of columns), and so do we (`C1`, `C2`).
  * Sparse remainder, run row-wise: every non-zero reads its own input row (no reuse across rows)
    and a row's results stay in registers until one write. Removing a non-zero saves C2, plus C1
    when it is the last non-zero of its remainder row.
  * Dense block (GEMM): only whole rows or columns can go. Removing a block row saves C1, plus C2
    for each block column in which that row holds the block's only non-zero (the column empties).
    The candidates are block rows, as in the paper's description; emptied columns leave with them.
The model cost of a layer is C1 * (non-empty remainder rows + block rows) + C2 * (remainder
non-zeros + block columns); a removal's benefit is the cost it saves.

Budget (Eq. 1): sum of removed w^2 <= B3 * sum of the layer's w^2. Knapsack weights are
ceil(1000 w^2) as in the paper; the capacity is floor(1000 * B3 * sum w^2) where the paper writes
ceil: since ceil(1000 w^2) >= 1000 w^2, floor makes every solution satisfy Eq. 1 exactly, where
ceil could overshoot it by up to 1/1000.

Benefits change as rows empty (#9 gains C1 once #8 is gone, Sec. 5.2). The paper solves one
0/1 knapsack on the reorganised layer's benefits; we solve that one, then repeat on what is left
with the leftover budget and recomputed benefits until a round removes nothing: the first round
is the paper's solution, later rounds only spend what it left.

Re-training (Sec. 3): the mask keeps the remaining non-zeros and every cell of the remaining dense
blocks, whose zeros cost nothing extra to compute and may be re-trained to non-zero.

Backend `blocks` computes per tile of output channels (a dense part over the union of the tile's
block columns plus an ELL loop as long as the tile's longest remainder row), and writes every
output row once; the paper's C1/C2 model is only an approximation of its cost, so speed gains are
measured (`scripts/reprune_study.py`), not inferred from the model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from sparsecnn.backends.blocks.extraction import provide_blocks
from sparsecnn.backends.blocks.format import (
    BlockDecomposition,
    BlockParams,
    BlockReport,
    DenseBlock,
    extract_blocks,
)
from sparsecnn.core.csr import CSRWeight
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.registry import get_method
from sparsecnn.prune.splits import training_batches
from sparsecnn.prune.training import TrainConfig, apply_masks_, train_epochs

C1 = 1.0  # time to write one output row (paper 000, Sec. 5.2: C1 = C2 = 1)
C2 = 1.0  # time to read one input row
RESOLUTION = 1000  # knapsack weight of w is ceil(RESOLUTION * w^2) (paper: 1000)
_MAX_TABLE_CELLS = 2**31  # bool decision table of the knapsack DP: 2 GiB at most
_CONV_TYPES = (nn.Conv1d, nn.Conv2d)


# --- the reorganised layer ----------------------------------------------------------------------

@dataclasses.dataclass
class LayerBlock:
    """A dense block of a `ReorganisedLayer`: rows int64 (m,), cols int64 (k,) of the kernel matrix;
    owned bool (m, k): the non-zeros that belong to the block (its other cells are zeros); level:
    the Algorithm 1 iteration that found it."""

    rows: np.ndarray
    cols: np.ndarray
    owned: np.ndarray
    level: int = 0


@dataclasses.dataclass
class ReorganisedLayer:
    """A kernel matrix split into dense blocks and a sparse remainder, editable by removals.

    values: float64 (K, N) kernel matrix (zeros where pruned); remainder: bool (K, N), the
    remainder's non-zeros; blocks: `LayerBlock`s. Every non-zero is in exactly one of them.
    """

    values: np.ndarray
    remainder: np.ndarray
    blocks: List[LayerBlock]

    @classmethod
    def from_decomposition(cls, decomposition: BlockDecomposition) -> "ReorganisedLayer":
        """The layer of `extract_blocks`' result (values taken from its blocks and remainder)."""
        values = decomposition.to_dense().reshape(decomposition.kernel_shape[0], -1).double().numpy()
        blocks = [LayerBlock(b.rows.numpy().copy(), b.cols.numpy().copy(), (b.values != 0).numpy(), b.level)
                  for b in decomposition.blocks]
        return cls(values, (decomposition.remainder.to_dense() != 0).numpy(), blocks)

    @classmethod
    def from_blocks(cls, matrix, blocks: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> "ReorganisedLayer":
        """A hand-built reorganisation: `matrix` (K, N) and blocks as (rows, cols) index lists.

        Each non-zero belongs to the first listed block whose cells hold it, else to the remainder.
        """
        values = np.array(matrix, dtype=np.float64)
        if values.ndim != 2:
            raise ValueError(f"matrix must be 2-D (K, N), got shape {values.shape}")
        free = values != 0
        layer_blocks = []
        for rows, cols in blocks:
            rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
            owned = free[np.ix_(rows, cols)]
            free[np.ix_(rows, cols)] = False
            layer_blocks.append(LayerBlock(rows, cols, owned))
        return cls(values, free, layer_blocks)

    @property
    def nonzero(self) -> np.ndarray:
        """bool (K, N): the non-zeros left."""
        return self.values != 0

    def block_cells(self) -> np.ndarray:
        """bool (K, N): every cell of every block, zeros included."""
        cells = np.zeros(self.values.shape, dtype=bool)
        for block in self.blocks:
            cells[np.ix_(block.rows, block.cols)] = True
        return cells

    def model_cost(self, c1: float = C1, c2: float = C2) -> float:
        """The paper's cost: C1 per written output row, C2 per read input row (module docstring)."""
        rows = int(self.remainder.any(axis=1).sum()) + sum(b.rows.size for b in self.blocks)
        reads = int(self.remainder.sum()) + sum(b.cols.size for b in self.blocks)
        return c1 * rows + c2 * reads

    def remove(self, candidates: "Candidates", chosen: np.ndarray) -> None:
        """Remove candidates `chosen` (indices into `candidates`): zero their non-zeros, drop chosen
        block rows and the block columns and blocks left without non-zeros."""
        chosen_block = candidates.block[chosen]
        cells = candidates.index[chosen][chosen_block < 0]
        self.values.flat[cells] = 0.0
        self.remainder.flat[cells] = False
        for index, block in enumerate(self.blocks):
            gone = np.zeros(block.rows.size, dtype=bool)
            gone[candidates.index[chosen][chosen_block == index]] = True
            if not gone.any():
                continue
            sub = self.values[np.ix_(block.rows[gone], block.cols)]
            self.values[np.ix_(block.rows[gone], block.cols)] = np.where(block.owned[gone], 0.0, sub)
            block.rows, block.owned = block.rows[~gone], block.owned[~gone]
            kept = block.owned.any(axis=0)
            block.cols, block.owned = block.cols[kept], block.owned[:, kept]
        self.blocks = [b for b in self.blocks if b.rows.size and b.cols.size]


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The removals one knapsack round chooses among; entry i is one removal.

    block: int64 (n,), -1 for a remainder non-zero, else the index in `layer.blocks` of the block
    losing a row; index: int64 (n,), the flat K*N cell of a remainder non-zero or the row's
    position in its block; benefit: float64 (n,), model cost saved (C1, C2 units).
    """

    block: np.ndarray
    index: np.ndarray
    benefit: np.ndarray

    def __len__(self) -> int:
        return self.benefit.size

    def costs(self, layer: ReorganisedLayer, cell_costs: np.ndarray) -> np.ndarray:
        """(n,) in `cell_costs`' dtype: per removal, the sum of `cell_costs` ((K, N): knapsack weights
        ceil(1000 w^2), or w^2 itself) over the non-zeros it removes."""
        costs = np.zeros(len(self), dtype=cell_costs.dtype)
        remainder = self.block < 0
        costs[remainder] = cell_costs.flat[self.index[remainder]]
        for index, block in enumerate(layer.blocks):
            which = np.flatnonzero(self.block == index)
            row_costs = (cell_costs[np.ix_(block.rows, block.cols)] * block.owned).sum(axis=1)
            costs[which] = row_costs[self.index[which]]
        return costs


def benefits(layer: ReorganisedLayer, c1: float = C1, c2: float = C2) -> Candidates:
    """Every removal candidate of `layer` and its benefit under the paper's model.

    Remainder non-zero: C2, plus C1 if it is the last one of its remainder row. Block row: C1, plus
    C2 per block column in which it holds the only non-zero. (paper 000, Sec. 5.1, Fig. 7)
    """
    if c1 < 0 or c2 < 0:
        raise ValueError(f"c1 and c2 must be >= 0, got c1={c1!r}, c2={c2!r}")
    cells = np.flatnonzero(layer.remainder)
    row_counts = layer.remainder.sum(axis=1)
    parts_block = [np.full(cells.size, -1, dtype=np.int64)]
    parts_index = [cells]
    parts_benefit = [c2 + c1 * (row_counts[cells // layer.values.shape[1]] == 1)]
    for index, block in enumerate(layer.blocks):
        sole = block.owned & (block.owned.sum(axis=0) == 1)[None, :]
        parts_block.append(np.full(block.rows.size, index, dtype=np.int64))
        parts_index.append(np.arange(block.rows.size, dtype=np.int64))
        parts_benefit.append(c1 + c2 * sole.sum(axis=1))
    return Candidates(np.concatenate(parts_block), np.concatenate(parts_index),
                      np.concatenate(parts_benefit).astype(np.float64))


# --- knapsack -----------------------------------------------------------------------------------

def knapsack(values, weights, budget: int) -> np.ndarray:
    """Exact 0/1 knapsack: sorted int64 indices maximising sum(values[i]) with sum(weights[i]) <= budget.

    values: (n,) finite numbers >= 0; weights: (n,) integers >= 0; budget: integer >= 0. Dynamic
    programming over capacities 0..budget (the classic pseudo-polynomial algorithm, paper's [13]).
    Items with equal (value, weight) are one bounded item, split into pieces of 1, 2, 4, ..., rest
    copies (exact for 0/1): a layer's thousands of candidates take few distinct pairs, since values
    are small sums of C1 and C2. Among equal items the lowest indices are taken; items of value 0
    never are.
    """
    values, weights, budget = _check_knapsack(values, weights, budget)
    useful = np.flatnonzero((values > 0) & (weights <= budget))
    free = useful[weights[useful] == 0]
    paid = useful[weights[useful] > 0]
    # Sorting by (value, weight, index) makes equal pairs adjacent, lowest index first.
    paid = paid[np.lexsort((paid, weights[paid], values[paid]))]
    starts = np.flatnonzero(np.r_[True, (np.diff(values[paid]) != 0) | (np.diff(weights[paid]) != 0)])
    groups = np.split(paid, starts[1:]) if paid.size else []
    pieces = [(group, size) for group in groups for size in _binary_split(group.size)]
    counts = _dp_piece_counts([(values[g[0]] * s, int(weights[g[0]]) * s) for g, s in pieces], budget)
    taken = {}
    for (group, size), take in zip(pieces, counts):
        taken[id(group)] = taken.get(id(group), 0) + size * take
    chosen = [free] + [group[:taken.get(id(group), 0)] for group in groups]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def _check_knapsack(values, weights, budget) -> Tuple[np.ndarray, np.ndarray, int]:
    values = np.asarray(values, dtype=np.float64)
    weights_in = np.asarray(weights)
    if values.ndim != 1 or weights_in.shape != values.shape:
        raise ValueError(f"values and weights must be 1-D of one length, got shapes {values.shape} "
                         f"and {weights_in.shape}")
    if not np.all(np.isfinite(values)) or (values < 0).any():
        raise ValueError("values must be finite and >= 0")
    if weights_in.size and (weights_in.dtype.kind not in "iu" or (weights_in < 0).any()):
        raise ValueError(f"weights must be integers >= 0, got dtype {weights_in.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    return values, weights_in.astype(np.int64), int(budget)


def _binary_split(count: int) -> List[int]:
    """1, 2, 4, ... and the rest, summing to `count`: any 0..count is a sum of a subset of them."""
    sizes, size = [], 1
    while count > 0:
        sizes.append(min(size, count))
        count -= sizes[-1]
        size *= 2
    return sizes


def _dp_piece_counts(pieces: List[Tuple[float, int]], budget: int) -> List[int]:
    """0/1 DP over (value, weight) pieces (weights >= 1); 1 for each piece of an optimal choice."""
    if len(pieces) * (budget + 1) > _MAX_TABLE_CELLS:
        raise ValueError(f"knapsack table of {len(pieces)} x {budget + 1} cells is too large; "
                         f"lower the resolution")
    best = np.zeros(budget + 1)
    took = np.zeros((len(pieces), budget + 1), dtype=bool)
    for row, (value, weight) in enumerate(pieces):
        if weight > budget:  # a piece of many copies can outweigh the budget; its smaller pieces cannot
            continue
        with_piece = best[:budget + 1 - weight] + value
        better = with_piece > best[weight:]
        took[row, weight:] = better
        best[weight:] = np.where(better, with_piece, best[weight:])
    counts, capacity = [0] * len(pieces), budget
    for row in range(len(pieces) - 1, -1, -1):
        if took[row, capacity]:
            counts[row] = 1
            capacity -= pieces[row][1]
    return counts


# --- re-pruning -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerReprune:
    """Result of re-pruning one layer.

    mask: bool, the weight's shape, the non-zeros kept; retrain_mask: bool, the same plus every
    cell of the remaining dense blocks (trainable in re-training); decomposition: the re-pruned
    blocks and remainder (a `BlockDecomposition` with the original params), ready for backend
    `blocks`' packing; stats: what changed (see `reprune_layer`).
    """

    mask: torch.Tensor
    retrain_mask: torch.Tensor
    decomposition: BlockDecomposition
    stats: Dict[str, float]


def reprune_layer(weight: torch.Tensor, decomposition: BlockDecomposition, b3: float, *,
                  c1: float = C1, c2: float = C2, resolution: int = RESOLUTION) -> LayerReprune:
    """Re-prune one layer reorganised by Algorithm 1 (`decomposition` = extract_blocks(weight)).

    weight: (K, C, R, S) (or any shape with K first), zeros pruned; b3: budget ratio in [0, 1]
    (paper: 0.3, 0.2, 0.1). Chooses removals maximising the model benefit with sum of removed
    w^2 <= b3 * sum w^2 (module docstring). stats: nnz / remainder_nnz / share_in_blocks /
    model_cost before and after, remainder_rows_emptied, block_rows_removed, block_cols_removed,
    removed_l2_share (removed w^2 / all w^2), rounds (knapsack rounds run).
    """
    if not isinstance(b3, (int, float)) or isinstance(b3, bool) or not 0 <= b3 <= 1:
        raise ValueError(f"b3 must be a number in [0, 1], got {b3!r}")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ValueError(f"resolution must be an int >= 1, got {resolution!r}")
    layer = ReorganisedLayer.from_decomposition(decomposition)
    matrix = weight.detach().reshape(weight.shape[0], -1).cpu().double().numpy()
    if matrix.shape != layer.values.shape or not np.array_equal(matrix != 0, layer.nonzero):
        raise ValueError(f"decomposition ({decomposition.kernel_shape}) does not match weight "
                         f"{tuple(weight.shape)}: pass extract_blocks(weight)")
    before = _layer_stats(layer, c1, c2)
    squares = layer.values ** 2
    rounds = _knapsack_rounds(layer, math.floor(resolution * b3 * squares.sum()), resolution, c1, c2)
    after = _layer_stats(layer, c1, c2)
    stats = {f"{key}_before": value for key, value in before.items()}
    stats.update({f"{key}_after": value for key, value in after.items()})
    stats.update(
        remainder_rows_emptied=int(before["remainder_rows"] - after["remainder_rows"]),
        block_rows_removed=int(before["block_rows"] - after["block_rows"]),
        block_cols_removed=int(before["block_cols"] - after["block_cols"]),
        removed_l2_share=float(1 - (layer.values ** 2).sum() / squares.sum()) if squares.sum() else 0.0,
        rounds=rounds)
    mask = torch.from_numpy(layer.nonzero).reshape(weight.shape).to(weight.device)
    retrain = torch.from_numpy(layer.nonzero | layer.block_cells()).reshape(weight.shape).to(weight.device)
    return LayerReprune(mask, retrain, _decomposition(layer, decomposition, weight.dtype), stats)


def _knapsack_rounds(layer: ReorganisedLayer, budget: int, resolution: int, c1: float, c2: float) -> int:
    """Remove from `layer` what the knapsack chooses, round after round on the leftover `budget`
    (integer, in units of 1 / resolution of w^2) with benefits recomputed; returns the rounds run."""
    squares = layer.values ** 2
    cell_costs = np.ceil(resolution * squares).astype(np.int64)
    rounds = 0
    while True:
        candidates = benefits(layer, c1, c2)
        costs = candidates.costs(layer, cell_costs)
        # Equal (benefit, cost) pairs are taken lowest index first: ordering by w^2 makes the
        # smallest real weights go first.
        order = np.argsort(candidates.costs(layer, squares), kind="stable")
        chosen = order[knapsack(candidates.benefit[order], costs[order], budget)]
        if not chosen.size:
            return rounds
        rounds += 1
        budget -= int(costs[chosen].sum())
        layer.remove(candidates, chosen)


def _layer_stats(layer: ReorganisedLayer, c1: float, c2: float) -> Dict[str, float]:
    nnz = int(layer.nonzero.sum())
    remainder = int(layer.remainder.sum())
    return {"nnz": nnz, "remainder_nnz": remainder,
            "share_in_blocks": (nnz - remainder) / nnz if nnz else 0.0,
            "remainder_rows": int(layer.remainder.any(axis=1).sum()),
            "block_rows": sum(b.rows.size for b in layer.blocks),
            "block_cols": sum(b.cols.size for b in layer.blocks),
            "model_cost": layer.model_cost(c1, c2)}


def _decomposition(layer: ReorganisedLayer, original: BlockDecomposition, dtype: torch.dtype) -> BlockDecomposition:
    """`layer` as a `BlockDecomposition` with `original`'s shape, params and partitioner."""
    values = torch.from_numpy(layer.values).to(dtype)
    blocks = tuple(DenseBlock(torch.from_numpy(b.rows), torch.from_numpy(b.cols),
                              values[b.rows[:, None], b.cols[None, :]] * torch.from_numpy(b.owned), b.level)
                   for b in layer.blocks)
    remainder = CSRWeight.from_dense(values * torch.from_numpy(layer.remainder))
    nnz, in_blocks = int(layer.nonzero.sum()), sum(block.nnz for block in blocks)
    cells = sum(block.cells for block in blocks)
    report = BlockReport(
        num_blocks=len(blocks), num_levels=1 + max((b.level for b in blocks), default=-1), nnz=nnz,
        nnz_in_blocks=in_blocks, block_cells=cells, share_in_blocks=in_blocks / nnz if nnz else 0.0,
        fill=in_blocks / cells if cells else 0.0, extra_flops=(cells - in_blocks) / nnz if nnz else 0.0,
        seconds=original.report.seconds, partitioner=original.report.partitioner)
    return BlockDecomposition(blocks, remainder, original.kernel_shape, original.params, report)


@torch.no_grad()
def reprune_(model: nn.Module, masks: Masks, b3: float, params: Optional[BlockParams] = None, *,
             c1: float = C1, c2: float = C2,
             resolution: int = RESOLUTION) -> Tuple[Masks, Masks, Dict[str, Dict[str, float]]]:
    """Re-prune, in place, every Conv1d/Conv2d of `model` that `masks` names (paper 000, Sec. 5).

    Each layer is reorganised by Algorithm 1 (`extract_blocks(weight, params)`), re-pruned with
    `reprune_layer` and its removed weights zeroed; the re-pruned blocks of each Conv2d are handed to
    backend `blocks` with its re-training mask (`provide_blocks`), which then runs them as they are
    instead of extracting the re-trained weight again. Other masked layers (Linear) are left alone.
    Returns (masks of the kept non-zeros, re-training masks (those plus all dense-block cells),
    {layer: stats of `reprune_layer` plus the Algorithm 1 report's num_blocks and fill}).
    """
    modules = dict(model.named_modules())
    new_masks, retrain_masks, report = {}, {}, {}
    for name, mask in masks.items():
        if name not in modules:
            raise KeyError(f"mask for {name!r} but the model has no such module")
        module = modules[name]
        if not isinstance(module, _CONV_TYPES):
            new_masks[name], retrain_masks[name] = mask, mask
            continue
        weight = module.weight * mask.to(module.weight.device)
        result = reprune_layer(weight, extract_blocks(weight, params), b3, c1=c1, c2=c2, resolution=resolution)
        module.weight.mul_(result.mask)
        new_masks[name] = result.mask.to(mask.device)
        retrain_masks[name] = result.retrain_mask.to(mask.device)
        if result.retrain_mask.dim() == 4:
            provide_blocks(result.retrain_mask.cpu(), [(block.rows.tolist(), block.cols.tolist())
                                                       for block in result.decomposition.blocks])
        report[name] = dict(result.stats, num_blocks=result.decomposition.report.num_blocks,
                            fill=result.decomposition.report.fill)
    return new_masks, retrain_masks, report


def reprune_method(model: nn.Module, split, sparsity, seed: int = 0, progress: bool = False,
                   epochs: Optional[int] = None, batch_size: int = 64, lr: float = 0.01, b3: float = 0.2,
                   t2: int = 4, retrain_epochs: int = 4, train: Optional[TrainConfig] = None) -> Masks:
    """Pruning method "reprune" (see `methods`): the "magnitude" method (prune, fine-tune `epochs`),
    then Algorithm 1 (`BlockParams(t2=t2)`; 4 suits convs of < 100 kernels, where t1 = 8 groups
    hold too few rows for t2 = 8) and re-pruning of the convs with `b3`, then `retrain_epochs` of
    re-training (paper: < 10). Returns the re-training masks: the kept non-zeros plus every cell of
    the dense blocks, whose zeros re-training may have made non-zero.
    """
    masks = get_method("magnitude")(model, split, sparsity, seed=seed, progress=progress, epochs=epochs,
                                    batch_size=batch_size, lr=lr, train=train)
    _, retrain_masks, _ = reprune_(model, masks, b3, BlockParams(t2=t2))
    retrain_masks = broadcast_tensors_(retrain_masks)  # rank 0's re-pruning decisions
    apply_masks_(model, retrain_masks)
    train_epochs(model, training_batches(model, split, batch_size, seed),
                 (train or TrainConfig()).phase(retrain_epochs, lr, seed, progress), masks=retrain_masks,
                 description="reprune re-train")
    return retrain_masks
