"""Re-pruning a conv layer into tensor-core tiles (issue 32, item 1): groups of output channels sharing
one set of kept reduction columns, so each group is a full dense GEMM over gathered columns.

The kernel matrix A is the (pruned) weight as (K, N), N = C*R*S; a reduction column is one flat
(c, r, s) index, `c * R * S + r * S + s`. A re-pruning:
  1. orders the output channels (`TileParams.order`): "greedy" seeds a tile with the free channel
     of largest kept l2 and fills it with the free channels whose unstructured mask at the target
     (the top-`keep` |A| entries of the layer) is most similar to the seed's (cosine of the 0/1 rows;
     ties by l2, then index); "none" keeps 0..K-1. `permutation[i]` is the channel at position i,
     tile t holds positions [t*tile, (t+1)*tile) (the last tile is short when tile does not divide K);
  2. gives each tile k_t kept columns, chosen as its k_t columns of largest summed w^2 over its rows
     (the l2-optimal choice for a given k_t). The k_t are chosen greedily by gain per cell over all
     tiles, columns of all-zero tiles last, until the tiles hold `keep - remainder` cells: optimal
     when all tiles have the same number of rows (the gains are concave), near-optimal with a short
     last tile;
  3. makes the count exact: tiles of `tile` rows hold multiples of `tile` cells, so a shortfall
     d < tile is left. One tile then keeps one more column on d of its rows: it is recorded as two
     groups of that tile (d rows with the extra column first, then the others), each group's rows
     sharing its columns. At most one tile per layer is split so, one column ragged;
  4. the optional remainder: the floor(remainder * keep) largest leftover |A| entries.
The mask is every group's rows x its columns plus the remainder; exactly `keep` = round((1 -
sparsity) * numel) cells (or the input mask's count when sparsity is None).

Chunks (`TileParams.chunk` > 1, issue 45): a column is then a *unit*, a run of `chunk` consecutive
input channels at one tap (c0..c0+chunk-1, r, s), so that a kept unit is one contiguous NHWC load
for backend `tensorcore`. Steps 1-4 run on units (a unit's score per row is its cells' summed w^2)
with round(keep / w) unit cells, w = C / ceil(C / chunk) the mean unit width; each group's
columns are then its units' cells (a last chunk of a C not divisible by `chunk` is short). The kept
count is exact in units: within tile * chunk cells of `keep` when chunk divides C; a short last
chunk is counted at the mean width, so such layers may miss `keep` by more. Cells of kept columns
that the input pruned are zero in the weight and in the mask: re-training may grow them.
l2 kept = sum of kept w^2 / sum of w^2 of the input (pruned) weight, as `reprune`'s removed_l2_share.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from sparsecnn.backends.blocks.extraction import provide_blocks
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.registry import get_method
from sparsecnn.prune.rounds import check_steps, prune_in_rounds
from sparsecnn.prune.splits import training_batches
from sparsecnn.prune.training import TrainConfig, apply_masks_, train_epochs

TILE_SIZES = (16, 32, 64)
CHUNK_SIZES = (1, 8, 16, 32)
ORDERS = ("greedy", "none")
FORMAT = "sparsecnn-tiles"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class TileParams:
    """tile: output channels per group, 16, 32 or 64, or "auto" (per layer, the size keeping the most
    l2 at the target; ties go to the larger tile). sparsity: the layer's target fraction of zeros in
    [0, 1], or None for the input's own count (the mask's, else the weight's non-zeros). remainder:
    fraction in [0, 1) of the kept weights allowed outside the tiles (0: none). order: "greedy"
    (channels grouped by mask similarity) or "none" (channels in index order). chunk: input channels
    per unit, 1 (single columns), 8, 16 or 32 (module docstring)."""

    tile: Union[int, str] = 32
    sparsity: Optional[float] = None
    remainder: float = 0.0
    order: str = "greedy"
    chunk: int = 1

    def __post_init__(self):
        if not (self.tile == "auto" if isinstance(self.tile, str)
                else not isinstance(self.tile, bool) and isinstance(self.tile, numbers.Integral)
                and self.tile in TILE_SIZES):
            raise ValueError(f"TileParams.tile must be 16, 32, 64 or 'auto', got {self.tile!r}")
        if self.sparsity is not None and (isinstance(self.sparsity, bool) or not isinstance(self.sparsity, numbers.Real)
                                          or not 0.0 <= self.sparsity <= 1.0):
            raise ValueError(f"TileParams.sparsity must be None or a number in [0, 1], got {self.sparsity!r}")
        if isinstance(self.remainder, bool) or not isinstance(self.remainder, numbers.Real) \
                or not 0.0 <= self.remainder < 1.0:
            raise ValueError(f"TileParams.remainder must be a number in [0, 1), got {self.remainder!r}")
        if isinstance(self.chunk, bool) or self.chunk not in CHUNK_SIZES:
            raise ValueError(f"TileParams.chunk must be one of {', '.join(map(str, CHUNK_SIZES))}, got {self.chunk!r}")
        if self.order not in ORDERS:
            raise ValueError(f"TileParams.order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TileParams":
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class TileGroup:
    """Output channels `rows` (original indices) sharing kept reduction columns `cols` (flat (c, r, s)
    indices, ascending), inside tile number `tile` of the permutation."""

    tile: int
    rows: Tuple[int, ...]
    cols: Tuple[int, ...]

    @property
    def cells(self) -> int:
        return len(self.rows) * len(self.cols)


@dataclasses.dataclass(frozen=True)
class TileDecomposition:
    """One layer re-pruned into tiles (module docstring). shape: the weight's; tile: rows per tile
    (the chosen one under "auto"); permutation: channel at each position; groups: in position order,
    each a contiguous slice of the permutation; remainder: flat indices (into the weight) of the kept
    weights outside the groups, ascending; l2_kept: kept share of the input's sum of w^2; mask: bool,
    the weight's shape, on CPU."""

    shape: Tuple[int, ...]
    tile: int
    permutation: Tuple[int, ...]
    groups: Tuple[TileGroup, ...]
    remainder: Tuple[int, ...]
    l2_kept: float
    params: TileParams
    mask: torch.Tensor = dataclasses.field(compare=False, repr=False)

    @property
    def kept(self) -> int:
        return sum(group.cells for group in self.groups) + len(self.remainder)

    @property
    def blocks(self) -> Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]:
        """(rows, cols) of each tile group: the dense blocks backend `blocks` runs as they are."""
        return tuple((group.rows, group.cols) for group in self.groups)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.kept / math.prod(self.shape)

    @property
    def num_tiles(self) -> int:
        return -(-self.shape[0] // self.tile)

    def to_dict(self) -> dict:
        """Plain JSON values only (fits a `save_pruned` report); `from_dict` rebuilds the mask."""
        return {"format": FORMAT, "version": VERSION, "shape": list(self.shape), "tile": self.tile,
                "permutation": list(self.permutation),
                "groups": [{"tile": g.tile, "rows": list(g.rows), "cols": list(g.cols)} for g in self.groups],
                "remainder": list(self.remainder), "l2_kept": self.l2_kept, "params": self.params.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "TileDecomposition":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a sparsecnn tile decomposition")
        if data.get("version") != VERSION:
            raise ValueError(f"tile decomposition version {data.get('version')!r}, expected {VERSION}")
        shape = tuple(int(v) for v in data["shape"])
        groups = tuple(TileGroup(int(g["tile"]), tuple(map(int, g["rows"])), tuple(map(int, g["cols"])))
                       for g in data["groups"])
        remainder = tuple(map(int, data["remainder"]))
        return cls(shape, int(data["tile"]), tuple(map(int, data["permutation"])), groups, remainder,
                   float(data["l2_kept"]), TileParams.from_dict(data["params"]), _mask(shape, groups, remainder))


def _mask(shape: Tuple[int, ...], groups, remainder) -> torch.Tensor:
    matrix = np.zeros((shape[0], math.prod(shape[1:])), dtype=bool)
    for group in groups:
        matrix[np.ix_(np.asarray(group.rows, dtype=np.int64), np.asarray(group.cols, dtype=np.int64))] = True
    matrix.reshape(-1)[np.asarray(remainder, dtype=np.int64)] = True
    return torch.from_numpy(matrix).reshape(shape)


def _top(values: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest entries of 1-D `values`, ties by lower index."""
    return np.argsort(-values, kind="stable")[:count]


def _order(squares: np.ndarray, keep: int, tile: int, order: str) -> np.ndarray:
    rows = squares.shape[0]
    if order == "none" or rows <= tile:
        return np.arange(rows)
    support = np.zeros(squares.size)
    support[_top(squares.reshape(-1), keep)] = 1.0
    support = support.reshape(squares.shape)
    norms = np.sqrt(support.sum(axis=1))
    unit = support / np.where(norms > 0, norms, 1.0)[:, None]
    energy = squares.sum(axis=1)
    free = np.ones(rows, dtype=bool)
    permutation = []
    while free.any():
        index = np.flatnonzero(free)
        seed = index[np.argmax(energy[index])]
        similarity = unit[index] @ unit[seed]
        similarity[index == seed] = np.inf
        chosen = index[np.lexsort((index, -energy[index], -similarity))][:tile]
        permutation.extend(chosen.tolist())
        free[chosen] = False
    return np.asarray(permutation, dtype=np.int64)


def _decompose(squares: np.ndarray, keep: int, tile: int, remainder_count: int, order: str):
    """(permutation, groups, remainder flat indices, l2 kept) of the (K, N) `squares` = w^2."""
    rows, cols = squares.shape
    permutation = _order(squares, keep, tile, order)
    tiles = [permutation[start:start + tile] for start in range(0, rows, tile)]
    sizes = [len(t) for t in tiles]
    scores = [squares[t].sum(axis=0) for t in tiles]
    ranked = [np.lexsort((np.arange(cols), -score)) for score in scores]  # columns by score, ties by index
    zero = np.array([not score.any() for score in scores])
    # all (tile, rank) items, best gain per cell first; all-zero tiles last; then tile, rank
    tile_of = np.repeat(np.arange(len(tiles)), cols)
    rank_of = np.tile(np.arange(cols), len(tiles))
    gain = np.concatenate([score[r] / size for score, r, size in zip(scores, ranked, sizes)])
    taken = [0] * len(tiles)
    left = keep - remainder_count
    smallest = min(sizes) if sizes else 1
    for item in np.lexsort((rank_of, tile_of, zero[tile_of], -gain)).tolist():
        if left < smallest:
            break
        t = int(tile_of[item])
        if taken[t] == rank_of[item] and sizes[t] <= left:
            taken[t] += 1
            left -= sizes[t]
    groups = []
    split = None
    if left > 0:  # fewer than `tile` cells short: one tile keeps one more column on `left` of its rows
        best = None
        for t, rows_t in enumerate(tiles):
            if taken[t] == cols or sizes[t] <= left:
                continue
            free_cols = ranked[t][taken[t]:]
            part = np.sort(squares[np.ix_(rows_t, free_cols)], axis=0)[-left:].sum(axis=0)
            at = int(np.argmax(part))
            key = (float(part[at]), not zero[t], -t)
            if best is None or key > best[0]:
                best = (key, t, int(free_cols[at]))
        _, t, column = best
        order_rows = _top(squares[tiles[t], column], left)
        first = np.zeros(sizes[t], dtype=bool)
        first[order_rows] = True
        tiles[t] = np.concatenate([tiles[t][first], tiles[t][~first]])
        split = (t, column, left)
    permutation = np.concatenate(tiles) if tiles else permutation
    for t, rows_t in enumerate(tiles):
        kept = np.sort(ranked[t][:taken[t]])
        if split is not None and split[0] == t:
            count = split[2]
            extra = np.sort(np.append(kept, split[1]))
            groups.append(TileGroup(t, tuple(rows_t[:count].tolist()), tuple(extra.tolist())))
            rows_t = rows_t[count:]
        if len(rows_t) and kept.size:
            groups.append(TileGroup(t, tuple(rows_t.tolist()), tuple(kept.tolist())))
    matrix = np.zeros(squares.shape, dtype=bool)
    for group in groups:
        matrix[np.ix_(np.asarray(group.rows), np.asarray(group.cols))] = True
    leftover = np.where(matrix.reshape(-1), -np.inf, squares.reshape(-1))
    remainder = np.sort(_top(leftover, remainder_count))
    matrix.reshape(-1)[remainder] = True
    total = squares.sum()
    l2_kept = float(squares[matrix].sum() / total) if total > 0 else 1.0
    return permutation, tuple(groups), remainder, l2_kept


def reprune_tiles(weight: torch.Tensor, mask: Optional[torch.Tensor], params: TileParams) -> TileDecomposition:
    """Re-prune one layer into tiles (module docstring).

    weight: (K, C, R, S) (any shape with K first), floating; mask: bool of its shape (True where kept)
    or None (the weight as it is). The column choice maximises the kept l2 of `weight * mask`.
    Returns a `TileDecomposition` whose mask keeps exactly round((1 - params.sparsity) * numel) cells
    (with sparsity None: the mask's count, else the weight's non-zeros).
    """
    if not isinstance(params, TileParams):
        raise TypeError(f"params must be a TileParams, got {type(params).__name__}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() < 2:
        raise ValueError("weight must be a floating tensor of at least 2 dimensions, output channels first")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != weight.shape):
        raise ValueError(f"mask must be bool of the weight's shape {tuple(weight.shape)}, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    pruned = weight.detach() if mask is None else weight.detach() * mask.to(weight.device)
    matrix = pruned.reshape(weight.shape[0], -1).cpu().double().numpy()
    if params.sparsity is not None:
        keep = round((1.0 - float(params.sparsity)) * matrix.size)
    else:
        keep = int(mask.sum()) if mask is not None else int(np.count_nonzero(matrix))
    units = _Units(tuple(weight.shape), params.chunk)
    squares = units.scores(matrix ** 2)
    keep_units = round(keep / units.mean_width)
    remainder_count = math.floor(params.remainder * keep_units)
    best = None
    for tile in (sorted(TILE_SIZES, reverse=True) if params.tile == "auto" else [params.tile]):
        result = _decompose(squares, keep_units, tile, remainder_count, params.order)
        if best is None or result[3] > best[1][3] + 1e-12:
            best = (tile, result)
    tile, (permutation, groups, remainder, l2_kept) = best
    groups = tuple(TileGroup(g.tile, g.rows, units.cells(g.cols)) for g in groups)
    remainder = units.remainder_cells(remainder)
    shape = tuple(weight.shape)
    return TileDecomposition(shape, tile, tuple(permutation.tolist()), groups, tuple(remainder), l2_kept,
                             params, _mask(shape, groups, remainder))


class _Units:
    """Columns of a (K, C, R, S) weight's (K, C*R*S) matrix grouped into units of `chunk` input
    channels at one tap: unit u = c_chunk * R*S + tap covers cells (c * R*S + tap) for c in the chunk."""

    def __init__(self, shape: Tuple[int, ...], chunk: int):
        self.rows, self.channels = shape[0], shape[1] if len(shape) > 1 else 1
        self.taps = math.prod(shape[2:])
        self.chunk = chunk
        self.chunks = -(-self.channels // chunk)

    @property
    def mean_width(self) -> float:
        """Cells per row of a unit, on average (a last chunk of a C not divisible by chunk is short)."""
        return self.channels / self.chunks

    def scores(self, squares: np.ndarray) -> np.ndarray:
        """(K, units): each unit's summed cell scores per row."""
        if self.chunk == 1:
            return squares
        padded = np.zeros((self.rows, self.chunks * self.chunk, self.taps))
        padded[:, :self.channels] = squares.reshape(self.rows, self.channels, self.taps)
        return padded.reshape(self.rows, self.chunks, self.chunk, self.taps).sum(axis=2).reshape(self.rows, -1)

    def cells(self, unit_cols: Tuple[int, ...]) -> Tuple[int, ...]:
        """The ascending cell columns of units `unit_cols`."""
        if self.chunk == 1:
            return tuple(unit_cols)
        cols = []
        for unit in unit_cols:
            first, tap = divmod(unit, self.taps)
            channels = range(first * self.chunk, min((first + 1) * self.chunk, self.channels))
            cols.extend(c * self.taps + tap for c in channels)
        return tuple(sorted(cols))

    def remainder_cells(self, flat_units: np.ndarray) -> list:
        """Flat weight indices of the cells of (row, unit) entries `flat_units` of the (K, units) matrix."""
        columns = self.chunks * self.taps
        cells = [row * self.channels * self.taps + col for index in flat_units.tolist()
                 for row, unit in [divmod(index, columns)] for col in self.cells((unit,))]
        return sorted(cells)


_CONV_TYPES = (nn.Conv1d, nn.Conv2d)


@torch.no_grad()
def reprune_tiles_(model: nn.Module, masks: Masks,
                   params: TileParams) -> Tuple[Masks, Dict[str, TileDecomposition]]:
    """Re-prune into tiles, in place, every Conv1d/Conv2d with groups == 1 that `masks` names; its
    weights outside the new mask are zeroed. Other masked layers (Linear, grouped convs) keep their
    masks. The tiles of each Conv2d are handed to backend `blocks` (`provide_blocks`), which then
    runs that layer's tiles as its dense blocks instead of extracting its own. Returns (masks,
    {layer: TileDecomposition})."""
    modules = dict(model.named_modules())
    new_masks, decompositions = {}, {}
    for name, mask in masks.items():
        if name not in modules:
            raise KeyError(f"mask for {name!r} but the model has no such module")
        module = modules[name]
        if not isinstance(module, _CONV_TYPES) or module.groups != 1:
            new_masks[name] = mask
            continue
        decomposition = reprune_tiles(module.weight, mask.to(torch.bool), params)
        module.weight.mul_(decomposition.mask.to(module.weight.device))
        if decomposition.mask.dim() == 4:
            provide_blocks(decomposition.mask, decomposition.blocks)
        new_masks[name] = decomposition.mask.to(mask.device)
        decompositions[name] = decomposition
    return new_masks, decompositions


def reprune_tiles_method(model: nn.Module, split, sparsity, seed: int = 0, progress: bool = False,
                         epochs: Optional[int] = None, batch_size: int = 64, lr: float = 0.01,
                         tile: Union[int, str] = 32, remainder: float = 0.0, order: str = "greedy",
                         chunk: int = 1, retrain_epochs: Optional[int] = None, train: Optional[TrainConfig] = None,
                         steps: int = 1) -> Masks:
    """Pruning method "reprune-tiles" (see `methods`): the "magnitude" method (prune each layer to its
    target, fine-tune `epochs`, default 8), then `reprune_tiles_` of the convs at the same kept count
    (`TileParams(tile, None, remainder, order, chunk)`), then `retrain_epochs` (default: `epochs` when given,
    else 4) of masked re-training. steps > 1: the same epochs in `steps` rounds instead
    (`rounds.prune_in_rounds`), the targets rising to `sparsity`. Returns the tile masks (convs) and the
    magnitude masks (others)."""
    params = TileParams(tile=tile, sparsity=None, remainder=remainder, order=order, chunk=chunk)
    retrain = retrain_epochs if retrain_epochs is not None else (4 if epochs is None else epochs)
    if check_steps(steps) > 1:
        return prune_in_rounds(model, split, sparsity, steps, (8 if epochs is None else epochs) + retrain,
                               lambda rounded, masks: reprune_tiles_(rounded, masks, params)[0], seed=seed,
                               progress=progress, batch_size=batch_size, lr=lr, train=train,
                               description="reprune-tiles")
    masks = get_method("magnitude")(model, split, sparsity, seed=seed, progress=progress, epochs=epochs,
                                    batch_size=batch_size, lr=lr, train=train)
    masks, _ = reprune_tiles_(model, masks, params)
    masks = broadcast_tensors_(masks)  # rank 0's re-pruning decisions
    apply_masks_(model, masks)
    train_epochs(model, training_batches(model, split, batch_size, seed),
                 (train or TrainConfig()).phase(retrain, lr, seed, progress), masks=masks,
                 description="reprune-tiles re-train")
    return masks