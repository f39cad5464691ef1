"""Algorithm 1 for backend `blocks`, cached by weight content and t2, and run ahead of tuning.

Extraction is slow on one core (per layer and t2: a large share of tuning a ResNet-50), so
backend `blocks`' `prefetch` hands it to worker processes ahead of tuning (`submit_extractions`;
`workers.WorkerPool`, at most $SPARSECNN_BLOCKS_WORKERS of them).
`extraction` takes a submitted result when there is one (kept until taken or
`clear_extractions`), else extracts in-process (kept in a small LRU: a layer's t2 values repeat
across its configs). Results are the same either way: Algorithm 1 is deterministic.

What Algorithm 1 found is also kept on disk, under $SPARSECNN_CACHE/blocks, by the weight's
non-zero pattern (never its values), t2, the partitioner and a digest of the algorithm's source
(`format.py`): a reload of a tuned model, or the same pruned layer tuned again, takes the blocks
from there and extracts nothing (nor submits anything).

Blocks a re-pruning chose (`prune.tiles`, `prune.reprune`) are used as they are: `provide_blocks`
records them with the layer's mask, and `extraction` of a weight whose non-zeros all lie inside
that mask (the re-trained weight, BatchNorm-folded or cast to another dtype; of several such
masks the smallest) returns them (`format.given_decomposition`, the same blocks for every t2)
instead of running Algorithm 1.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import sparsecnn.settings as settings
from sparsecnn.backends.blocks import format as block_format
from sparsecnn.backends.blocks.format import (
    BlockDecomposition,
    BlockParams,
    decompose,
    extract_blocks,
    found_blocks,
    given_decomposition,
    resolved_partitioner,
)
from sparsecnn.core.workers import NOTHING, WorkerPool

_CACHE_SIZE = 8  # in-process extractions: a layer's distinct t2 values (4) for two layers at a time
_LOG = logging.getLogger("sparsecnn.backends.blocks.backend")

# (content digest, shape, dtype, t2) of an extraction
Key = Tuple[str, Tuple[int, ...], str, int]


def _extract_in_worker(data: torch.Tensor, t2: int) -> bytes:
    """Algorithm 1 in a worker process, returned as a plain pickle: torch's own pickling for
    processes would hold a shared-memory file descriptor per tensor of every block."""
    return pickle.dumps(extract_blocks(data, BlockParams(t2=t2)))


def _new_workers(**kwargs) -> WorkerPool:
    return WorkerPool("block extraction", settings.blocks_workers, _LOG, **kwargs)


_WORKERS = _new_workers()
_EXTRACTIONS: "OrderedDict[Key, BlockDecomposition]" = OrderedDict()
Blocks = Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]  # ((rows, cols), ...) of each dense block
_PROVIDED: Dict[Tuple[int, ...], List[Tuple[torch.Tensor, Blocks]]] = {}  # shape -> [(bool mask, blocks)]


def _provided_for(weight: torch.Tensor) -> Optional[Blocks]:
    """The provided blocks whose mask holds every non-zero of `weight` (the smallest such mask),
    or None (also for an all-zero weight)."""
    nonzero = weight.detach().cpu() != 0
    if not nonzero.any():
        return None
    covering = [(int(mask.sum()), blocks) for mask, blocks in _PROVIDED.get(tuple(weight.shape), [])
                if not (nonzero & ~mask).any()]
    return min(covering, key=lambda entry: entry[0])[1] if covering else None


def provide_blocks(mask: torch.Tensor, blocks: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> None:
    """Use `blocks` ((rows: output channels, cols: flat (c, r, s) columns) of each dense block) for
    the weights whose non-zeros lie inside `mask` (bool (K, C, R, S)); replaces what an equal mask
    had; checked now (ValueError as `format.given_decomposition`)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"mask must be a bool (K, C, R, S) tensor, got {getattr(mask, 'dtype', type(mask))} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    frozen = tuple((tuple(int(r) for r in rows), tuple(int(c) for c in cols)) for rows, cols in blocks)
    given_decomposition(mask.float(), frozen)
    mask = mask.detach().cpu().clone()
    entries = [entry for entry in _PROVIDED.get(tuple(mask.shape), []) if not torch.equal(entry[0], mask)]
    _PROVIDED[tuple(mask.shape)] = entries + [(mask, frozen)]
    _EXTRACTIONS.clear()  # an extraction of a weight inside this mask may be cached


def has_provided_blocks(weight: torch.Tensor) -> bool:
    """Whether a re-pruning gave blocks (`provide_blocks`) for a mask holding every non-zero of
    `weight` (K, C, R, S)."""
    return _provided_for(weight) is not None


def provided_blocks(mask: torch.Tensor) -> Optional[Blocks]:
    """The blocks `provide_blocks` recorded with exactly this mask, or None."""
    mask = mask.detach().cpu()
    return next((blocks for recorded, blocks in _PROVIDED.get(tuple(mask.shape), []) if torch.equal(recorded, mask)),
                None)


def clear_provided_blocks() -> None:
    """Forget every `provide_blocks` (Algorithm 1 again for those layers)."""
    _PROVIDED.clear()
    _EXTRACTIONS.clear()


