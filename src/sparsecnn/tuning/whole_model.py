"""The whole model around per-layer tuning: the model as given (kept to be timed and put back) and
the phases that time the tuned model as a whole (`WholeModel.decide`)."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Optional

from torch import fx, nn

from sparsecnn.backends import get_backend
from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning.layout import keep_batch_inner_outputs, keep_channels_last_outputs
from sparsecnn.tuning.linears import tune_linears
from sparsecnn.passes.shortcut import fold_shortcut, shortcut_pairs, unfold_shortcut
from sparsecnn.tuning.model_check import MIN_GAIN, check_against_dense, check_against_given
from sparsecnn.tuning.report import ModelCheck
from sparsecnn.tuning.phases import PhaseClock, TickingTimer
from sparsecnn.tuning.select import Candidate, Timer


_LOG = logging.getLogger("sparsecnn.tuning")


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at module path `name` of `model`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@dataclasses.dataclass
class WholeModel:
    """The whole-model phases after the layers are tuned, each timing `run()` (the model)."""

    model: nn.Module
    run: Callable[[], object]
    tuned: Dict[str, SparseConv2d]
    results: Dict[str, Any]
    device_type: str
    timer: Timer
    whole_model: Timer
    clock: PhaseClock
    error_of: Callable[[Any], float]  # a model output's relative error against the reference pass
    fold_alternative: Callable[[str], Optional[Candidate]]  # see `fold_shortcuts`

    def decide(self, inputs: tuple, given: "GivenModel", layers: Dict[str, nn.Module]):
        """(check, linears, batch-inner layers, layout ms, output of the linears' pass or None):
        the linears' splits, the output layouts, the model as given (where GIVEN_CHECK_DEVICES
        holds), then the model against dense and as given; the model is left as the check kept it."""
        with self.clock.bar("linears", unit="timing") as bar:
            linears, output = tune_linears(self.model, inputs, TickingTimer(self.timer, bar))
        with self.clock.bar("layouts", unit="timing") as bar:
            batch_inner, layout_ms = keep_batch_inner_outputs(self.model, self.run, self.tuned,
                                                              TickingTimer(self.whole_model, bar))
        with self.clock.bar("model as given", unit="timing") as bar:
            given_ms = (given.time(self.model, layers, TickingTimer(self.whole_model, bar), self.run)
                        if self.device_type in GIVEN_CHECK_DEVICES else None)
        with self.clock.bar("model check", unit="timing") as bar:
            check = check_against_dense(self.run, self.tuned, self.results, self.device_type,
                                        TickingTimer(self.whole_model, bar))
            if given_ms is not None:
                check = check_against_given(check, given_ms, lambda: given.restore(self.model, layers))
            check = fold_shortcuts(self.model, self.run, TickingTimer(self.whole_model, bar), check, self.error_of,
                                   self.fold_alternative)
            check = hand_on_channels_last(self.model, self.run, self.tuned, TickingTimer(self.whole_model, bar), check)
        return check, linears, batch_inner, layout_ms, output if linears else None


def fold_shortcuts(model: nn.Module, run: Callable[[], object], timer: Timer, check: ModelCheck,
                   error_of: Callable[[Any], float],
                   alternative: Callable[[str], Optional[Candidate]] = lambda name: None) -> ModelCheck:
    """Fold each projection shortcut (`passes.shortcut.shortcut_pairs`) into its conv, one at a time,
    where the conv runs a backend that can run it folded (`Backend.bind_shortcut`), or else on
    `alternative(conv path)` (a candidate of such a backend timed for that conv in tuning; None:
    none); keep a fold where `run()`, the whole model, gets `MIN_GAIN` faster than the best so far
    and its output's error (`error_of`) stays within twice the unfolded model's, else put the conv
    back as it was. A fold that fails or errs is undone and said once. Returns `check` with the
    folds kept and the model's time after them (unchanged when none was kept, or the model is kept
    as given)."""
    if not isinstance(model, fx.GraphModule) or check.kept == "given":
        return check
    trials = [(name, shortcut_name, _fold_candidate(model.get_submodule(name), name, alternative))
              for name, shortcut_name in shortcut_pairs(model)]
    trials = [trial for trial in trials if trial[2] is not None]
    best, folded = check.best_ms, []
    limit = 2 * error_of(run()) + 1e-5 if trials else 0.0
    for name, shortcut_name, candidate in trials:
        layer = model.get_submodule(name)
        state = layer.backend_state()
        if (candidate.backend, candidate.config) != (layer.backend, layer.config):
            layer.set_backend(candidate.backend, candidate.config)
        fold_shortcut(model, name, shortcut_name)
        ms = _fold_ms(model, run, timer, name, shortcut_name, error_of, limit)
        if ms < best * (1 - MIN_GAIN):
            best = ms
            folded.append([name, shortcut_name])
        else:
            unfold_shortcut(model, name, shortcut_name)
            layer.restore_backend(state)
    if folded:
        _LOG.info("folded %d projection shortcuts into their convs (%s): model %.4g ms", len(folded),
                  ", ".join(name for name, _ in folded), best)
    return dataclasses.replace(check, shortcuts=folded, final_ms=best) if folded else check


def hand_on_channels_last(model: nn.Module, run: Callable[[], object], tuned: Dict[str, SparseConv2d], timer: Timer,
                          check: ModelCheck) -> ModelCheck:
    """`layout.keep_channels_last_outputs` after the check and the folds (not on a model kept as
    given); returns `check` with the layers kept so and the model's time after them."""
    if check.kept == "given":
        return check
    kept, ms = keep_channels_last_outputs(model, run, tuned, timer, check.best_ms, MIN_GAIN)
    return dataclasses.replace(check, channels_last_outputs=kept, final_ms=ms) if kept else check


