"""The whole model around per-layer tuning: the model as given (kept to be timed and put back) and
the phases that time the tuned model as a whole (`WholeModel.decide`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List

from torch import nn

from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning.layout import keep_batch_inner_outputs
from sparsecnn.tuning.linears import tune_linears
from sparsecnn.tuning.model_check import check_against_dense, check_against_given
from sparsecnn.tuning.phases import PhaseClock, TickingTimer
from sparsecnn.tuning.select import Candidate, Timer


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
        return check, linears, batch_inner, layout_ms, output if linears else None


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
        self.splits = {name: module.splits for name, module in model.named_modules() if isinstance(module, SplitKLinear)}

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
