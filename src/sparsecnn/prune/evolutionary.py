"""UnSparse-Opt pruning (paper 003, Algorithm 2): incremental pruning by retraining, steered by
per-layer sensitivity, with a ranked list of the best masks, mutation, crossover and rewinding.

One iteration: retrain one epoch under the current masks (collecting the mean weight gradients G,
eq. 10), measure validation accuracy, and attribute the change (the *sensitivity*, in percentage
points) to the layers changed by the previous step, whose sparsity steps Delta_i are rescaled by
eq. 11 (Delta_i += sensitivity * Delta_i / beta: a layer that costs accuracy gets smaller steps).
If the change is acceptable, the model joins the ranked list when it beats its worst entry and a
random subset of layers is pruned further by Delta_i, keeping the weights of largest importance
g = alpha * |G| + (1 - alpha) * |w| (eq. 12-14). Otherwise the changed layers are mutated (their
sparsity moved by -alpha_m * Delta_i, alpha_m ~ N(0, 1), eq. 15) or crossed with a random ranked
solution (its masks of those layers, eq. 17-18), and the weights are rewound to their values before
the last training epoch. The search stops when the weighted sparsity (eq. 8) reaches the target.

Deviations from the paper, all for a small deterministic library function: the search starts from
the given model with dense masks (the paper starts from scratch with random masks); the ranked list
starts with the initial solution only and grows to `population` entries; sensitivity is attributed
to the layers changed by the previous step; steps are clamped to [Delta_0 / 10, 2 * Delta_0]; and
if `generations` run out first, one last step spreads the remaining pruning over all layers in
proportion to what each may still lose, followed by the final retraining.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import random
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from sparsecnn.data import Batches
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.targets import SparsityTarget, layer_sparsities
from sparsecnn.prune.distributed import broadcast_object, broadcast_tensors_, shard_for_this_rank
from sparsecnn.prune.training import TrainConfig, accuracy, apply_masks_, train_epochs

KeepCounts = Dict[str, int]


@dataclasses.dataclass(frozen=True)
class EvolutionSettings:
    """Parameters of Algorithm 2 (paper symbols in brackets).

    population: length of the ranked list of best solutions [R_L]. generations: most iterations
    [N_it]. alpha: weight of |mean gradient| in the importance (eq. 12). uniform_per_channel: every
    output channel keeps the same number of weights (the uniform-ELL format of backend `direct`).
    min_accuracy_change: a step is accepted when validation accuracy changed by more than this many
    points [epsilon]. gamma: mutation when p ~ N(0, 1) exceeds it, else crossover [gamma]. beta:
    damping of the step update (eq. 11). initial_step: Delta_0, the sparsity added per step at first
    (None: 3 * weighted target / generations, so about two thirds of the iterations reach the
    target when layers are picked half the time). max_layer_sparsity: no layer (with
    uniform_per_channel, no output channel) goes sparser under a float target. retrain_epochs:
    training epochs per iteration; final_epochs: after the target is reached. lr, batch_size: of the
    SGD retraining. validation_fraction: share of the training split held out to measure accuracy
    (on digits about 360 images, so the default threshold rejects a step that loses two of them).
    """

    population: int = 8
    generations: int = 30
    alpha: float = 0.1
    uniform_per_channel: bool = False
    min_accuracy_change: float = -0.5
    gamma: float = 0.0
    beta: float = 10.0
    initial_step: Optional[float] = None
    max_layer_sparsity: float = 0.99
    retrain_epochs: int = 1
    final_epochs: int = 4
    lr: float = 0.01
    batch_size: int = 64
    validation_fraction: float = 0.25

    def __post_init__(self):
        for name in ("population", "generations", "retrain_epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.final_epochs < 0:
            raise ValueError(f"final_epochs must be >= 0, got {self.final_epochs!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta!r}")
        if not 0.0 < self.max_layer_sparsity < 1.0:
            raise ValueError(f"max_layer_sparsity must be in (0, 1), got {self.max_layer_sparsity!r}")
        if self.initial_step is not None and not 0.0 < self.initial_step <= 1.0:
            raise ValueError(f"initial_step must be in (0, 1] or None, got {self.initial_step!r}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction!r}")


@dataclasses.dataclass(frozen=True)
class PrunedLayer:
    """One layer under pruning: its weight has `numel` entries over `out_channels` output channels;
    its kept count moves in multiples of `unit` (out_channels when every channel keeps the same
    number, else 1) between `min_keep` and `numel`."""

    name: str
    numel: int
    out_channels: int
    unit: int
    min_keep: int

    def keep_for(self, sparsity: float) -> int:
        """Kept count nearest to `sparsity`, on the unit grid and inside [min_keep, numel]."""
        units = round((1.0 - sparsity) * self.numel / self.unit)
        return min(max(units * self.unit, self.min_keep), self.numel)

    def sparsity(self, keep: int) -> float:
        return 1.0 - keep / self.numel


@dataclasses.dataclass
class Solution:
    """An entry of the ranked list: validation accuracy (percent), kept counts and masks."""

    accuracy: float
    keep: KeepCounts
    masks: Masks


def importance(weight: torch.Tensor, mean_gradient: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 12: alpha * |G| + (1 - alpha) * |w|, elementwise; both tensors of one shape."""
    if weight.shape != mean_gradient.shape:
        raise ValueError(f"mean_gradient shape {tuple(mean_gradient.shape)} != weight shape {tuple(weight.shape)}")
    return alpha * mean_gradient.abs() + (1.0 - alpha) * weight.detach().abs()


