"""Worker processes that prepare backends' work ahead of tuning (block extraction, kernel compiles).

"spawn" processes, never fork, as the parent may have initialised CUDA; at most `count()` of them
(a `settings` accessor such as `settings.blocks_workers`; default half the CPUs, at most 16; 0:
none), started as jobs arrive and niced, so that the tuning process keeps a core. Unlike a
DataLoader's workers they never run the caller's script (`_main_script_hidden`), so a script that
tunes needs no `if __name__ == "__main__":` guard. A pool that fails to start or a worker that fails
only means the caller does the work in-process: results never depend on where a job ran.
Several pools can share one process pool (`SharedProcessPool`): the kernel compiles of codegen,
staged and unrolled queue in one line, in the order tuning will need them.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from importlib.machinery import ModuleSpec
from typing import Any, Callable, Dict, Hashable, Iterator, Optional, Tuple

import sparsecnn.settings as settings

_WORKER_NICENESS = 10
NOTHING = object()  # what `WorkerPool.take` returns when there is no result to take
_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


@dataclasses.dataclass
class JobTimes:
    """Wall seconds of the jobs taken from one pool: how long they queued (submit to start in a
    worker), ran, and how long takers waited for them; max_ran_s: the longest job."""

    jobs: int = 0
    queued_s: float = 0.0
    ran_s: float = 0.0
    max_ran_s: float = 0.0
    waited_s: float = 0.0

    def add(self, queued: float, ran: float, waited: float) -> None:
        self.jobs += 1
        self.queued_s += queued
        self.ran_s += ran
        self.max_ran_s = max(self.max_ran_s, ran)
        self.waited_s += waited


def _timed(fn: Callable[..., Any], *args: Any) -> tuple:
    """(start, end, fn(*args)) with wall-clock times, so that the parent can tell queueing from running."""
    start = time.time()
    result = fn(*args)
    return start, time.time(), result


def job_times() -> Dict[str, JobTimes]:
    """{pool's `what`: the times of the jobs taken since `reset_job_times`} for every live pool."""
    return {pool.what: dataclasses.replace(pool.times) for pool in _POOLS if pool.times.jobs}


def reset_job_times() -> None:
    for pool in _POOLS:
        pool.times = JobTimes()


def _start_worker(niceness: int) -> None:
    """Each worker: niced, and one thread for torch's CPU ops. The workers are the parallelism:
    with torch's default (a thread per core in every worker), block-extraction and codegen workers
    oversubscribe the cores and their jobs run several times longer than with one thread each."""
    os.nice(niceness)
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """Within the block, processes started by "spawn" import nothing of the caller's script.

    A spawned process re-runs the parent's main script (as `__mp_main__`), or imports its module
    when run with `python -m`, before it can unpickle a job; a script without an
    `if __name__ == "__main__":` guard would run its whole body again in every worker. spawn skips
    that step for a main module named "__main__", so the block gives `__main__` that name. Jobs are
    library functions and their arguments: nothing of the script is needed in a worker.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = getattr(main, "__spec__", None)
    main.__spec__ = ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = saved


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    # Processes start one per job while none is idle: min(workers, jobs in flight) of them.
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(_WORKER_NICENESS,))


class _Lease:
    """A `SharedProcessPool`'s process pool as one `WorkerPool` holds it: shutting it down lets go."""

    def __init__(self, shared: "SharedProcessPool", executor: ProcessPoolExecutor):
        self.shared, self.executor, self.held = shared, executor, True

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.executor.submit(fn, *args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        if self.held:
            self.held = False
            self.shared.release(self.executor, wait)


class SharedProcessPool:
    """One process pool for several `WorkerPool`s, given as their `new_pool`: their jobs queue in one
    line in submission order, on `count()` workers in all (separate pools each got their own share of
    the CPUs: one pool's long jobs queued while another's workers had finished). Started when the
    first of them submits; shut down when every pool holding it has shut down (a failed one included:
    a broken process pool fails the others' next submission or take too)."""

    def __init__(self, count: Callable[[], int], new_executor: Callable[[int], ProcessPoolExecutor] = spawn_pool):
        self.count, self.new_executor = count, new_executor
        self.executor: Optional[ProcessPoolExecutor] = None
        self.holders = 0
        self._lock = threading.Lock()

    def __call__(self, workers: int) -> _Lease:
        """A lease of the shared process pool, started with `count()` workers if none runs (the
        asking pool's own `workers` count is not used)."""
        with self._lock:
            if self.executor is None:
                self.executor = self.new_executor(self.count())
            self.holders += 1
            return _Lease(self, self.executor)

    def release(self, executor: ProcessPoolExecutor, wait: bool) -> None:
        with self._lock:
            if executor is not self.executor:
                return
            self.holders -= 1
            if self.holders == 0:
                self.executor = None
                executor.shutdown(wait=wait, cancel_futures=True)


class WorkerPool:
    """A lazily started process pool and the jobs submitted to it, by key, until taken.

    what: the work, for log messages ("block extraction"); count() -> the worker count, asked when
    the pool starts (a `settings` accessor; 0: none); new_pool(workers) -> executor (a
    `SharedProcessPool` to share one; tests inject pools that fail).
    """

    def __init__(self, what: str, count: Callable[[], int], log: logging.Logger,
                 new_pool: Callable[[int], ProcessPoolExecutor] = spawn_pool):
        self.what, self.count, self.log, self.new_pool = what, count, log, new_pool
        self.pool: Optional[ProcessPoolExecutor] = None
        self.failed = False
        self.pending: Dict[Hashable, Tuple[Future, float]] = {}  # key -> (job, wall time submitted)
        self.times = JobTimes()
        _POOLS.add(self)

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Start fn(*args) in a worker (fn importable by module path) unless `key` is pending."""
        if self.failed or key in self.pending:
            return
        try:
            if self.pool is None:
                workers = self.count()
                if workers == 0:
                    return
                self.pool = self.new_pool(workers)
            submitted = time.time()
            with _main_script_hidden():  # submit starts the worker processes
                self.pending[key] = self.pool.submit(_timed, fn, *args), submitted
        except Exception as error:  # noqa: BLE001  (no pool is no reason to fail tuning)
            self._give_up(error)

    def running(self, key: Hashable) -> bool:
        """Whether the job for `key` is submitted and not finished: taking it now would wait."""
        entry = self.pending.get(key)
        return entry is not None and not entry[0].done()

    def take(self, key: Hashable) -> Any:
        """The result of the job for `key` (waiting for it), or NOTHING when there is none or it failed."""
        if key not in self.pending:
            return NOTHING
        future, submitted = self.pending.pop(key)
        try:
            asked = time.time()
            started, finished, result = future.result()
            self.times.add(max(0.0, started - submitted), finished - started, time.time() - asked)
            return result
        except BrokenProcessPool as error:
            self._give_up(error)
        except Exception as error:  # noqa: BLE001  (in-process work raises it again, if it is the input's fault)
            self.log.warning("%s in a worker process failed (%s: %s); doing it in-process", self.what,
                             type(error).__name__, error)
        return NOTHING

    def forget(self) -> None:
        for future, _ in self.pending.values():
            future.cancel()
        self.pending.clear()

    def _give_up(self, error: Exception) -> None:
        self.log.warning("%s worker processes unavailable (%s: %s); doing it in-process", self.what,
                         type(error).__name__, error)
        self.shutdown()
        self.failed = True

    def shutdown(self) -> None:
        self.forget()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


# The kernel compiles of codegen, staged and unrolled ($SPARSECNN_COMPILE_WORKERS workers in all).
COMPILE_POOL = SharedProcessPool(lambda: settings.compile_workers())


def _shut_down_all() -> None:
    for pool in list(_POOLS):
        pool.shutdown()


# concurrent.futures waits at exit for every submitted job, from threading's exit hooks (run before
# atexit's, last registered first): every pool's unstarted jobs are cancelled there.
getattr(threading, "_register_atexit", atexit.register)(_shut_down_all)
