"""Where a process's threads spend their wall time while a block runs: a sampling profiler over
every Python thread, for the cold tuning time (issue 46).

Why not cProfile: it sees one thread, and tuning's first calls run on a thread pool while the tuning
thread waits for them, for worker processes, or for the GPU; cProfile's tracing also slows the
Python-heavy phases it measures. Here a daemon thread reads every other thread's stack
(`sys._current_frames`) every `interval_s` (default 20 ms; beside 16 idle threads 31 frames deep, a
pure-Python loop ran as fast with it as without, within this 2-core CPU's noise). Each sample is
weighted by the wall time since the sampler's previous sample, so a stretch in which C code held
the GIL (a Triton compile's MLIR passes) and the sampler could not run still counts, to the stack
seen when the sampler got the GIL back.

A frame is named `path:function`, path relative to the `sparsecnn` package or to site-packages
(`triton/compiler/compiler.py:compile`). The report gives, per thread group (a thread's name without
its digits: `MainThread`, `ThreadPoolExecutor-_`): its seconds, the functions on its stack the most
wall time (inclusive), its innermost frames (where it was), and, for the main thread, the innermost
`sparsecnn` frame paired with the innermost frame (which call of ours waited or ran in what).
"""
from __future__ import annotations

import collections
import functools
import re
import sys
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

Frame = str
_DIGITS = re.compile(r"\d+")
_ROOTS = ("/sparsecnn/", "/site-packages/", "/dist-packages/", "/lib/python")


def frame_name(frame) -> Frame:
    """`path:function` of a frame, the path shortened to what follows the package root."""
    return _code_name(frame.f_code)


@functools.lru_cache(maxsize=None)
def _code_name(code) -> Frame:
    path = code.co_filename
    for root in _ROOTS:
        cut = path.rfind(root)
        if cut >= 0:
            path = path[cut + len(root):]
            if root == "/sparsecnn/":
                path = "sparsecnn/" + path
            elif root == "/lib/python":  # the standard library: drop "3.11/"
                path = path.split("/", 1)[-1]
            break
    return f"{path}:{code.co_name}"


def _stack(frame, depth: int) -> Tuple[Frame, ...]:
    """The frames from the innermost outwards, at most `depth`."""
    names: List[Frame] = []
    while frame is not None and len(names) < depth:
        names.append(frame_name(frame))
        frame = frame.f_back
    return tuple(names)


class StackSampler:
    """Samples every other thread's stack every `interval_s` seconds while the `with` block runs.

    seconds: {(thread group, stack innermost first): wall seconds}; depth: frames kept per stack."""

    def __init__(self, interval_s: float = 0.02, depth: int = 80) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s, self.depth = interval_s, depth
        self.seconds: Dict[Tuple[str, Tuple[Frame, ...]], float] = collections.defaultdict(float)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "StackSampler":
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    group = _DIGITS.sub("_", names.get(ident, "unknown"))
                    self.seconds[(group, _stack(frame, self.depth))] += now - last
            last = now

    def groups(self) -> Dict[str, float]:
        """{thread group: seconds sampled}, most first."""
        totals: Dict[str, float] = collections.defaultdict(float)
        for (group, _), seconds in self.seconds.items():
            totals[group] += seconds
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def _of(self, group: str) -> Iterator[Tuple[Tuple[Frame, ...], float]]:
        return ((stack, seconds) for (name, stack), seconds in self.seconds.items() if name == group)

    def inclusive(self, group: str) -> Dict[Frame, float]:
        """{frame: seconds with it anywhere on the group's stacks} (a recursive frame counted once)."""
        totals: Dict[Frame, float] = collections.defaultdict(float)
        for stack, seconds in self._of(group):
            for frame in set(stack):
                totals[frame] += seconds
        return totals

    def innermost(self, group: str) -> Dict[Frame, float]:
        """{innermost frame: seconds}: where the group's threads were (waiting or running)."""
        totals: Dict[Frame, float] = collections.defaultdict(float)
        for stack, seconds in self._of(group):
            if stack:
                totals[stack[0]] += seconds
        return totals

    def ours_then_innermost(self, group: str) -> Dict[Tuple[Frame, Frame], float]:
        """{(innermost sparsecnn frame, innermost frame): seconds}: which call of ours was waiting on or
        running what ("-" where no sparsecnn frame is on the stack)."""
        totals: Dict[Tuple[Frame, Frame], float] = collections.defaultdict(float)
        for stack, seconds in self._of(group):
            if stack:
                ours = next((frame for frame in stack if frame.startswith("sparsecnn/")), "-")
                totals[(ours, stack[0])] += seconds
        return totals

    def report(self, top: int = 30) -> str:
        """The text report: per thread group, its seconds, then its top frames by each measure."""
        lines = []
        for group, total in self.groups().items():
            lines.append(f"== {group}: {total:.2f} s sampled")
            sections = [("inclusive", self.inclusive(group)), ("innermost", self.innermost(group))]
            if group == "MainThread":
                pairs = {f"{ours}  <-  {inner}": s for (ours, inner), s in self.ours_then_innermost(group).items()}
                sections.append(("innermost sparsecnn frame <- innermost frame", pairs))
            for title, totals in sections:
                lines.append(f"-- {title}")
                for name, seconds in sorted(totals.items(), key=lambda item: -item[1])[:top]:
                    lines.append(f"{seconds:8.2f} s  {100 * seconds / total:5.1f}%  {name}")
        return "\n".join(lines)
