"""OptPrune's selection rule (paper 000, Sec. 5): re-prune only where the dense blocks gain little,
and search the budget B3 from large to small against an accuracy budget.

A layer's gain is what backend `blocks` (Algorithm 1's blocks plus the sparse remainder) measures
against the dense conv on the layer's real input, dense ms / `blocks` ms, given by a `measure_gains`
function (`sparsecnn.tuning.block_gains`: as the tuner times them on the model's device; tuning sits
above prune, so it is passed in). Layers whose gain is below `SelectionConfig.gain_threshold` are
re-pruned (`reprune_`); the others keep their unstructured mask.

The B3 search follows the paper's parameter tuning: start large (aggressive), re-prune and re-train
the selected layers, and take the first B3 whose accuracy on a held-out part of the training data is
within `accuracy_budget` points of the unstructured pruned model; when none is, the unstructured
masks stay (B3 = 0). Method "reprune-select" (`methods`) runs it after magnitude pruning; the
choice is logged and kept as `model.sparsecnn_selection` (`SelectionReport`). Given `units`, the
method searches tensor-core unit shapes instead (`unit_selection`, `UnitSelectionReport`).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from sparsecnn.backends.blocks.format import BlockParams
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.registry import get_method
from sparsecnn.prune.reprune import reprune_
from sparsecnn.prune.rounds import prune_in_rounds
from sparsecnn.prune.splits import top1_accuracy, training_batches
from sparsecnn.prune.training import TrainConfig, train_epochs
from sparsecnn.prune.trials import first_within_budget
from sparsecnn.prune.unit_selection import (
    MeasureGains,
    UnitSelectionConfig,
    Plan,
    measure_unit_gains,
    reprune_units_,
    search_units,
    unit_plans,
)

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """gain_threshold: re-prune a conv whose `blocks` run is less than this many times faster than
    its dense conv (> 0); b3_values: the budgets tried, each in (0, 1], tried largest first (paper
    Sec. 6: 0.3, 0.2, 0.1); accuracy_budget: top-1 points the re-pruned model may lose against the
    unstructured pruned one on the held-out data (>= 0); holdout: fraction of the training data
    kept out of training to measure that (0 < holdout < 1)."""

    gain_threshold: float = 1.5
    b3_values: Tuple[float, ...] = (0.3, 0.2, 0.1)
    accuracy_budget: float = 0.5
    holdout: float = 0.2

    def __post_init__(self):
        if not isinstance(self.gain_threshold, (int, float)) or not self.gain_threshold > 0:
            raise ValueError(f"SelectionConfig.gain_threshold must be a number > 0, got {self.gain_threshold!r}")
        values = tuple(self.b3_values)
        if not values or not all(isinstance(v, (int, float)) and 0 < v <= 1 for v in values):
            raise ValueError(f"SelectionConfig.b3_values must be numbers in (0, 1], got {self.b3_values!r}")
        object.__setattr__(self, "b3_values", tuple(sorted(values, reverse=True)))
        if not isinstance(self.accuracy_budget, (int, float)) or self.accuracy_budget < 0:
            raise ValueError(f"SelectionConfig.accuracy_budget must be a number >= 0, got {self.accuracy_budget!r}")
        if not isinstance(self.holdout, float) or not 0 < self.holdout < 1:
            raise ValueError(f"SelectionConfig.holdout must be a float in (0, 1), got {self.holdout!r}")


@dataclasses.dataclass
class SelectionReport:
    """What the rule chose: gains (conv -> measured gain, 0.0 where `blocks` did not run), the convs
    re-pruned, the unstructured model's held-out top-1 (percent), each B3 tried with its held-out
    top-1, and the chosen B3 (None: no B3 within the budget, the unstructured masks kept)."""

    gains: Dict[str, float]
    layers: List[str]
    baseline_top1: float
    trials: List[Tuple[float, float]]
    b3: Optional[float]

    def summary(self) -> str:
        tried = ", ".join(f"B3 {b3:g}: {top1:.2f}%" for b3, top1 in self.trials) or "none"
        chosen = f"B3 = {self.b3:g}" if self.b3 is not None else "no B3 within the budget: unstructured masks kept"
        gains = ", ".join(f"{name} {gain:.2f}x" for name, gain in self.gains.items())
        return (f"re-pruned {len(self.layers)} of {len(self.gains)} convs (blocks gains: {gains}; 0.00x = not "
                f"timed or dropped as far slower than dense); "
                f"held-out top-1 {self.baseline_top1:.2f}% unstructured; tried {tried}; {chosen}")


def layers_to_reprune(gains: Mapping[str, float], threshold: float) -> List[str]:
    """The convs whose gain is below `threshold`, in `gains`' order."""
    return [name for name, gain in gains.items() if gain < threshold]


def search_b3(model: nn.Module, masks: Masks, layers: List[str], config: SelectionConfig,
              retrain: Callable[[nn.Module, Masks], None], top1: Callable[[nn.Module], float],
              params: Optional[BlockParams] = None) -> Tuple[Masks, SelectionReport]:
    """Try config.b3_values (largest first) on copies of `model`: re-prune `layers` (`reprune_`),
    `retrain(copy, masks)`, `top1(copy)`; the first within config.accuracy_budget of `top1(model)`
    is loaded into `model` and its masks returned. None within: `model` and `masks` unchanged.
    The report's gains are left empty for the caller."""
    def remask(trial: nn.Module, b3: float) -> Masks:
        _, retrain_masks, _ = reprune_(trial, {name: masks[name] for name in layers}, b3, params)
        return {**masks, **retrain_masks}

    chosen, baseline, trials, b3 = first_within_budget(model, masks, config.b3_values, remask, retrain, top1,
                                                       config.accuracy_budget)
    return chosen, SelectionReport({}, layers, baseline, trials, b3)


