"""Where tuning time goes: wall seconds per named phase, summed over layers, with a progress bar
for each top-level phase."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, Iterator, Optional

from tqdm.auto import tqdm


class PhaseClock:
    """Wall seconds spent in each named phase (e.g. "compile", "benchmark"), summed over calls.

    Phases may nest (a phase inside another counts in both); `seconds` keeps the order in which
    phases first ran. progress: whether `bar` phases show a tqdm progress bar (on stderr)."""

    def __init__(self, progress: bool = False) -> None:
        self.seconds: Dict[str, float] = {}
        self.progress = progress
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` to phase `name`: work timed elsewhere, e.g. on threads (whose seconds
        overlap, so such phases can sum to more than the wall time of the phase around them). Thread-safe."""
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def bar(self, name: str, total: Optional[int] = None, unit: str = "step") -> Iterator[tqdm]:
        """A phase with a progress bar named `name` (shown when `progress`), yielded for the work to
        `update`; total: the steps the phase will take (None: unknown, the bar counts them). The bar
        ends with the phase's wall seconds, which `seconds` gets too."""
        bar = tqdm(total=total, desc=name, unit=unit, disable=not self.progress, leave=True)
        try:
            with self.phase(name):
                yield bar
        finally:
            bar.set_postfix_str(f"{self.seconds.get(name, 0.0):.1f} s", refresh=False)
            bar.close()


class TickingTimer:
    """A `select.Timer` that advances `bar` by one after each probe or measurement: the progress of
    a phase whose steps are whole-model timings (how many is decided as it goes)."""

    def __init__(self, timer, bar: tqdm) -> None:
        self.timer, self.bar = timer, bar

    def probe(self, candidate, fn: Callable[[], object]) -> float:
        return self._ticked(self.timer.probe(candidate, fn), candidate)

    def measure(self, candidate, fn: Callable[[], object]) -> float:
        return self._ticked(self.timer.measure(candidate, fn), candidate)

    def _ticked(self, ms: float, candidate) -> float:
        self.bar.set_postfix_str(candidate.label(), refresh=False)
        self.bar.update(1)
        return ms


def format_phases(seconds: Dict[str, float]) -> str:
    """"name 1.2 s, other 0.3 s", in the dict's order."""
    return ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items())
