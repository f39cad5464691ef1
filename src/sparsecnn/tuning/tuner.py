"""Tune one layer: reuse the decision on disk, or time the candidates and store the winner."""
from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Sequence, Tuple

import torch

from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.cache import CachedDecision, TuneCache, key_digest, layer_key
from sparsecnn.tuning.phases import PhaseClock
from sparsecnn.tuning.precision import PrecisionPolicy, tf32_flags
from sparsecnn.tuning.report import LayerResult
from sparsecnn.tuning.select import (
    BASELINE,
    DEFAULT_DROP_RATIO,
    Candidate,
    Selection,
    Timer,
    pick_fastest,
)

ACTIVATIONS = ("none", "relu")


def _normalised(value):
    """`value` as it reads back from JSON (tuples become lists), for comparing with stored entries."""
    return json.loads(json.dumps(value))


def _offered(decision: CachedDecision, candidates: List[Candidate]) -> Optional[Candidate]:
    wanted = [decision.backend, decision.config]
    return next((c for c in candidates if _normalised(list(c.saved())) == wanted), None)


def cached_choice(cache: TuneCache, key: dict, candidates: List[Candidate]
                  ) -> Tuple[Optional[Candidate], Optional[CachedDecision], Optional[str]]:
    """(the cached choice among `candidates`, its decision, None) on a usable hit for `key`, else
    (None, None or the decision, why the entry cannot be used or None when there is none)."""
    decision, note = cache.lookup(key)
    chosen = None if decision is None else _offered(decision, candidates)
    if decision is not None and chosen is None:
        note = f"the cached choice {decision.backend} {decision.config} is not among this run's candidates"
    return chosen, decision, note


def tune_layer(name: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
               policy: PrecisionPolicy, candidates: List[Candidate], timer: Timer,
               cache: Optional[TuneCache] = None, retune: bool = False, drop_ratio: float = DEFAULT_DROP_RATIO,
               activation: str = "none", residual: Optional[torch.Tensor] = None,
               clock: Optional[PhaseClock] = None, run_mode: str = "graph",
               deferred: Sequence[Candidate] = ()) -> LayerResult:
    """The fastest of `candidates` for one layer, from `cache` when it holds a usable decision.

    x: the layer's input (N, C, H, W) in `policy.dtype`; weight: masked (K, C // groups, R, S);
    bias: (K,) or None; activation ("none" or "relu") and residual (None or the output's shape) are
    the fused epilogue every candidate runs with. retune: time even when a decision is cached.
    Timing runs with the global TF32 flags as `policy.dense_tf32` says (see `precision`). The result's `cache_note` says why
    an entry on disk was not used, when one existed. clock: see `pick_fastest`. run_mode: what
    `timer` measures ("graph": GPU time, "eager": eager wall time), part of the cache key.
    deferred: those of `candidates` not to time now (their preparation is still running): without
    a usable cache entry the others are timed, nothing is stored, and the result lists them in
    `deferred` for `finish_deferred`, which times them later under the same key.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    key = layer_key(spec, policy.name, weight, bias is not None, activation, residual is not None,
                    [candidate.saved() for candidate in candidates], run_mode)
    note = None
    if cache is not None and not retune:
        chosen, decision, note = cached_choice(cache, key, candidates)
        if chosen is not None:
            return LayerResult(name, spec, chosen.backend, chosen.config, chosen.label(), decision.time_ms,
                               decision.dense_ms, dict(decision.times_ms), {}, "hit", key=key_digest(key))
    deferred = tuple(c for c in candidates if c in deferred)
    with tf32_flags(policy.dense_tf32):
        selection = pick_fastest(x, weight, bias, spec, [c for c in candidates if c not in deferred], timer,
                                 drop_ratio, activation == "relu", residual, clock=clock)
    if not deferred:
        _store(cache, key, selection)
    return _result(name, spec, selection, selection.dropped, "tuned" if note is None else "retuned", note, deferred,
                   key)


def finish_deferred(result: LayerResult, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    spec: ConvSpec, policy: PrecisionPolicy, candidates: List[Candidate], timer: Timer,
                    cache: Optional[TuneCache] = None, drop_ratio: float = DEFAULT_DROP_RATIO,
                    activation: str = "none", residual: Optional[torch.Tensor] = None,
                    clock: Optional[PhaseClock] = None, run_mode: str = "graph") -> LayerResult:
    """`result` of `tune_layer` (same arguments) with its `deferred` candidates timed: they, its
    choice and the dense baseline are timed together, the fastest is the decision, stored under the
    key of the full `candidates`. A result without deferred candidates is returned as it is."""
    if not result.deferred:
        return result
    key = layer_key(spec, policy.name, weight, bias is not None, activation, residual is not None,
                    [candidate.saved() for candidate in candidates], run_mode)
    chosen = next(c for c in candidates if c.label() == result.choice)
    rivals = list(dict.fromkeys([chosen, Candidate(BASELINE), *result.deferred]))
    with tf32_flags(policy.dense_tf32):
        selection = pick_fastest(x, weight, bias, spec, rivals, timer, drop_ratio, activation == "relu", residual,
                                 clock=clock)
    _store(cache, key, selection)
    merged = dataclasses.replace(selection, times_ms={**result.times_ms, **selection.times_ms})
    return _result(result.name, spec, merged, {**result.dropped, **selection.dropped}, result.cache,
                   result.cache_note, (), key)


def _store(cache: Optional[TuneCache], key: dict, selection: Selection) -> None:
    if cache is not None:
        best = selection.best
        cache.store(key, CachedDecision(best.backend, best.saved()[1], selection.best_ms,
                                        selection.times_ms.get(Candidate(BASELINE).label(), float("nan")),
                                        selection.times_ms))


def _result(name: str, spec: ConvSpec, selection: Selection, dropped: dict, cache: str, note: Optional[str],
            deferred: tuple, key: dict) -> LayerResult:
    best = selection.best
    dense_ms = selection.times_ms.get(Candidate(BASELINE).label(), float("nan"))
    return LayerResult(name, spec, best.backend, best.config, best.label(), selection.best_ms, dense_ms,
                       selection.times_ms, dropped, cache, note, deferred, key_digest(key))