def reprune_select_method(model: nn.Module, split, sparsity, seed: int = 0, progress: bool = False,
                          epochs: Optional[int] = None, batch_size: int = 64, lr: float = 0.01, t2: int = 4,
                          retrain_epochs: int = 4, selection: Optional[SelectionConfig] = None,
                          measure_gains: Optional[MeasureGains] = None, train: Optional[TrainConfig] = None,
                          units: Optional[UnitSelectionConfig] = None,
                          measure_unit_speed: Optional[MeasureGains] = None) -> Masks:
    """Pruning method "reprune-select" (see `methods`): "magnitude" on the training data less a held-out
    part (`selection.holdout`, or `units.holdout`), then one of two searches, each with
    `retrain_epochs` of masked re-training per trial and held-out top-1:
    - without `units`, OptPrune's rule (module docstring): `measure_gains(model, (a training batch,),
      conv paths)` (required; `sparsecnn.tuning.block_gains`), then `search_b3`; Algorithm 1 runs
      with `BlockParams(t2=t2)` as in "reprune";
    - with `units` (a `UnitSelectionConfig`), the tensor-core unit shapes (`unit_selection`): each
      shape's re-pruned copy timed by `measure_unit_speed(copy, (a training batch,), conv paths)`
      (required; `sparsecnn.tuning.tensorcore_gains`), then `search_units` over `unit_plans`; with
      units.steps > 1 each plan re-prunes the dense model in rounds (`rounds.prune_in_rounds`), its
      magnitude `epochs` (default 8) + `retrain_epochs` spread over them, instead of re-training.
    Returns the chosen masks; the report is logged and set as `model.sparsecnn_selection`."""
    if units is None and measure_gains is None:
        raise ValueError("reprune-select needs measure_gains, e.g. sparsecnn.tuning.block_gains "
                         "(`sparsecnn prune --method reprune-select` passes it)")
    if units is not None and measure_unit_speed is None:
        raise ValueError("reprune-select with units needs measure_unit_speed, e.g. sparsecnn.tuning.tensorcore_gains "
                         "(`sparsecnn prune --method reprune-select --unit-shapes ...` passes it)")
    selection = selection or SelectionConfig()
    fit = _holdout_split(split, (units or selection).holdout, seed)
    dense_state = copy.deepcopy(model.state_dict()) if units is not None and units.steps > 1 else None
    masks = get_method("magnitude")(model, fit, sparsity, seed=seed, progress=progress, epochs=epochs,
                                    batch_size=batch_size, lr=lr, train=train)
    convs = [name for name, module in model.named_modules()
             if name in masks and isinstance(module, (nn.Conv1d, nn.Conv2d))]
    example = (fit.train_x[:batch_size].to(next(model.parameters()).device),)

    def retrain(trial: nn.Module, trial_masks: Masks) -> None:
        train_epochs(trial, training_batches(trial, fit, batch_size, seed),
                     (train or TrainConfig()).phase(retrain_epochs, lr, seed, progress), masks=trial_masks,
                     description="reprune-select re-train")

    def top1(trial: nn.Module) -> float:
        return top1_accuracy(trial, fit)

    if units is not None:
        gains = measure_unit_gains(model, masks, example, convs, units.shapes, measure_unit_speed)
        plans = unit_plans(gains, units.gain_threshold)
        if dense_state is None:
            masks, report = search_units(model, masks, plans, units, retrain, top1)
        else:  # the rounds train the trial themselves
            remask = _plan_in_rounds(dense_state, fit, sparsity, units.steps,
                                     (8 if epochs is None else epochs) + retrain_epochs, seed=seed, progress=progress,
                                     batch_size=batch_size, lr=lr, train=train)
            masks, report = search_units(model, masks, plans, units, lambda trial, trial_masks: None, top1, remask)
    else:
        gains = measure_gains(model, example, convs)
        masks, report = search_b3(model, masks, layers_to_reprune(gains, selection.gain_threshold), selection,
                                  retrain, top1, BlockParams(t2=t2))
    report.gains = gains
    model.sparsecnn_selection = report
    _LOG.info("reprune-select: %s", report.summary())
    return masks


def _plan_in_rounds(dense_state: dict, split, sparsity, steps: int, epochs: int,
                    **options) -> Callable[[nn.Module, Plan], Masks]:
    """A `search_units` remask for units.steps > 1: the trial copy is reset to `dense_state` (the model
    before magnitude pruning), then re-pruned into the plan in `steps` rounds of rising sparsity
    with `epochs` in all (`rounds.prune_in_rounds`; options: its seed, progress, batch_size, lr, train)."""
    def remask(trial: nn.Module, plan: Plan) -> Masks:
        trial.load_state_dict(dense_state)
        return prune_in_rounds(trial, split, sparsity, steps, epochs,
                               lambda rounded, masks: reprune_units_(rounded, masks, plan),
                               description="reprune-select", **options)

    return remask


@dataclasses.dataclass
class _Split:
    """The parts of a digits-like split the methods read: train_x (n, ...) float and train_y (n,) int64
    to train on; test_x / test_y, what `top1_accuracy` scores (here: held-out training examples)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _holdout_split(split, fraction: float, seed: int) -> _Split:
    """A split whose training part is split's training examples less a seeded random `fraction`,
    and whose test part is that held-out fraction; split's own test part is never touched."""
    count = split.train_x.shape[0]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).to(split.train_x.device)
    cut = max(1, int(round(count * fraction)))
    if cut >= count:
        raise ValueError(f"holdout {fraction} leaves no training examples of {count}")
    keep, out = order[cut:], order[:cut]
    return _Split(split.train_x[keep], split.train_y[keep], split.train_x[out], split.train_y[out])
