"""Where tuning time goes: wall seconds per named phase, summed over layers."""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator


class PhaseClock:
    """Wall seconds spent in each named phase (e.g. "compile", "benchmark"), summed over calls.

    Phases may nest (a phase inside another counts in both); `seconds` keeps the order in which
    phases first ran."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def format_phases(seconds: Dict[str, float]) -> str:
    """"name 1.2 s, other 0.3 s", in the dict's order."""
    return ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items())
