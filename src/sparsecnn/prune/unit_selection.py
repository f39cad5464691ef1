"""`reprune-select` over tensor-core unit shapes (issue 45): per conv, the (tile, chunk) shape whose
re-pruned layer runs fastest on backend `tensorcore`, backed off towards slower shapes until the
model is within the accuracy budget.

A shape (tile, chunk) re-prunes a conv into tiles of `tile` consecutive output channels sharing
units of `chunk` input channels at one tap (`prune.tiles`, channel order kept), at the conv's kept
count. Its gain is dense ms / `tensorcore` ms on the conv's real input: `measure_unit_gains`
re-prunes a copy of the model per shape and times it with a `MeasureGains` function
(`sparsecnn.tuning.tensorcore_gains`; tuning sits above prune, so it is passed in). A conv's
shapes at or above `UnitSelectionConfig.gain_threshold` qualify, fastest first. Plan k puts every
conv on its k-th fastest qualifying shape; a conv with fewer qualifying shapes keeps its
unstructured mask there. The plans are tried in order (re-prune, re-train, score
on held-out training data, as `search_b3` does) and the first within `accuracy_budget` points of
the unstructured model is kept; when none is, the unstructured masks stay. With `steps` > 1 a plan is
tried in rounds of rising sparsity from the dense model instead (`rounds.prune_in_rounds`, the same
epochs in all), as `reprune-tiles --steps` re-prunes.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.rounds import check_steps
from sparsecnn.prune.tiles import CHUNK_SIZES, TILE_SIZES, TileParams, reprune_tiles_
from sparsecnn.prune.trials import first_within_budget

Shape = Tuple[int, int]  # (tile: output channels per tile, chunk: input channels per unit)
Plan = Dict[str, Shape]  # conv path -> the shape it is re-pruned into
# (model, example inputs, conv paths) -> {conv path: dense ms / sparse backend ms}
MeasureGains = Callable[[nn.Module, tuple, List[str]], Dict[str, float]]


@dataclasses.dataclass(frozen=True)
class UnitSelectionConfig:
    """shapes: the (tile, chunk) shapes offered, tile in prune.tiles.TILE_SIZES and chunk > 1 in
    CHUNK_SIZES (default: the four the `tensorcore` backend's packings run); gain_threshold: a
    shape qualifies for a conv where `tensorcore` on it is at least this many times faster than the
    dense conv (> 0); accuracy_budget: top-1 points a plan may lose against the unstructured pruned
    model on the held-out data (>= 0); holdout: fraction of the training data kept out of training
    to measure that (0 < holdout < 1); steps: 1 re-prunes the magnitude-pruned model into a plan at
    once, n > 1 re-prunes the dense model in n rounds of rising sparsity (module docstring)."""

    shapes: Tuple[Shape, ...] = ((16, 16), (32, 16), (32, 32), (64, 32))
    gain_threshold: float = 1.0
    accuracy_budget: float = 0.5
    holdout: float = 0.2
    steps: int = 1

    def __post_init__(self):
        shapes = tuple(tuple(shape) for shape in self.shapes)
        if not shapes or not all(len(shape) == 2 and shape[0] in TILE_SIZES and shape[1] in CHUNK_SIZES
                                 and shape[1] > 1 for shape in shapes):
            raise ValueError(f"UnitSelectionConfig.shapes must be (tile, chunk) pairs with tile in {TILE_SIZES} and "
                             f"chunk in {tuple(c for c in CHUNK_SIZES if c > 1)}, got {self.shapes!r}")
        object.__setattr__(self, "shapes", tuple(dict.fromkeys(shapes)))
        if isinstance(self.gain_threshold, bool) or not isinstance(self.gain_threshold, (int, float)) \
                or not self.gain_threshold > 0:
            raise ValueError(f"UnitSelectionConfig.gain_threshold must be a number > 0, got {self.gain_threshold!r}")
        if isinstance(self.accuracy_budget, bool) or not isinstance(self.accuracy_budget, (int, float)) \
                or self.accuracy_budget < 0:
            raise ValueError(f"UnitSelectionConfig.accuracy_budget must be a number >= 0, got {self.accuracy_budget!r}")
        if not isinstance(self.holdout, float) or not 0 < self.holdout < 1:
            raise ValueError(f"UnitSelectionConfig.holdout must be a float in (0, 1), got {self.holdout!r}")
        check_steps(self.steps, "UnitSelectionConfig.steps")


@dataclasses.dataclass
class UnitSelectionReport:
    """What the search chose: gains (conv -> {shape: measured gain, 0.0 where `tensorcore` did not
    run}), the unstructured model's held-out top-1 (percent), each plan tried with its held-out
    top-1, and the plan kept (None: none within the budget, the unstructured masks kept)."""

    gains: Dict[str, Dict[Shape, float]]
    baseline_top1: float
    trials: List[Tuple[Plan, float]]
    plan: Optional[Plan]

    def summary(self) -> str:
        def text(plan: Plan) -> str:
            return ", ".join(f"{conv} {tile}x{chunk}" for conv, (tile, chunk) in plan.items())

        tried = "; ".join(f"[{text(plan)}]: {top1:.2f}%" for plan, top1 in self.trials) or "none (no shape qualified)"
        chosen = f"kept [{text(self.plan)}]" if self.plan is not None else \
            "no plan within the budget: unstructured masks kept"
        gains = "; ".join(f"{conv} " + ", ".join(f"{tile}x{chunk} {gain:.2f}x"
                                                 for (tile, chunk), gain in shapes.items())
                          for conv, shapes in self.gains.items() if shapes)
        measured = f"; tensorcore gains over dense: {gains}" if gains else ""
        return f"held-out top-1 {self.baseline_top1:.2f}% unstructured; tried {tried}; {chosen}{measured}"


def measure_unit_gains(model: nn.Module, masks: Masks, example_inputs: tuple, convs: List[str],
                       shapes: Sequence[Shape], measure: MeasureGains) -> Dict[str, Dict[Shape, float]]:
    """conv path -> {shape: gain}: per shape, a copy of `model` with every conv of `convs`
    re-pruned into it (`reprune_units_`, from `masks`) timed by `measure(copy, example_inputs,
    convs)`; `model` is left alone. The copy's zeros inside its new masks (cells the magnitude
    pruning had zeroed, which re-training fills) are made non-zero first, so that the timed kernels
    run every kept unit."""
    gains: Dict[str, Dict[Shape, float]] = {conv: {} for conv in convs}
    modules = dict(model.named_modules())
    for shape in shapes:
        trial = copy.deepcopy(model)
        trial_modules = dict(trial.named_modules())
        for conv, mask in reprune_units_(trial, masks, {conv: tuple(shape) for conv in convs}).items():
            if conv in convs:
                _fill_zeros_(trial_modules[conv].weight, mask, modules[conv].weight)
        for conv, gain in measure(trial, example_inputs, convs).items():
            gains[conv][tuple(shape)] = gain
    return gains


@torch.no_grad()
def _fill_zeros_(weight: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> None:
    """Set `weight`'s zeros where `mask` is True to the mean magnitude of `like`'s non-zeros."""
    fill = like.detach().abs().sum() / like.detach().count_nonzero().clamp(min=1)
    weight.masked_fill_(mask.to(weight.device) & (weight == 0), float(fill) or 1.0)


def unit_plans(gains: Mapping[str, Mapping[Shape, float]], threshold: float) -> List[Plan]:
    """Plan k: each conv on its k-th fastest shape among those with gain >= `threshold` (ties: the
    order of its gains), convs with fewer such shapes left out; plans with no conv are not made."""
    ranked = {conv: sorted((shape for shape, gain in shapes.items() if gain >= threshold),
                           key=lambda shape: -shapes[shape]) for conv, shapes in gains.items()}
    depth = max((len(shapes) for shapes in ranked.values()), default=0)
    return [{conv: shapes[k] for conv, shapes in ranked.items() if k < len(shapes)} for k in range(depth)]


def reprune_units_(model: nn.Module, masks: Masks, plan: Plan) -> Masks:
    """Re-prune, in place, each conv of `plan` into its shape at its kept count (channel order kept),
    zeroing the weights outside; returns `masks` with those convs' masks replaced."""
    new_masks = dict(masks)
    for conv, (tile, chunk) in plan.items():
        params = TileParams(tile=tile, sparsity=None, order="none", chunk=chunk)
        new_masks.update(reprune_tiles_(model, {conv: masks[conv]}, params)[0])
    return new_masks


def search_units(model: nn.Module, masks: Masks, plans: List[Plan], config: UnitSelectionConfig,
                 retrain: Callable[[nn.Module, Masks], None], top1: Callable[[nn.Module], float],
                 remask: Optional[Callable[[nn.Module, Plan], Masks]] = None) -> Tuple[Masks, UnitSelectionReport]:
    """`trials.first_within_budget` over `plans` with config.accuracy_budget, each plan re-pruned by
    `remask(copy, plan)` (None: `reprune_units_` of the copy from `masks`): the kept plan's masks,
    or `masks` with `model` unchanged when none is within. The report's gains are left empty for the
    caller."""
    remask = remask or (lambda trial, plan: reprune_units_(trial, masks, plan))
    chosen, baseline, trials, plan = first_within_budget(model, masks, plans, remask, retrain, top1,
                                                         config.accuracy_budget)
    return chosen, UnitSelectionReport({}, baseline, trials, plan)
