"""Algorithm 1 for backend `blocks`, cached by weight content and t2, and run ahead of tuning.

Extraction takes ~0.3 s per layer and t2 on one core (58 s of 198 s when tuning a ResNet-50 on
the GPU machine), so backend `blocks`' `prefetch` hands it to worker processes ahead of tuning
(`submit_extractions`): "spawn" processes, never fork, as the parent may have initialised CUDA;
at most $SPARSECNN_BLOCKS_WORKERS of them (default min(CPU count, 16); 0: none), started as jobs
arrive and niced, so that the tuning process keeps a core. Like a DataLoader's workers, they
import the main script again: a script that tunes needs `if __name__ == "__main__":`.
`extraction` takes a submitted result when there is one (kept until taken or
`clear_extractions`), else extracts in-process (kept in a small LRU: a layer's t2 values repeat
across its configs). A pool that fails to start or a worker that fails only means extracting
in-process. Results are the same either way: Algorithm 1 is deterministic.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import multiprocessing
import os
import pickle
import threading
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from ..formats.blocks import BlockDecomposition, BlockParams, extract_blocks

_CACHE_SIZE = 8  # in-process extractions: a layer's distinct t2 values (4) for two layers at a time
WORKERS_ENV_VAR = "SPARSECNN_BLOCKS_WORKERS"
_MAX_WORKERS = 16
_WORKER_NICENESS = 10
_LOG = logging.getLogger("sparsecnn.backends.blocks")

# (content digest, shape, dtype, t2) of an extraction
Key = Tuple[str, Tuple[int, ...], str, int]


def worker_count() -> int:
    """Worker processes for extractions: $SPARSECNN_BLOCKS_WORKERS, else min(CPU count, 16)."""
    value = os.environ.get(WORKERS_ENV_VAR, "").strip()
    if not value:
        return min(os.cpu_count() or 1, _MAX_WORKERS)
    if not value.isdigit():
        raise ValueError(f"${WORKERS_ENV_VAR} must be a non-negative int, got {value!r}")
    return int(value)


def _extract_in_worker(data: torch.Tensor, t2: int) -> bytes:
    """Algorithm 1 in a worker process, returned as a plain pickle: torch's own pickling for
    processes would hold a shared-memory file descriptor per tensor of every block."""
    return pickle.dumps(extract_blocks(data, BlockParams(t2=t2)))


def _spawn_pool(workers: int) -> ProcessPoolExecutor:
    # Processes start one per job while none is idle: min(workers, jobs in flight) of them.
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=os.nice, initargs=(_WORKER_NICENESS,))


class _Workers:
    """A lazily started process pool and the extractions submitted to it, by key, until taken."""

    def __init__(self, new_pool: Callable[[int], ProcessPoolExecutor] = _spawn_pool):
        self.new_pool = new_pool
        self.pool: Optional[ProcessPoolExecutor] = None
        self.failed = False
        self.pending: Dict[Key, Future] = {}

    def submit(self, key: Key, data: torch.Tensor) -> None:
        if self.failed or key in self.pending:
            return
        try:
            if self.pool is None:
                workers = worker_count()
                if workers == 0:
                    return
                self.pool = self.new_pool(workers)
            self.pending[key] = self.pool.submit(_extract_in_worker, data, key[3])
        except Exception as error:  # noqa: BLE001  (no pool is no reason to fail tuning)
            self._give_up(error)

    def take(self, key: Key) -> Optional[BlockDecomposition]:
        """The submitted extraction for `key` (waiting for it), or None when there is none or it failed."""
        future = self.pending.pop(key, None)
        if future is None:
            return None
        try:
            return pickle.loads(future.result())
        except BrokenProcessPool as error:
            self._give_up(error)
        except Exception as error:  # noqa: BLE001  (in-process extraction raises it again, if it is the input's fault)
            _LOG.warning("block extraction in a worker process failed (%s: %s); extracting in-process",
                         type(error).__name__, error)
        return None

    def forget(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()

    def _give_up(self, error: Exception) -> None:
        _LOG.warning("block extraction worker processes unavailable (%s: %s); extracting in-process",
                     type(error).__name__, error)
        self.shutdown()
        self.failed = True

    def shutdown(self) -> None:
        self.forget()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


_WORKERS = _Workers()
_EXTRACTIONS: "OrderedDict[Key, BlockDecomposition]" = OrderedDict()


def shutdown_extraction_workers() -> None:
    """Stop the worker processes and forget the extractions they owe (also done at exit); the next
    submission starts new ones, even after a failure."""
    global _WORKERS
    _WORKERS.shutdown()
    _WORKERS = _Workers()


# concurrent.futures waits at exit for every job submitted, from threading's exit hooks, which run
# before atexit's: so unstarted extractions are cancelled there (hooks run last registered first).
getattr(threading, "_register_atexit", atexit.register)(shutdown_extraction_workers)


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
            _WORKERS.submit((*content, t2), sent)


def extraction(weight: torch.Tensor, t2: int) -> BlockDecomposition:
    """Algorithm 1 on `weight` with the paper's t1 = B1 = B2 = 8 and this t2, cached by content."""
    data, content = _content(weight)
    key = (*content, t2)
    if key in _EXTRACTIONS:
        _EXTRACTIONS.move_to_end(key)
        return _EXTRACTIONS[key]
    decomposition = _WORKERS.take(key)
    if decomposition is None:
        decomposition = extract_blocks(data, BlockParams(t2=t2))
    _EXTRACTIONS[key] = decomposition
    if len(_EXTRACTIONS) > _CACHE_SIZE:
        _EXTRACTIONS.popitem(last=False)
    return decomposition
