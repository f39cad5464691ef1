"""The whole-model check after per-layer tuning: never slower than dense, then layers switched in context.

Per-layer choices are timed one layer at a time with L2 flushed, on the layout each layer received
while tuning, so they can add up to a model slower than dense: NCHW sparse kernels next to NHWC
dense ones convert between layouts, and dense layers profit more from activations left in L2 by
the previous layer. So the model is timed as tuned and with every tuned layer on the dense backend;
the faster is kept. Then, from the kept one, layers are switched one at a time to their other
choice (the tuned one, or dense), most promising first, and a switch stays when the whole model
gets faster: this finds the sparse layers that pay off in context (fp16 ResNet-50: the all-dense
model beat the tuned one, yet some of its layers' sparse kernels still win).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from sparsecnn.nn.graphed import disable_cuda_graphs, enable_cuda_graphs
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning.report import LayerResult, ModelCheck
from sparsecnn.tuning.select import Candidate, Timer
from sparsecnn.tuning.timing import eager_wall_ms

_LOG = logging.getLogger("sparsecnn.tuning")
# Switches tried after the tuned/dense comparison: each costs one whole-model measurement.
MAX_SWITCHES = 24
# A switch is kept only when the model gets at least this much faster: smaller gains are noise.
MIN_GAIN = 0.005


class GraphedModelTimer:
    """A `select.Timer` for whole-model timings: each probe or measurement runs with `model`'s
    forward replaying a CUDA graph (`nn.graphed.enable_cuda_graphs`), captured anew each time
    (layers change backends between timings), as the model runs after `sparsify_`; graphs are off
    again afterwards. Timed eagerly behind a launch cover instead, a tuned model whose CPU enqueue
    (6-8 ms for ResNet-50) dwarfs its GPU work (under 1 ms) measures CPU time whenever a repeat
    enqueues more slowly than the calibration calls did."""

    def __init__(self, timer: Timer, model: nn.Module):
        self.timer, self.model = timer, model

    def probe(self, candidate: Candidate, fn: Callable[[], object]) -> float:
        return self._graphed(self.timer.probe, candidate, fn)

    def measure(self, candidate: Candidate, fn: Callable[[], object]) -> float:
        return self._graphed(self.timer.measure, candidate, fn)

    def _graphed(self, timing, candidate: Candidate, fn: Callable[[], object]) -> float:
        enable_cuda_graphs(self.model)
        try:
            return timing(candidate, fn)
        finally:
            disable_cuda_graphs(self.model)


def model_timer(timer: Timer, model: nn.Module, device_type: str, run_mode: str) -> Timer:
    """The timer for whole-model timings: `GraphedModelTimer` on CUDA in run mode "graph" (what the
    user's model replays), else `timer` itself (eager wall time is what run mode "eager" decides on)."""
    return GraphedModelTimer(timer, model) if device_type == "cuda" and run_mode == "graph" else timer


def dense_backend(device_type: str) -> str:
    """The dense backend a whole model is checked against: on CUDA cuDNN with the epilogue fused
    (NHWC for fp16/bf16), the fastest dense form on ResNet-50."""
    return "dense-fused" if device_type == "cuda" else "dense"


def check_against_dense(run: Callable[[], object], tuned: Dict[str, SparseConv2d], results: Dict[str, LayerResult],
                        device_type: str, timer: Timer, max_switches: int = MAX_SWITCHES) -> ModelCheck:
    """Time `run()` (the whole model) as tuned and with every tuned layer on the dense backend, keep
    the faster, then switch up to `max_switches` layers in context (see the module doc).

    tuned: module path -> tuned layer; results: their `LayerResult`s (isolated times, which order
    the switches). Times come from `timer` (GPU time, or eager wall time with run_mode "eager"). On
    CUDA both models are also timed in eager mode, where launches can make a model tuned on GPU
    time slower (small batches): a warning says so."""
    dense = dense_backend(device_type)
    chosen = {name: layer.backend_state() for name, layer in tuned.items()}
    tuned_ms, tuned_eager_ms = timer.measure(Candidate("model:tuned"), run), _eager_ms(run, device_type)
    for layer in tuned.values():
        layer.set_backend(dense, None)
    dense_ms, dense_eager_ms = timer.measure(Candidate(f"model:{dense}"), run), _eager_ms(run, device_type)
    dense_states = {name: layer.backend_state() for name, layer in tuned.items()}
    kept = "dense" if tuned_ms > dense_ms else "tuned"
    if kept == "tuned":
        for name, state in chosen.items():
            tuned[name].restore_backend(state)
    else:
        _LOG.warning("the tuned model took %.4g ms, %s on every layer %.4g ms: every tuned layer now runs %s, "
                     "then single layers are switched back where the model gets faster", tuned_ms, dense, dense_ms,
                     dense)
    base = (chosen, dense_states) if kept == "tuned" else (dense_states, chosen)
    order = _switch_order(results, chosen, dense, kept)[:max_switches]
    switched, final_ms = _switch_layers(run, tuned, order, *base, min(tuned_ms, dense_ms), timer)
    check = ModelCheck(tuned_ms, dense_ms, dense, kept, tuned_eager_ms, dense_eager_ms, switched, final_ms)
    if check.slower_in_eager:
        _LOG.warning("in eager mode the tuned model takes %.4g ms per call, %s on every layer %.4g ms: its "
                     "kernel launches are CPU-bound; run it under CUDA graphs or torch.compile, or tune with "
                     "run_mode='eager' (GPU work %.4g ms against %.4g ms)", tuned_eager_ms, dense, dense_eager_ms,
                     tuned_ms, dense_ms)
    return check


def check_against_given(check: ModelCheck, given_ms: float, restore: Callable[[], None]) -> ModelCheck:
    """`check` with the model as given to tuning (`given_ms`, timed before any change with the same
    timer, dtype and flags) compared: when it was faster than the model as kept, `restore()` puts
    it back and the check says kept "given", so tuning never makes a model slower than it came."""
    if given_ms < check.best_ms:
        _LOG.warning("the model as given took %.4g ms, as tuned %.4g ms: it is put back as given", given_ms,
                     check.best_ms)
        restore()
        return dataclasses.replace(check, given_ms=given_ms, kept="given")
    return dataclasses.replace(check, given_ms=given_ms)


def _isolated_gain(result: LayerResult, dense: str) -> float:
    """ms the layer's choice saved over the dense backend when timed alone (inf when dense was not
    timed: dropped as hopeless, so the choice saves much)."""
    dense_ms = result.times_ms.get(Candidate(dense).label(), float("inf"))
    return dense_ms - result.time_ms


def _switch_order(results: Dict[str, LayerResult], chosen: Dict[str, tuple], dense: str, kept: str) -> List[str]:
    """Layers whose tuned choice is not `dense`: from a dense model the largest isolated gains first
    (most likely to pay in context), from the tuned one the smallest first (most likely to lose)."""
    movable = [name for name, state in chosen.items() if state[0] != dense and name in results]
    gains = {name: _isolated_gain(results[name], dense) for name in movable}
    return sorted(movable, key=lambda name: -gains[name] if kept == "dense" else gains[name])


def _switch_layers(run: Callable[[], object], tuned: Dict[str, SparseConv2d], order: List[str],
                   base: Dict[str, tuple], other: Dict[str, tuple], base_ms: float,
                   timer: Timer) -> Tuple[List[str], float]:
    """Switch each layer of `order` from its `base` state to its `other` one; keep the switch when
    the model gets at least `MIN_GAIN` faster than the best so far. Returns (switched layers, ms)."""
    switched, best_ms = [], base_ms
    for name in order:
        tuned[name].restore_backend(other[name])
        ms = timer.measure(Candidate(f"model:switch {name}"), run)
        if ms < best_ms * (1 - MIN_GAIN):
            switched.append(name)
            best_ms = ms
        else:
            tuned[name].restore_backend(base[name])
    if switched:
        _LOG.info("switched %d layers in context (%s): model %.4g ms, %.4g ms before", len(switched),
                  ", ".join(switched), best_ms, base_ms)
    return switched, best_ms


def _eager_ms(run: Callable[[], object], device_type: str) -> Optional[float]:
    """Wall ms per call of 10 back-to-back eager calls (CUDA only, else None): unlike the GPU-time
    medians, this includes the CPU cost of issuing the work."""
    return eager_wall_ms(run, "cuda") if device_type == "cuda" else None


def check_compiled(sparse: Callable[[], object], dense: Callable[[], object], timer: Timer) -> Tuple[str, float, float]:
    """(kept, sparse_ms, dense_ms): the sparsified model and the model as given, both under
    torch.compile (already compiled: their first calls are behind them), timed by `timer`. kept is
    "sparse" only when it is strictly faster, else "dense": never slower than the model as given
    compiled the same way, the baseline a user of torch.compile has."""
    sparse_ms = timer.measure(Candidate("model:compiled sparse"), sparse)
    dense_ms = timer.measure(Candidate("model:compiled given"), dense)
    if sparse_ms < dense_ms:
        return "sparse", sparse_ms, dense_ms
    _LOG.warning("under torch.compile the model as given took %.4g ms, sparsified %.4g ms: the model as given is "
                 "kept", dense_ms, sparse_ms)
    return "dense", sparse_ms, dense_ms
