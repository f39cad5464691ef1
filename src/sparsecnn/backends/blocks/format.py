"""Dense-block extraction of OptPrune (paper 000, Sec. 4.1, Algorithm 1).

The kernel matrix is the K x (C*R*S) view of a conv weight (columns (c, r, s) as in PyTorch's
layout). Algorithm 1, with tuning parameters t1, t2, B1, B2:

    repeat
        split the rows that still hold non-zeros into t1 groups by hypergraph partitioning
        (rows = vertices, columns = hyperedges);
        for each group with >= B1 rows: take the columns holding >= t2 of the group's
        non-zeros; if there are >= B2 of them, they form a dense block (zeros inside stored
        as zeros) and its non-zeros leave the matrix
    until an iteration finds no block
    what is left is the sparse remainder (CSR).

Details the paper leaves open. The vertices are all K rows ("divide the rows in S"): rows that
blocks emptied have no hyperedge and fill groups freely, so the groups of rows still holding
non-zeros may grow as the matrix empties (the paper's second iteration groups 3 of its 5 rows
this way). A group row with no non-zero in the selected columns would be an all-zero row of the
block (pure extra work), so it is left out, and the block must still have >= B1 rows after that.

Blocks found in one iteration (a "level") have disjoint rows; blocks of different levels may share
rows (row 3 of the paper's own example, Fig. 3-4, is in both blocks) but never a non-zero: a block
only takes the non-zeros still in the matrix, its other cells are zeros.

Partitioners. "mtkahypar" (connectivity objective, deterministic preset), as the paper uses
hMETIS; "jaccard", our fallback: rows grouped by the Jaccard similarity of their column sets (the
similarity the paper uses to explain the grouping), by recursive spectral bisection of the
similarity graph, then balanced label propagation that moves a row to the group it is most
similar to. Both keep groups within (1 + imbalance) * ceil(K / t1) rows, like hMETIS. "auto"
takes mtkahypar when importable, else jaccard. On DLMC ResNet-50 (magnitude 0.9, t2 in 4..12)
the fallback puts a similar or larger share of the non-zeros in blocks at the same fill, and runs
far faster than mtkahypar (tens of partitions per layer): with mtkahypar installed, "auto" is slow
on the large layers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from sparsecnn.core.csr import CSRWeight

PARTITIONERS = ("auto", "mtkahypar", "jaccard")
_LANCZOS_STEPS = 40  # Krylov dimension for a Fiedler vector: ample for ordering <= a few thousand rows
_REFINE_ROUNDS = 20
_ROUND_DIGITS = 9  # rounding before comparisons, so BLAS summation order cannot flip a decision


@dataclasses.dataclass(frozen=True)
class BlockParams:
    """Tuning parameters of Algorithm 1 (paper's defaults: t1 = 8, B1 = B2 = 8, t2 in {4, 8, 12, 16}).

    t1: groups per partition; t2: non-zeros a column needs within a group to join its block;
    b1 / b2: fewest rows / columns of a block; partitioner: one of PARTITIONERS ("auto": mtkahypar
    if importable, else jaccard); imbalance: allowed group-size excess over n / t1 (0.03 = 3%).
    """

    t1: int = 8
    t2: int = 8
    b1: int = 8
    b2: int = 8
    partitioner: str = "auto"
    imbalance: float = 0.03

    def __post_init__(self):
        for name in ("t1", "t2", "b1", "b2"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockParams.{name} must be an int >= 1, got {value!r}")
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"BlockParams.partitioner must be one of {PARTITIONERS}, got {self.partitioner!r}")
        if not isinstance(self.imbalance, (int, float)) or not 0 <= self.imbalance < 1:
            raise ValueError(f"BlockParams.imbalance must be a number in [0, 1), got {self.imbalance!r}")


@dataclasses.dataclass(frozen=True)
class DenseBlock:
    """One dense block: rows x cols of the kernel matrix, stored densely.

    rows: int64 (m,) output channels, increasing; cols: int64 (k,) kernel-matrix columns
    c*R*S + r*S + s, increasing; values: (m, k) in the weight's dtype, zero where the block holds
    no non-zero of its own; level: the iteration of Algorithm 1 that found it.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    level: int

    @property
    def nnz(self) -> int:
        return int(torch.count_nonzero(self.values))

    @property
    def cells(self) -> int:
        return self.values.numel()


@dataclasses.dataclass(frozen=True)
class BlockReport:
    """What the extraction achieved on one layer.

    share_in_blocks: fraction of the non-zeros inside blocks; fill: non-zeros / cells of the
    blocks (their density); extra_flops: zeros multiplied inside blocks per non-zero of the layer
    (0.5: the block GEMMs add half the layer's sparse FLOPs); seconds: wall time of the extraction.
    """

    num_blocks: int
    num_levels: int
    nnz: int
    nnz_in_blocks: int
    block_cells: int
    share_in_blocks: float
    fill: float
    extra_flops: float
    seconds: float
    partitioner: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BlockDecomposition:
    """A weight split by Algorithm 1: dense blocks plus a CSR remainder; they add up to the weight.

    kernel_shape: the weight's (K, C, R, S); remainder: `CSRWeight` of the K x C*R*S matrix.
    """

    blocks: Tuple[DenseBlock, ...]
    remainder: CSRWeight
    kernel_shape: Tuple[int, int, int, int]
    params: BlockParams
    report: BlockReport

    def to_dense(self) -> torch.Tensor:
        """The weight (K, C, R, S) rebuilt from blocks and remainder."""
        matrix = self.remainder.to_dense().clone()
        for block in self.blocks:
            matrix[block.rows[:, None], block.cols[None, :]] += block.values
        return matrix.reshape(self.kernel_shape)


def extract_blocks(weight: torch.Tensor, params: Optional[BlockParams] = None) -> BlockDecomposition:
    """Run Algorithm 1 on a dense (K, C, R, S) weight (or a K x N matrix) whose zeros are pruned.

    Works on the CPU (the weight is copied there); blocks and remainder keep the weight's dtype.
    """
    params = BlockParams() if params is None else params
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating tensor with >= 2 dims, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    start = time.perf_counter()
    mask = (weight.detach().reshape(weight.shape[0], -1).cpu() != 0).numpy()
    with _one_thread():
        partition, name = _partitioner(mask, params)
        found = _algorithm1(mask.copy(), params, partition)
    return decompose(weight, found, params, name, start)


def decompose(weight: torch.Tensor, found: Sequence[Block], params: BlockParams, partitioner: str,
              start: float) -> BlockDecomposition:
    """`weight` (K, C, R, S, or K x N) split into the blocks Algorithm 1 `found` for its non-zero
    pattern ((level, rows, cols, taken) each: see `_algorithm1`), each block holding the weight's
    values at its taken cells; `start`: the `time.perf_counter()` the report's seconds count from."""
    matrix = weight.detach().reshape(weight.shape[0], -1).cpu()
    blocks = []
    remainder = matrix.clone()
    for level, rows, cols, taken in found:
        rows_t, cols_t = torch.from_numpy(rows), torch.from_numpy(cols)
        values = matrix[rows_t[:, None], cols_t[None, :]] * torch.from_numpy(taken)
        remainder[rows_t[:, None], cols_t[None, :]] -= values
        blocks.append(DenseBlock(rows_t, cols_t, values, level))
    seconds = time.perf_counter() - start
    kernel_shape = tuple(weight.shape) if weight.dim() == 4 else (weight.shape[0], matrix.shape[1], 1, 1)
    return BlockDecomposition(tuple(blocks), CSRWeight.from_dense(remainder), kernel_shape, params,
                              _report(blocks, int((matrix != 0).sum()), seconds, partitioner))


def found_blocks(decomposition: BlockDecomposition) -> List[Block]:
    """What Algorithm 1 found, as `decompose` takes it, back from a decomposition it made: a block's
    taken cells are its non-zero values (it takes non-zeros only)."""
    return [(block.level, block.rows.numpy(), block.cols.numpy(), (block.values != 0).numpy())
            for block in decomposition.blocks]


def given_decomposition(weight: torch.Tensor, blocks: Sequence[Tuple[Sequence[int], Sequence[int]]],
                        params: Optional[BlockParams] = None) -> BlockDecomposition:
    """`weight` (K, C, R, S) split into the dense blocks a re-pruning chose instead of Algorithm 1's:
    blocks[i] = (rows: output channels, cols: flat kernel-matrix columns c*R*S + r*S + s), each
    block's cells taken from the weight (zeros included), the non-zeros outside every block as the
    CSR remainder. Blocks must not share a cell. params: recorded as the decomposition's (its t2
    names the config it is packed for); the report's partitioner is "given". ValueError for indices
    out of range, repeated within a block or shared between blocks."""
    params = BlockParams() if params is None else params
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating (K, C, R, S) tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    start = time.perf_counter()
    matrix = weight.detach().reshape(weight.shape[0], -1).cpu()
    covered = torch.zeros(matrix.shape, dtype=torch.bool)
    dense_blocks = []
    for index, (rows, cols) in enumerate(blocks):
        rows_t, cols_t = _block_indices(rows, matrix.shape[0], index, "rows"), _block_indices(cols, matrix.shape[1],
                                                                                              index, "cols")
        cells = covered[rows_t[:, None], cols_t[None, :]]
        if cells.any():
            raise ValueError(f"blocks[{index}] shares cells with an earlier block")
        covered[rows_t[:, None], cols_t[None, :]] = True
        dense_blocks.append(DenseBlock(rows_t, cols_t, matrix[rows_t[:, None], cols_t[None, :]].clone(), 0))
    remainder = torch.where(covered, torch.zeros((), dtype=matrix.dtype), matrix)
    return BlockDecomposition(tuple(dense_blocks), CSRWeight.from_dense(remainder), tuple(weight.shape), params,
                              _report(dense_blocks, int((matrix != 0).sum()), time.perf_counter() - start, "given"))


def _block_indices(values: Sequence[int], size: int, index: int, name: str) -> torch.Tensor:
    """blocks[index]'s `name` as a sorted int64 tensor; ValueError unless distinct ints in [0, size)."""
    indices = torch.as_tensor(list(values), dtype=torch.int64)
    if indices.numel() == 0 or indices.min() < 0 or indices.max() >= size or indices.unique().numel() != indices.numel():
        raise ValueError(f"blocks[{index}] {name} must be distinct ints in [0, {size}), got {list(values)[:8]}...")
    return indices.sort().values


@contextlib.contextmanager
def _one_thread():
    """torch on one thread: the partitioner makes thousands of small matrix products, for which
    waking threads costs more than the work (two threads made extraction several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _report(blocks: List[DenseBlock], nnz: int, seconds: float, partitioner: str) -> BlockReport:
    in_blocks = sum(block.nnz for block in blocks)
    cells = sum(block.cells for block in blocks)
    return BlockReport(
        num_blocks=len(blocks), num_levels=1 + max((b.level for b in blocks), default=-1), nnz=nnz,
        nnz_in_blocks=in_blocks, block_cells=cells, share_in_blocks=in_blocks / nnz if nnz else 0.0,
        fill=in_blocks / cells if cells else 0.0, extra_flops=(cells - in_blocks) / nnz if nnz else 0.0,
        seconds=seconds, partitioner=partitioner)


# --- Algorithm 1 ------------------------------------------------------------------------------

Block = Tuple[int, np.ndarray, np.ndarray, np.ndarray]  # (level, rows, cols, taken (m, k) bool)


def _algorithm1(mask: np.ndarray, params: BlockParams, partition: "_Partitioner") -> List[Block]:
    """Algorithm 1 on a boolean K x N mask, which it empties of the non-zeros put in blocks.

    Returns (level, rows int64 (m,), cols int64 (k,), taken bool (m, k)) per block, where `taken`
    marks the non-zeros the block took (the rest of its cells are zeros).
    """
    blocks: List[Block] = []
    groups = min(params.t1, mask.shape[0])
    level = 0
    while True:
        active = np.flatnonzero(mask.any(axis=1))
        if active.size < params.b1:  # no group can reach B1 rows
            break
        labels = partition(mask, active, groups) if groups > 1 else np.zeros(active.size, dtype=np.int64)
        found = 0
        for group in range(groups):
            block = _block_of_group(mask, active[labels == group], params)
            if block is None:
                continue
            rows, cols, taken = block
            blocks.append((level, rows, cols, taken))
            mask[np.ix_(rows, cols)] = False
            partition.removed(rows, taken)
            found += 1
        if not found:
            break
        level += 1
    return blocks


def _block_of_group(mask: np.ndarray, rows: np.ndarray, params: BlockParams):
    """(rows, cols, taken) of the dense block of one group, or None when it has none."""
    if rows.size < params.b1:
        return None
    cols = np.flatnonzero(mask[rows].sum(axis=0) >= params.t2)
    if cols.size < params.b2:
        return None
    taken = mask[np.ix_(rows, cols)]
    keep = taken.any(axis=1)  # rows with nothing in these columns would be all-zero block rows
    if keep.sum() < params.b1:
        return None
    return rows[keep], cols, taken[keep]


# --- partitioners -----------------------------------------------------------------------------

class _Partitioner:
    """partition(mask, active, groups) -> a group label per active row; told of removed cells.

    The vertices are all K rows, as in the paper ("divide the rows in S"): rows already emptied
    have no hyperedge and fill groups freely, so the groups of rows still holding non-zeros may
    grow up to the size bound (1 + imbalance) * ceil(K / groups) as the matrix empties.
    """

    def __call__(self, mask: np.ndarray, active: np.ndarray, groups: int) -> np.ndarray:
        raise NotImplementedError

    def removed(self, rows: np.ndarray, taken: np.ndarray) -> None:
        """The non-zeros `taken` (bool (len(rows), k)) of `rows` left the matrix."""


def resolved_partitioner(params: BlockParams) -> str:
    """The partitioner `extract_blocks` runs for `params` here: "auto" resolved."""
    if params.partitioner == "auto":
        return "mtkahypar" if _mtkahypar() is not None else "jaccard"
    return params.partitioner


def _partitioner(mask: np.ndarray, params: BlockParams) -> Tuple[_Partitioner, str]:
    name = resolved_partitioner(params)
    if name == "mtkahypar":
        if _mtkahypar() is None:
            raise ValueError("partitioner='mtkahypar' needs the mtkahypar package (pip install mtkahypar)")
        return _MtKaHyPar(params.imbalance), name
    return _Jaccard(mask, params.imbalance), name


_MTKAHYPAR_STATE: dict = {}


def _mtkahypar():
    """(module, initializer) of mtkahypar, initialised once with one thread; None if not installed."""
    if "module" not in _MTKAHYPAR_STATE:
        try:
            import mtkahypar
        except ImportError:
            _MTKAHYPAR_STATE["module"] = None
        else:
            # initialize() sets process-wide state and may be called only once per process.
            _MTKAHYPAR_STATE["module"] = (mtkahypar, mtkahypar.initialize(1, False))
    return _MTKAHYPAR_STATE["module"]


class _MtKaHyPar(_Partitioner):
    """Hypergraph partitioning (connectivity - 1 objective), rows = vertices, columns = hyperedges."""

    def __init__(self, imbalance: float):
        self.imbalance = imbalance

    def __call__(self, mask, active, groups):
        module, initializer = _mtkahypar()
        sub = mask[active]
        # Columns with one pin cannot be cut: leaving them out only saves time.
        pins = sub[:, sub.sum(axis=0) >= 2].T
        if not pins.shape[0]:
            return _chunks(active.size, groups)
        module.set_seed(0)
        context = initializer.context_from_preset(module.PresetType.DETERMINISTIC)
        context.set_partitioning_parameters(groups, self.imbalance, module.Objective.KM1)
        context.logging = False
        edges = [active[np.flatnonzero(column)].tolist() for column in pins]
        hypergraph = initializer.create_hypergraph(context, mask.shape[0], len(edges), edges)
        labels = np.asarray(hypergraph.partition(context).get_partition(), dtype=np.int64)
        return labels[active]


class _Jaccard(_Partitioner):
    """Groups rows by the Jaccard similarity |a & b| / |a | b| of their column sets.

    Keeps the pairwise intersection counts of all K rows, updated as blocks take non-zeros (a
    block only changes the counts among its own rows), so each iteration costs O(n^2) rather than
    the O(n^2 N) of recounting. Counts are exact in float32 (they stay below 2^24). The matrix
    work runs in torch, whose thread count `extract_blocks` can pin to one (numpy's BLAS cannot be).
    """

    def __init__(self, mask: np.ndarray, imbalance: float):
        ones = torch.from_numpy(mask).float()
        self.intersections = ones @ ones.T
        self.sizes = torch.from_numpy(mask.sum(axis=1)).double()
        self.imbalance = imbalance

    def removed(self, rows, taken):
        index = torch.from_numpy(rows)
        ones = torch.from_numpy(taken).float()
        self.intersections[index[:, None], index[None, :]] -= ones @ ones.T
        self.sizes[index] -= ones.sum(dim=1).double()

    def __call__(self, mask, active, groups):
        similarity = self._jaccard(torch.from_numpy(active))
        labels = _spectral_bisection(similarity, groups)
        capacity = math.ceil((1 + self.imbalance) * math.ceil(mask.shape[0] / groups))
        return _refine(similarity, labels, groups, capacity)

    def _jaccard(self, active: torch.Tensor) -> torch.Tensor:
        """(n, n) float64 similarity of the active rows, zero diagonal."""
        shared = self.intersections[active[:, None], active[None, :]].double()
        sizes = self.sizes[active]
        union = sizes[:, None] + sizes[None, :] - shared
        similarity = torch.where(union > 0, shared / union.clamp(min=1), 0.0)
        return similarity.fill_diagonal_(0.0)


def _chunks(n: int, groups: int) -> np.ndarray:
    """Rows 0..n-1 cut into `groups` consecutive, near-equal groups."""
    return (np.arange(n) * groups) // n


def _spectral_bisection(similarity: torch.Tensor, groups: int) -> np.ndarray:
    """Balanced labels by recursive bisection along the Fiedler vector of the similarity graph.

    Each split orders its rows by the Fiedler vector (similar rows end up adjacent) and cuts
    them in proportion to the groups each side receives.
    """
    labels = np.zeros(similarity.shape[0], dtype=np.int64)
    stack = [(np.arange(similarity.shape[0]), groups, 0)]
    while stack:
        rows, parts, first = stack.pop()
        if parts == 1 or rows.size <= 1:
            labels[rows] = first
            continue
        index = torch.from_numpy(rows)
        order = rows[np.argsort(_fiedler(similarity[index[:, None], index[None, :]]), kind="stable")]
        left = parts // 2
        cut = rows.size * left // parts
        stack.append((order[:cut], left, first))
        stack.append((order[cut:], parts - left, first + left))
    return labels


def _fiedler(similarity: torch.Tensor) -> np.ndarray:
    """Second eigenvector of the normalised similarity D^-1/2 S D^-1/2, scaled by D^-1/2.

    Lanczos with full reorthogonalisation (a fixed start vector, so deterministic) against the
    known top eigenvector D^1/2 1; the result is rounded so that different BLAS summation orders
    give the same ordering. Isolated rows (degree 0) get a value near 0.
    """
    n = similarity.shape[0]
    degree = similarity.sum(dim=1).clamp(min=1e-12)
    inv_sqrt = degree.rsqrt()
    normalised = inv_sqrt[:, None] * similarity * inv_sqrt[None, :]
    steps = min(_LANCZOS_STEPS, n - 1)
    # Row 0: the known top eigenvector, deflated like the Krylov vectors in rows 1..size.
    basis = torch.zeros(steps + 1, n, dtype=torch.float64)
    basis[0] = degree.sqrt() / degree.sqrt().norm()
    images = torch.zeros(steps, n, dtype=torch.float64)
    vector = torch.cos(0.7 * torch.arange(n, dtype=torch.float64) + 0.3)
    size = 0
    for _ in range(steps):
        known = basis[:size + 1]
        for _ in range(2):  # twice: Gram-Schmidt once loses orthogonality in floating point
            vector = vector.addmv(known.T, known @ vector, alpha=-1)
        norm = vector.norm()
        if norm < 1e-10:  # the Krylov space is exhausted
            break
        basis[size + 1] = vector / norm
        torch.mv(normalised, basis[size + 1], out=images[size])
        vector = images[size]
        size += 1
    if size == 0:
        return np.zeros(n)
    krylov = basis[1:size + 1]
    projected = krylov @ images[:size].T
    _, ritz = torch.linalg.eigh((projected + projected.T) / 2)
    fiedler = (inv_sqrt * (ritz[:, -1] @ krylov)).numpy()
    fiedler *= np.sign(fiedler[np.argmax(np.abs(fiedler))]) / max(np.abs(fiedler).max(), 1e-300)
    return np.round(fiedler, _ROUND_DIGITS)


def _refine(similarity: torch.Tensor, labels: np.ndarray, groups: int, capacity: int) -> np.ndarray:
    """Balanced label propagation: move rows to the group they are most similar to.

    A row's gain for group g is its summed similarity to g's rows minus that to its own group's
    other rows. Each round updates the even rows, then the odd rows (rows of one half move
    together; their gains assume the others stay, so halving limits simultaneous-move damage).
    Moves go in decreasing gain while the target has room (`capacity` rows per group).
    """
    labels = labels.copy()
    sizes = np.bincount(labels, minlength=groups)
    halves = [np.arange(start, labels.size, 2) for start in (0, 1)]
    rows_of = [similarity[torch.from_numpy(half)] for half in halves]  # (n/2, n) each, reused
    eye = torch.eye(groups, dtype=torch.float64)
    for _ in range(_REFINE_ROUNDS):
        moved = 0
        for half, rows in zip(halves, rows_of):
            affinity = (rows @ eye[torch.from_numpy(labels)]).numpy()
            moved += _move_half(half, affinity, labels, sizes, capacity)
        if not moved:
            break
    return labels


def _move_half(half: np.ndarray, affinity: np.ndarray, labels: np.ndarray, sizes: np.ndarray,
               capacity: int) -> int:
    """Apply the improving moves of rows `half` (affinity (len(half), groups)); returns how many."""
    groups = affinity.shape[1]
    index = np.arange(half.size)
    own = labels[half]
    gain = np.round(affinity - affinity[index, own][:, None], _ROUND_DIGITS)
    gain[index, own] = -np.inf
    target = gain.argmax(axis=1)
    best = gain[index, target]
    candidates = np.flatnonzero(best > 0)
    if not candidates.size:
        return 0
    # Per target group, the best gains first, as many as it has room for.
    order = candidates[np.lexsort((-best[candidates], target[candidates]))]
    first_of_target = np.searchsorted(target[order], np.arange(groups))
    rank = np.arange(order.size) - first_of_target[target[order]]
    moves = order[rank < (capacity - sizes)[target[order]]]
    rows = half[moves]
    np.add.at(sizes, labels[rows], -1)
    np.add.at(sizes, target[moves], 1)
    labels[rows] = target[moves]
    return moves.size