def _fold_candidate(layer: SparseConv2d, name: str,
                    alternative: Callable[[str], Optional[Candidate]]) -> Optional[Candidate]:
    """What the layer runs during its fold trial: its own backend and config where that backend can
    fold, else `alternative(name)`."""
    if get_backend(layer.backend).bind_shortcut is not None:
        return Candidate(layer.backend, layer.config)
    return alternative(name)


# Where the tuned model is checked against the model as given: where its speed is the point. On the
# CPU, where sparsecnn makes no speed claims, timing noise would put models back for nothing.
GIVEN_CHECK_DEVICES = ("cuda",)


class GivenModel:
    """What `autotune_model` changes in a model, as it was given: its selected convs (modules, or the
    backend state of those already `SparseConv2d`) and its `SplitKLinear` splits."""

    def __init__(self, model: nn.Module, originals: Dict[str, nn.Module]):
        self.originals = originals
        self.states = {name: module.backend_state() for name, module in originals.items()
                       if isinstance(module, SparseConv2d)}
        self.splits = {name: module.splits for name, module in model.named_modules()
                       if isinstance(module, SplitKLinear)}

    def restore(self, model: nn.Module, layers: Dict[str, nn.Module]) -> None:
        """Put every selected conv and linear split back as given (the layers `autotune_model` made
        are `layers`)."""
        for name, original in self.originals.items():
            if layers.get(name, original) is not original:
                replace_module(model, name, original)
            elif name in self.states:
                original.restore_backend(self.states[name])
        for name, module in model.named_modules():
            if name in self.splits:
                module.splits = self.splits[name]

    def describe(self) -> List[Any]:
        """The model as given, JSON-able, for `model_decision.model_key`: each selected conv's path and
        type (with backend and config where it is a `SparseConv2d`), and the linears' splits."""
        convs = [[name, type(module).__qualname__] + ([self.states[name][0], repr(self.states[name][1])]
                                                      if name in self.states else [])
                 for name, module in self.originals.items()]
        return [convs, sorted(self.splits.items())]

    def time(self, model: nn.Module, layers: Dict[str, nn.Module], timer: Timer, run: Callable[[], object]) -> float:
        """The whole model's time as given, by `timer` on `run()`: the given convs and splits put back
        for the timing, then the model as it was (tuned or not) again."""
        current = {name: model.get_submodule(name) for name in self.originals}
        states = {name: module.backend_state() for name, module in current.items() if isinstance(module, SparseConv2d)}
        splits = {name: module.splits for name, module in model.named_modules() if isinstance(module, SplitKLinear)}
        self.restore(model, layers)
        try:
            return timer.measure(Candidate("model:given"), run)
        finally:
            for name, module in current.items():
                if model.get_submodule(name) is not module:
                    replace_module(model, name, module)
                if name in states:
                    module.restore_backend(states[name])
            for name, module in model.named_modules():
                if name in splits:
                    module.splits = splits[name]


def _fold_ms(model: nn.Module, run: Callable[[], object], timer: Timer, name: str, shortcut_name: str,
             error_of: Callable[[Any], float], limit: float) -> float:
    """The whole model's time with `shortcut_name` folded into `name`; inf when the layer's config
    cannot run it as one kernel, and (with a warning) when the folded model fails or its output's
    error is over `limit`."""
    try:
        error = error_of(run())
        binding = model.get_submodule(name).shortcut_binding
        if binding is None or binding.call is None:  # this config cannot fold (`Backend.prepare_shortcut`)
            return math.inf
        if error > limit:
            _LOG.warning("folding %s into %s gave an error of %.3g against the reference, over %.3g: left as two "
                         "convs", shortcut_name, name, error, limit)
            return math.inf
        return timer.measure(Candidate(f"model:fold {name}"), run)
    except Exception as failure:  # noqa: BLE001  (an optional fold must never break tuning)
        _LOG.warning("folding %s into %s failed, left as two convs: %s: %s", shortcut_name, name,
                     type(failure).__name__, failure)
        return math.inf