def importance_mask(scores: torch.Tensor, keep: int, per_channel: bool = False) -> torch.Tensor:
    """Bool mask shaped like `scores` (dim 0 = output channels) keeping the `keep` highest scores,
    or with `per_channel` the keep / out_channels highest of each output channel. Ties go to the
    lower flat index, so the mask is deterministic."""
    rows = scores.reshape(scores.shape[0] if per_channel else 1, -1)
    if keep % rows.shape[0] or not 0 <= keep <= scores.numel():
        raise ValueError(f"keep must be a multiple of {rows.shape[0]} in [0, {scores.numel()}], got {keep}")
    order = torch.sort(rows, dim=1, descending=True, stable=True).indices[:, : keep // rows.shape[0]]
    mask = torch.zeros_like(rows, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask.reshape(scores.shape)


def fit_keep_counts(layers: Sequence[PrunedLayer], current: KeepCounts, proposed: KeepCounts,
                    target_keep: int) -> KeepCounts:
    """`proposed` with its reductions scaled down so the total kept stays >= `target_keep`.

    When the cap binds, the total lands on `target_keep` exactly with unit 1, and otherwise below it
    by less than the smallest unit of a layer that could still shrink. Increases pass unchanged.
    """
    by_name = {layer.name: layer for layer in layers}
    cuts = {name: current[name] - proposed[name] for name in proposed if proposed[name] < current[name]}
    total_without_cuts = sum(max(current[name], proposed[name]) for name in current)
    allowed = max(total_without_cuts - target_keep, 0)
    wanted = sum(cuts.values())
    if wanted <= allowed:
        return dict(proposed)
    units = {name: by_name[name].unit for name in cuts}
    scaled = {name: (cut * allowed) // (wanted * units[name]) * units[name] for name, cut in cuts.items()}
    leftover = allowed - sum(scaled.values())
    for name in sorted(cuts, key=lambda n: -units[n]):
        extra = min((cuts[name] - scaled[name]) // units[name], leftover // units[name]) * units[name]
        scaled[name] += extra
        leftover -= extra
    if leftover > 0:
        finest = min((n for n in cuts if scaled[n] < cuts[n]), key=lambda n: units[n])
        scaled[finest] += units[finest]
    fitted = dict(proposed)
    fitted.update({name: current[name] - scaled[name] for name in cuts})
    return fitted


def increment_keep_counts(layers: Sequence[PrunedLayer], keep: KeepCounts, steps: Dict[str, float],
                          chosen: Sequence[str], target_keep: int) -> KeepCounts:
    """Eq. 13: sparsity_i += Delta_i for the `chosen` layers, not below `target_keep` in total."""
    return _moved(layers, keep, {name: steps[name] for name in chosen}, target_keep)


def mutate_keep_counts(layers: Sequence[PrunedLayer], keep: KeepCounts, steps: Dict[str, float],
                       chosen: Sequence[str], alpha_m: float, target_keep: int) -> KeepCounts:
    """Eq. 15: sparsity_i -= alpha_m * Delta_i for the `chosen` layers, not below `target_keep`."""
    return _moved(layers, keep, {name: -alpha_m * steps[name] for name in chosen}, target_keep)


def crossover_keep_counts(layers: Sequence[PrunedLayer], keep: KeepCounts, parent: KeepCounts,
                          chosen: Sequence[str], target_keep: int) -> List[str]:
    """Eq. 17-18: the `chosen` layers whose mask may come from `parent` without the total kept
    falling below `target_keep` (taken in order, a layer that would overshoot is skipped)."""
    total, taken = sum(keep.values()), []
    for name in chosen:
        if total - keep[name] + parent[name] >= target_keep:
            total += parent[name] - keep[name]
            taken.append(name)
    return taken


def _moved(layers: Sequence[PrunedLayer], keep: KeepCounts, sparsity_changes: Dict[str, float],
           target_keep: int) -> KeepCounts:
    by_name = {layer.name: layer for layer in layers}
    proposed = dict(keep)
    for name, change in sparsity_changes.items():
        layer = by_name[name]
        proposed[name] = layer.keep_for(layer.sparsity(keep[name]) + change)
    return fit_keep_counts(layers, keep, proposed, target_keep)


def layers_under_pruning(model: nn.Module, sparsity: SparsityTarget, settings: EvolutionSettings) -> List[PrunedLayer]:
    """The layers Algorithm 2 prunes with their kept-count grid and floor: for a float `sparsity`,
    `targets.pruned_layers` floored by max_layer_sparsity; for {module path: fraction}, those layers
    floored at their own targets, which the search then reaches exactly."""
    modules = dict(model.named_modules())
    layers = []
    for name, target in layer_sparsities(model, sparsity).items():
        weight = modules[name].weight
        numel, channels = weight.numel(), weight.shape[0]
        unit = channels if settings.uniform_per_channel else 1
        if isinstance(sparsity, Mapping):
            min_keep = max(unit, round((1.0 - target) * numel / unit) * unit)
        else:
            min_keep = max(unit, math.ceil((1.0 - settings.max_layer_sparsity) * numel / unit - 1e-9) * unit)
        layers.append(PrunedLayer(name, numel, channels, unit, min(min_keep, numel)))
    if not layers:
        raise ValueError("sparsity selects no layer to prune")
    return layers


def evolutionary_prune_(model: nn.Module, split, sparsity: SparsityTarget, *, seed: int = 0,
                        population: int = 8, generations: int = 30, alpha: float = 0.1,
                        uniform_per_channel: bool = False, progress: bool = False,
                        epochs: Optional[int] = None, train: Optional[TrainConfig] = None, **settings) -> Masks:
    """Prune `model` in place with Algorithm 2, retraining on `split`'s training part (a
    `DigitsSplit`-like object; moved to the model's device; its test part is never used).

    `sparsity`: a float is the weighted sparsity (eq. 8) over `targets.pruned_layers(model)`, whose
    per-layer sparsities the search chooses; it is reached exactly (round((1 - sparsity) * total)
    weights kept) or, with `uniform_per_channel`, exceeded by less than one weight per output
    channel of one layer. A mapping {module path: fraction} prunes those layers, each exactly to
    its own fraction (with `uniform_per_channel`, to the nearest whole count per channel).
    `epochs` (the method registry's option) sets the final fine-tuning length; each iteration
    retrains `retrain_epochs`. `batch_size` and other keywords are fields of `EvolutionSettings`.
    `train`: settings of every retraining besides epochs, lr and seed (momentum, weight decay,
    precision, run state). With a run state (`train.state`, a `resume.RunState`) the search is one
    phase of the run, recorded after every generation (the model, masks, training batches' order,
    kept counts, steps, ranked list, rewind point, mean gradients and the search's random
    generator), and the final retraining one more, recorded after every epoch: a killed run
    started again with the same arguments and a `RunState` on the same file goes on from the next
    generation or epoch and ends with the masks and weights of an uninterrupted one. A file from a
    search with other settings, sparsity, seed, momentum, weight decay or precision is refused
    (ValueError naming them). In a distributed run rank 0 measures the accuracies, chooses the
    masks, broadcast to every rank, and writes the run state.
    Returns {module path: bool mask}.
    """
    train = TrainConfig() if train is None else train
    if epochs is not None:
        settings["final_epochs"] = epochs
    config = EvolutionSettings(population=population, generations=generations, alpha=alpha,
                               uniform_per_channel=uniform_per_channel, **settings)
    if not isinstance(sparsity, Mapping) and not 0.0 <= float(sparsity) <= config.max_layer_sparsity:
        raise ValueError(f"sparsity must be in [0, max_layer_sparsity={config.max_layer_sparsity}], got {sparsity!r}")
    search = _Search(model, split, sparsity, config, seed, train)
    search.run(progress)
    train_epochs(model, search.train, train.phase(config.final_epochs, config.lr, seed + 1, progress),
                 masks=search.masks, description="evolutionary final retraining")
    return {name: mask.clone() for name, mask in search.masks.items()}


class _Search:
    """State of one Algorithm 2 run: current masks and kept counts, steps, ranked list, generations
    done; with a run state (`train.state`), recorded after every generation."""

    def __init__(self, model: nn.Module, split, sparsity: SparsityTarget, config: EvolutionSettings, seed: int,
                 train: TrainConfig):
        self.model, self.config, self.seed = model, config, seed
        self.run_state, self.recorded_settings = train.state, _recorded_settings(config, sparsity, seed, train)
        # The search records itself once per generation as one phase; a run state handed on to its
        # retraining rounds would make each a phase of its own, as many as the search happens to run.
        self.train_config = train.replace(state=None)
        self.rng = random.Random(seed)
        self.device = next(model.parameters()).device
        self.train, self.validation = _train_validation(split, self.device, config, seed)
        self.layers = layers_under_pruning(model, sparsity, config)
        self.modules = dict(model.named_modules())
        floor = sum(layer.min_keep for layer in self.layers)
        if isinstance(sparsity, Mapping):
            self.target_keep = floor
        else:
            self.target_keep = round((1.0 - float(sparsity)) * sum(layer.numel for layer in self.layers))
        if self.target_keep < floor:
            raise ValueError(f"sparsity {sparsity} keeps {self.target_keep} weights, fewer than the "
                             f"{floor} that max_layer_sparsity={config.max_layer_sparsity} leaves")
        weighted = 1.0 - self.target_keep / sum(layer.numel for layer in self.layers)
        self.keep = {layer.name: layer.numel for layer in self.layers}
        self.masks = {layer.name: torch.ones_like(self.modules[layer.name].weight, dtype=torch.bool)
                      for layer in self.layers}
        first_step = config.initial_step or min(1.0, max(3.0 * weighted / config.generations, 1e-3))
        self.step_bounds = (first_step / 10.0, 2.0 * first_step)
        self.steps = {layer.name: first_step for layer in self.layers}
        self.changed: List[str] = []
        self.generation = 0
        self.accuracy = math.nan
        self.ranked: List[Solution] = []
        self.rewind_point: Dict[str, torch.Tensor] = {}
        self.mean_gradients: Dict[str, torch.Tensor] = {}

    def reached(self) -> bool:
        return sum(self.keep.values()) <= self.target_keep

    def run(self, progress: bool) -> None:
        """The whole search, or with a run state its rest: nothing when the file records it as
        finished before a later phase (which loads the weights and masks), else from the
        generation after the last one recorded."""
        state = self.run_state
        phase = None if state is None else state.begin("evolutionary search", self.recorded_settings)
        resumed = None if phase is None else state.resume(phase, self._parts(), self.masks)
        if resumed is None:
            self._start()
        elif math.isinf(resumed["epoch"]):
            return
        self._evolve(phase, progress)

    def _start(self) -> None:
        """The given model with dense masks is the first ranked solution and rewind point."""
        self.accuracy = broadcast_object(accuracy(self.model, self.validation))
        self.ranked = [Solution(self.accuracy, dict(self.keep), _clone(self.masks))]
        self.rewind_point = copy.deepcopy(self.model.state_dict())

    def _evolve(self, phase: Optional[int], progress: bool) -> None:
        """Generations from `self.generation` on until the target is reached, then the last step to
        it if they ran out. That step always reaches the target (`fit_keep_counts`), so a search
        resumed after it has nothing left to do but record itself again."""
        from tqdm.auto import tqdm

        bar = tqdm(range(self.generation, self.config.generations), desc="evolutionary pruning",
                   disable=not progress, leave=False, initial=self.generation, total=self.config.generations)
        for iteration in bar:
            if self.reached():
                break
            self._iterate(iteration)
            self.generation = iteration + 1
            self._save(phase, finished=False)
            bar.set_postfix(accuracy=f"{self.accuracy:.1f}", kept=sum(self.keep.values()))
        if not self.reached():
            self._finish()
        self._save(phase, finished=True)

    def _parts(self) -> dict:
        """What the run state saves and restores: the training batches carry their shuffling order."""
        return {"model": self.model, "batches": self.train, "search": self}

    def _save(self, phase: Optional[int], finished: bool) -> None:
        if phase is not None:
            # The run state's epochs count the generations done; the search has no steps or loss of its own.
            self.run_state.save(phase, self.generation, finished, 0, math.nan, self._parts(), self.masks,
                                self.device)

    def state_dict(self) -> dict:
        """The search after a generation, beside the model, masks and batches in the run state:
        {"generation": generations done, "keep": {module path: kept count}, "steps": {module path:
        sparsity step, a fraction}, "changed": [module path], "accuracy": validation top-1 in
        percent, "ranked": [{"accuracy", "keep", "masks": {module path: bool tensor shaped like the
        weight}}], "rewind_point": the model's state dict to rewind to, "mean_gradients": {module
        path: float32 tensor shaped like the weight}, "rng": the `random.Random` state (a tuple)}."""
        return {"generation": self.generation, "keep": dict(self.keep), "steps": dict(self.steps),
                "changed": list(self.changed), "accuracy": self.accuracy,
                "ranked": [{"accuracy": solution.accuracy, "keep": dict(solution.keep), "masks": solution.masks}
                           for solution in self.ranked],
                "rewind_point": self.rewind_point, "mean_gradients": self.mean_gradients, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`, its tensors moved to the model's device."""
        self.generation = int(state["generation"])
        self.keep, self.steps = dict(state["keep"]), dict(state["steps"])
        self.changed, self.accuracy = list(state["changed"]), float(state["accuracy"])
        self.ranked = [Solution(float(entry["accuracy"]), dict(entry["keep"]), _on(entry["masks"], self.device))
                       for entry in state["ranked"]]
        self.rewind_point = _on(state["rewind_point"], self.device)
        self.mean_gradients = _on(state["mean_gradients"], self.device)
        self.rng.setstate(state["rng"])

    def _iterate(self, iteration: int) -> None:
        self._retrain(iteration)
        previous, self.accuracy = self.accuracy, broadcast_object(accuracy(self.model, self.validation))
        sensitivity = self.accuracy - previous
        low, high = self.step_bounds
        for name in self.changed:
            self.steps[name] = min(max(self.steps[name] * (1.0 + sensitivity / self.config.beta), low), high)
        if sensitivity > self.config.min_accuracy_change:
            self._rank()
            self.rewind_point = copy.deepcopy(self.model.state_dict())
            chosen = self._sample_layers()
            self._set_keep(increment_keep_counts(self.layers, self.keep, self.steps, chosen, self.target_keep))
        else:
            chosen = self.changed or self._sample_layers()
            if self.rng.gauss(0.0, 1.0) > self.config.gamma:
                alpha_m = self.rng.gauss(0.0, 1.0)
                self._set_keep(mutate_keep_counts(self.layers, self.keep, self.steps, chosen, alpha_m, self.target_keep))
            else:
                self._crossover(chosen)
            self.model.load_state_dict(self.rewind_point)
        apply_masks_(self.model, self.masks)

    def _retrain(self, iteration: int) -> None:
        """One round of masked training, recording the mean weight gradients (eq. 10)."""
        sums = {name: torch.zeros_like(mask, dtype=torch.float32) for name, mask in self.masks.items()}
        steps = [0]

        def record(model: nn.Module, step: int) -> None:
            for name in sums:
                sums[name] += self.modules[name].weight.grad.float()
            steps[0] += 1

        train_epochs(self.model, self.train, self.train_config.phase(self.config.retrain_epochs, self.config.lr,
                                                                     self.seed + iteration, False),
                     masks=self.masks, step_hook=record, description="evolutionary retraining")
        self.mean_gradients = {name: total / max(steps[0], 1) for name, total in sums.items()}

    def _sample_layers(self) -> List[str]:
        """Each layer with probability 1/2, at least one (line 10)."""
        names = [layer.name for layer in self.layers]
        chosen = [name for name in names if self.rng.random() < 0.5]
        return chosen or [self.rng.choice(names)]

    def _rank(self) -> None:
        """Lines 19-22: keep the `population` best solutions seen, best first."""
        if len(self.ranked) >= self.config.population and self.accuracy <= self.ranked[-1].accuracy:
            return
        self.ranked.append(Solution(self.accuracy, dict(self.keep), _clone(self.masks)))
        self.ranked.sort(key=lambda solution: -solution.accuracy)
        del self.ranked[self.config.population:]

    def _set_keep(self, keep: KeepCounts) -> None:
        """Rebuild the masks of every layer whose kept count changed from the importance (eq. 14)."""
        changed = [name for name in keep if keep[name] != self.keep[name]]
        for name in changed:
            weight = self.modules[name].weight
            scores = importance(weight, self.mean_gradients[name].to(weight.dtype), self.config.alpha)
            self.masks[name] = importance_mask(scores, keep[name], self.config.uniform_per_channel)
        broadcast_tensors_(self.masks)  # rank 0's choice
        self.keep, self.changed = keep, changed

    def _crossover(self, chosen: Sequence[str]) -> None:
        parent = self.ranked[self.rng.randrange(len(self.ranked))]
        taken = crossover_keep_counts(self.layers, self.keep, parent.keep, chosen, self.target_keep)
        for name in taken:
            self.masks[name] = parent.masks[name].clone()
            self.keep[name] = parent.keep[name]
        self.changed = taken

    def _finish(self) -> None:
        """Out of generations: one step to the target, shared in proportion to what each layer may lose."""
        floor = {layer.name: layer.min_keep for layer in self.layers}
        self._set_keep(fit_keep_counts(self.layers, self.keep, floor, self.target_keep))
        apply_masks_(self.model, self.masks)


def _train_validation(split, device: torch.device, config: EvolutionSettings, seed: int):
    """Training and validation Batches carved from `split`'s training part (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(split.train_x.shape[0], generator=generator)
    held_out = max(1, round(config.validation_fraction * order.numel()))
    validation, train = order[:held_out], order[held_out:]
    x, y = split.train_x.to(device), split.train_y.to(device)
    return (shard_for_this_rank(Batches(x[train], y[train], config.batch_size, shuffle=True, seed=seed)),
            Batches(x[validation], y[validation], 512))


def _recorded_settings(config: EvolutionSettings, sparsity: SparsityTarget, seed: int, train: TrainConfig) -> dict:
    """What the search's recorded state depends on besides the model and data, for
    `RunState.begin`: every field of `config`, the sparsity target, seed and the retraining's
    momentum, weight decay and precision."""
    target = ({str(name): float(value) for name, value in sparsity.items()} if isinstance(sparsity, Mapping)
              else float(sparsity))
    return dict(dataclasses.asdict(config), sparsity=target, seed=int(seed), momentum=train.momentum,
                weight_decay=train.weight_decay, precision=train.precision)


def _clone(masks: Masks) -> Masks:
    return {name: mask.clone() for name, mask in masks.items()}


def _on(tensors: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {name: tensor.to(device) for name, tensor in tensors.items()}