def shutdown_extraction_workers() -> None:
    """Stop the worker processes and forget the extractions they owe (`workers` does it at exit);
    the next submission starts new ones, even after a failure."""
    global _WORKERS
    _WORKERS.shutdown()
    _WORKERS = _new_workers()


def clear_extractions() -> None:
    """Forget every extraction, submitted or done in-process (the worker processes keep running)."""
    _WORKERS.forget()
    _EXTRACTIONS.clear()


def _content(weight: torch.Tensor) -> Tuple[torch.Tensor, Tuple[str, Tuple[int, ...], str]]:
    """(the weight on the CPU, contiguous; (digest of its bytes, shape, dtype))."""
    data = weight.detach().cpu().contiguous()
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    return data, (digest, tuple(data.shape), str(data.dtype))


def disk_cache_dir() -> Path:
    """Where found blocks are kept: $SPARSECNN_CACHE/blocks."""
    return settings.codegen_cache_dir() / "blocks"


@functools.lru_cache(maxsize=1)
def _algorithm_digest() -> str:
    return hashlib.blake2b(Path(block_format.__file__).read_bytes(), digest_size=8).hexdigest()


def _disk_path(data: torch.Tensor, t2: int) -> Path:
    """The file of `data`'s (a CPU weight) non-zero pattern's blocks at t2 with this partitioner."""
    params = BlockParams(t2=t2)
    digest = hashlib.blake2b(np.packbits((data != 0).numpy().ravel()).tobytes(), digest_size=16)
    digest.update(repr((tuple(data.shape), t2, resolved_partitioner(params), _algorithm_digest())).encode())
    return disk_cache_dir() / f"{digest.hexdigest()}.npz"


def _from_disk(data: torch.Tensor, t2: int) -> Optional[BlockDecomposition]:
    """The decomposition of `data` from the blocks kept on disk, or None (none, or unreadable: then
    extracted again and rewritten)."""
    path = _disk_path(data, t2)
    if not path.exists():
        return None
    start = time.perf_counter()
    try:
        with np.load(path) as saved:
            levels = saved["levels"]
            found = [(int(level), saved[f"rows{i}"], saved[f"cols{i}"], saved[f"taken{i}"])
                     for i, level in enumerate(levels)]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        _LOG.warning("ignoring unreadable blocks cache file %s (%s: %s)", path, type(error).__name__, error)
        return None
    return decompose(data, found, BlockParams(t2=t2), resolved_partitioner(BlockParams(t2=t2)), start)


def _to_disk(data: torch.Tensor, t2: int, decomposition: BlockDecomposition) -> None:
    """Keep what Algorithm 1 found for `data` at t2 (atomically: a reader sees a whole file or none);
    a cache that cannot be written only costs the next extraction."""
    path = _disk_path(data, t2)
    found = found_blocks(decomposition)
    arrays = {"levels": np.array([level for level, *_ in found], dtype=np.int64)}
    for i, (_, rows, cols, taken) in enumerate(found):
        arrays.update({f"rows{i}": rows, f"cols{i}": cols, f"taken{i}": taken})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npz", dir=path.parent)
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
        os.replace(temporary, path)
    except OSError as error:
        _LOG.warning("could not keep blocks in %s (%s)", path.parent, error)


def submit_extractions(weight: torch.Tensor, t2_values: Iterable[int]) -> None:
    """Start Algorithm 1 on `weight` (K, C, R, S) for each t2 in worker processes, unless its blocks
    are kept on disk; `_extraction` of the same weight content and t2 then waits for that result
    instead of extracting."""
    data, content = _content(weight)
    if _provided_for(data) is not None:
        return
    sent = None
    for t2 in dict.fromkeys(t2_values):
        if (*content, t2) not in _EXTRACTIONS and not _disk_path(data, t2).exists():
            sent = data.clone() if sent is None else sent  # sending moves a tensor's storage to shared memory
            _WORKERS.submit((*content, t2), _extract_in_worker, sent, t2)


def extraction(weight: torch.Tensor, t2: int) -> BlockDecomposition:
    """The provided blocks of `weight`'s non-zero pattern (`provide_blocks`), else Algorithm 1 with
    the paper's t1 = B1 = B2 = 8 and this t2 (kept on disk by pattern); cached in-process by content."""
    data, content = _content(weight)
    key = (*content, t2)
    if key in _EXTRACTIONS:
        _EXTRACTIONS.move_to_end(key)
        return _EXTRACTIONS[key]
    provided = _provided_for(data)
    if provided is not None:
        decomposition = given_decomposition(data, provided, BlockParams(t2=t2))
    else:
        decomposition = _from_disk(data, t2)
    if decomposition is None:
        pickled = _WORKERS.take(key)
        decomposition = extract_blocks(data, BlockParams(t2=t2)) if pickled is NOTHING else pickle.loads(pickled)
        _to_disk(data, t2, decomposition)
    _EXTRACTIONS[key] = decomposition
    if len(_EXTRACTIONS) > _CACHE_SIZE:
        _EXTRACTIONS.popitem(last=False)
    return decomposition
