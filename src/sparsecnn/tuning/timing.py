"""Timing one callable: medians after warm-up, L2 flushed between repeats, CUDA events on GPU."""
from __future__ import annotations

import functools
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H200: 60 MB)
# With `stop_above_ms`, the repeats after which `benchmark` looks at the median once.
CHECK_REPS = 10


def _quantiles(times_ms: List[float]) -> Dict[str, float]:
    ordered = sorted(times_ms)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median_ms": statistics.median(ordered), "p20_ms": at(0.2), "p80_ms": at(0.8)}


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_us(device_index: int) -> float:
    """Clock cycles that `torch.cuda._sleep` spins per microsecond on this GPU, measured once."""
    cycles = 1_000_000
    with torch.cuda.device(device_index):
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def _launch_cover(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """A function that keeps the GPU busy for twice the CPU time `fn()` takes to enqueue its work
    (plus 20 us). Called just before a start event, it makes the event bracket `fn`'s GPU work
    alone: the kernels are queued while the GPU still sleeps, so launch overhead is not timed."""
    enqueue_us = 0.0
    for _ in range(2):
        start = time.perf_counter()
        fn()
        enqueue_us = max(enqueue_us, (time.perf_counter() - start) * 1e6)
    index = device.index if device.index is not None else torch.cuda.current_device()
    cycles = int((2 * enqueue_us + 20) * _sleep_cycles_per_us(index))
    return lambda: torch.cuda._sleep(cycles)


def _checked_reps(time_reps: Callable[[int], List[float]], reps: int, stop_above_ms: Optional[float]) -> List[float]:
    """`time_reps(reps)`, or the first CHECK_REPS alone when their median is over `stop_above_ms`."""
    if stop_above_ms is None or reps <= CHECK_REPS:
        return time_reps(reps)
    first = time_reps(CHECK_REPS)
    return first if statistics.median(first) > stop_above_ms else first + time_reps(reps - CHECK_REPS)


def _time_cuda(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float, min_rep: int,
               max_rep: int, flush_l2: bool, hide_launch: bool, stop_above_ms: Optional[float]) -> List[float]:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
    fn()
    torch.cuda.synchronize()
    probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_start.record()
    for _ in range(3):
        fn()
    probe_end.record()
    torch.cuda.synchronize()
    per_call = max(probe_start.elapsed_time(probe_end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / per_call))):
        fn()
    cover = _launch_cover(fn, device) if hide_launch else None
    return _checked_reps(lambda reps: _event_times(fn, reps, flush, cover),
                         max(min_rep, min(max_rep, int(rep_ms / per_call))), stop_above_ms)


def _event_times(fn: Callable[[], object], reps: int, flush: Optional[torch.Tensor],
                 cover: Optional[Callable[[], None]]) -> List[float]:
    """Milliseconds of `reps` calls of `fn`, each bracketed by CUDA events, after an L2 flush (a
    write of `flush`) and a launch cover (see `_launch_cover`) when given."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        if cover is not None:
            cover()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _wall_times(fn: Callable[[], object], reps: int) -> List[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _time_cpu(fn: Callable[[], object], warmup_ms: float, rep_ms: float, min_rep: int,
              max_rep: int, stop_above_ms: Optional[float]) -> List[float]:
    fn()
    start = time.perf_counter()
    fn()
    per_call = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(min(10, int(warmup_ms / per_call))):
        fn()
    return _checked_reps(lambda reps: _wall_times(fn, reps), max(min_rep, min(max_rep, int(rep_ms / per_call))),
                         stop_above_ms)


def benchmark(fn: Callable[[], object], device: torch.device | str, warmup_ms: float = 25.0,
              rep_ms: float = 100.0, min_rep: int = 5, flush_l2: bool = True,
              max_rep: Optional[int] = None, hide_launch: bool = False,
              stop_above_ms: Optional[float] = None) -> Dict[str, float]:
    """Time `fn()` on `device`; returns {"median_ms", "p20_ms", "p80_ms"} in milliseconds.

    Repeats: as many as fit in `rep_ms`, at least `min_rep`, at most `max_rep` (None: no cap on
    CUDA, 200 on CPU). On CUDA each repeat is bracketed by CUDA events and preceded by a write of
    256 MB, so no repeat finds its data in L2. hide_launch (CUDA): the GPU is kept busy while `fn`
    is enqueued, so the time is its GPU work alone, as under CUDA graphs, without the CPU's launch
    overhead (which eager runs pay). On CPU, wall-clock time per call. stop_above_ms: after the first
    CHECK_REPS repeats, stop when their median is over it (a tuner that only needs to know `fn` is
    slower than its fastest candidate); the quantiles are then those repeats'.
    """
    device = torch.device(device)
    if device.type == "cuda":
        cap = sys.maxsize if max_rep is None else max_rep
        return _quantiles(_time_cuda(fn, device, warmup_ms, rep_ms, min_rep, cap, flush_l2, hide_launch,
                                     stop_above_ms))
    return _quantiles(_time_cpu(fn, warmup_ms, rep_ms, min_rep, 200 if max_rep is None else max_rep, stop_above_ms))


def _eager_group_ms(fn: Callable[[], object], device: torch.device, calls: int, repeats: int) -> List[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    groups = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        groups.append(1e3 * (time.perf_counter() - start) / calls)
    return groups


def eager_wall_ms(fn: Callable[[], object], device: torch.device | str, calls: int = 10, repeats: int = 1) -> float:
    """Wall milliseconds per call of `calls` back-to-back calls of `fn()` after one untimed call;
    the median of `repeats` such groups. On CUDA the device is synchronised around each group only,
    so a call costs max(the CPU's time to issue its work, the GPU's time to run it), as in an eager
    loop. No L2 flush: back-to-back calls are what such a loop makes."""
    return statistics.median(_eager_group_ms(fn, torch.device(device), calls, repeats))


def eager_benchmark(fn: Callable[[], object], device: torch.device | str, calls: int = 10,
                    repeats: int = 10) -> Dict[str, float]:
    """{"median_ms", "p20_ms", "p80_ms"} over `repeats` groups of `eager_wall_ms`: how fast an eager
    loop calls `fn`, CPU launch costs included (which `benchmark`'s flush before each call hides)."""
    return _quantiles(_eager_group_ms(fn, torch.device(device), calls, repeats))


def time_one_call(fn: Callable[[], object], device: torch.device | str, hide_launch: bool = False) -> float:
    """Milliseconds of one call of `fn()` after one untimed call (which pays compilation and
    algorithm selection); CUDA events on CUDA (launch overhead hidden as in `benchmark` when
    `hide_launch`), wall clock on CPU."""
    device = torch.device(device)
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return _event_times(fn, 1, None, _launch_cover(fn, device) if hide_launch else None)[0]
