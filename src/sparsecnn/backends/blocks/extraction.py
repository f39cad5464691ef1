"""Algorithm 1 for backend `blocks`, cached by weight content and t2, and run ahead of tuning.

Extraction is slow on one core (per layer and t2: a large share of tuning a ResNet-50), so
backend `blocks`' `prefetch` hands it to worker processes ahead of tuning (`submit_extractions`;
`workers.WorkerPool`, at most $SPARSECNN_BLOCKS_WORKERS of them).
`extraction` takes a submitted result when there is one (kept until taken or
`clear_extractions`), else extracts in-process (kept in a small LRU: a layer's t2 values repeat
across its configs). Results are the same either way: Algorithm 1 is deterministic.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
from collections import OrderedDict
from typing import Iterable, Tuple

import torch

import sparsecnn.settings as settings
from sparsecnn.backends.blocks.format import (
    BlockDecomposition,
    BlockParams,
    extract_blocks,
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


def submit_extractions(weight: torch.Tensor, t2_values: Iterable[int]) -> None:
    """Start Algorithm 1 on `weight` (K, C, R, S) for each t2 in worker processes; `_extraction`
    of the same weight content and t2 then waits for that result instead of extracting."""
    data, content = _content(weight)
    sent = data.clone()  # sending moves a tensor's storage to shared memory: never the caller's
    for t2 in dict.fromkeys(t2_values):
        if (*content, t2) not in _EXTRACTIONS:
            _WORKERS.submit((*content, t2), _extract_in_worker, sent, t2)


def extraction(weight: torch.Tensor, t2: int) -> BlockDecomposition:
    """Algorithm 1 on `weight` with the paper's t1 = B1 = B2 = 8 and this t2, cached by content."""
    data, content = _content(weight)
    key = (*content, t2)
    if key in _EXTRACTIONS:
        _EXTRACTIONS.move_to_end(key)
        return _EXTRACTIONS[key]
    pickled = _WORKERS.take(key)
    decomposition = extract_blocks(data, BlockParams(t2=t2)) if pickled is NOTHING else pickle.loads(pickled)
    _EXTRACTIONS[key] = decomposition
    if len(_EXTRACTIONS) > _CACHE_SIZE:
        _EXTRACTIONS.popitem(last=False)
    return decomposition
