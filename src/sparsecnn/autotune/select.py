"""Pick the fastest of several ways to run one layer, by measurement."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..backends import Backend, get_backend
from ..layers import ConvSpec
from .timing import benchmark


@dataclasses.dataclass(frozen=True)
class Candidate:
    backend: str
    config: Any = None

    def label(self) -> str:
        return self.backend if self.config is None else f"{self.backend}[{self.config}]"


def candidates_for(spec: ConvSpec, dtype: torch.dtype, device_type: str,
                   backends: Optional[List[str]] = None) -> List[Candidate]:
    """Every (backend, config) that supports the layer; `dense` is always included.

    Without an explicit `backends` list, a backend is skipped on devices outside its
    `autotune_devices`.
    """
    from ..backends import backend_names

    names = backend_names() if backends is None else list(dict.fromkeys(["dense", *backends]))
    found = []
    for name in names:
        backend: Backend = get_backend(name)
        if backends is None and backend.autotune_devices is not None and device_type not in backend.autotune_devices:
            continue
        if backend.unsupported_reason(spec, dtype, device_type) is None:
            found.extend(Candidate(name, config) for config in backend.configs(spec, dtype))
    return found


def pick_fastest(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
                 candidates: List[Candidate], **timing) -> Tuple[Candidate, Dict[str, float]]:
    """Time each candidate on input `x` (N, C, H, W) and weight (K, C // groups, R, S).

    A candidate that raises is skipped. Returns the fastest and {candidate label: median ms}.
    """
    times: Dict[str, float] = {}
    best, best_ms = None, float("inf")
    for candidate in candidates:
        backend = get_backend(candidate.backend)
        try:
            packed = backend.prepare(weight, candidate.config)
            ms = benchmark(lambda: backend.run(x, packed, bias, spec, candidate.config), x.device,
                           **timing)["median_ms"]
        except (RuntimeError, ValueError):  # a config the hardware refuses is dropped, not fatal
            times[candidate.label()] = float("nan")
            continue
        times[candidate.label()] = ms
        if ms < best_ms:
            best, best_ms = candidate, ms
    if best is None:
        raise RuntimeError(f"no candidate ran for {spec}")
    return best, times
