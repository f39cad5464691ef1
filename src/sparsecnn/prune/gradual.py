"""Gradual magnitude pruning (Zhu & Gupta, 2017): sparsity rises on a cubic schedule during training.

Every `prune_every` steps of the pruning phase each layer's mask is recomputed as the magnitude mask
at s_t = s_f + (s_i - s_f) (1 - t / n)^3 (t steps done out of n): fast early, while many redundant
weights remain, and slow near the target. Masked weights stay at zero between updates. The phase
ends at exactly s_f; a fine-tuning phase with the masks fixed follows.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.magnitude import Masks, _check_sparsity, magnitude_mask
from sparsecnn.prune.targets import SparsityTarget, layer_sparsities
from sparsecnn.prune.training import (
    Loss,
    TrainConfig,
    batch_count,
    classification_loss,
    train_epochs,
)


def polynomial_sparsity(step: int, total_steps: int, final_sparsity: float,
                        initial_sparsity: float = 0.0, exponent: float = 3.0) -> float:
    """s_f + (s_i - s_f) (1 - step / total_steps)^exponent, with step clamped to [0, total_steps]:
    s_i at step 0, s_f from `total_steps` on, monotone in between."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    final, initial = _check_sparsity(final_sparsity), _check_sparsity(initial_sparsity)
    remaining = (1.0 - min(max(step, 0), total_steps) / total_steps) ** exponent
    # The same value written as a convex combination, so both endpoints come out exactly.
    return remaining * initial + (1.0 - remaining) * final


@torch.no_grad()
def _remask_(weights: Dict[str, torch.Tensor], masks: Masks, sparsities: Dict[str, float]) -> None:
    """Masks at `sparsities` from rank 0's weights (broadcast), applied to `weights` in place."""
    for name, weight in weights.items():
        masks[name] = magnitude_mask(weight, sparsities[name])
    broadcast_tensors_(masks)
    for name, weight in weights.items():
        weight.mul_(masks[name])


def gradual_prune_(model: nn.Module, batches: Iterable, sparsity: SparsityTarget, *,
                   prune_epochs: int = 8, finetune_epochs: int = 6, prune_every: int = 10,
                   initial_sparsity: float = 0.0, lr: float = 0.01, finetune_lr: float = 0.01,
                   seed: int = 0, progress: bool = False, loss: Loss = classification_loss,
                   train: Optional[TrainConfig] = None) -> Masks:
    """Prune the trained `model` in place on the cubic schedule, then fine-tune with masks fixed.

    batches: sized, re-iterable training batches (a list, `data.Batches`, a DataLoader), each one
    passed to `loss(model, batch)` (default: cross-entropy of (x, y)). sparsity: fraction of zero
    weights, one float for the default layers (`targets.pruned_layers`) or {module path: fraction};
    every layer starts at `initial_sparsity` (capped at its target) and reaches its target after
    `prune_epochs` passes, re-masked every `prune_every` optimiser steps. Returns {module path: bool
    mask}; each layer keeps exactly round((1 - s) * numel) weights. train: settings of both phases
    besides their epochs, learning rate and seed (momentum, weight decay, precision, run state).
    """
    train = TrainConfig() if train is None else train
    prune = train.phase(prune_epochs, lr, seed, progress)
    finetune = train.phase(finetune_epochs, finetune_lr, seed + 1, progress)
    return gradual_phases_(model, batches, sparsity, prune, finetune, loss=loss, prune_every=prune_every,
                           initial_sparsity=initial_sparsity)[0]


def gradual_phases_(model: nn.Module, batches: Iterable, sparsity: SparsityTarget, prune: TrainConfig,
                    finetune: TrainConfig, *, loss: Loss = classification_loss, prune_every: int = 10,
                    initial_sparsity: float = 0.0) -> Tuple[Masks, float]:
    """`gradual_prune_` with each phase's training settings as a `TrainConfig` (`prune.epochs`
    passes of pruning on the schedule, then `finetune`); returns (masks, mean loss of the last
    fine-tuning epoch, nan without one)."""
    steps_per_epoch = batch_count(batches)
    if steps_per_epoch is None:
        raise TypeError("batches must have a length: the schedule is laid out over prune_epochs passes")
    if prune_every < 1:
        raise ValueError(f"prune_every must be >= 1, got {prune_every}")
    targets = layer_sparsities(model, sparsity)
    modules = dict(model.named_modules())
    weights = {name: modules[name].weight for name in targets}
    total_steps = max(prune.epochs * steps_per_epoch, 1)

    def at_step(done: int) -> Dict[str, float]:
        return {name: polynomial_sparsity(done, total_steps, target, min(initial_sparsity, target))
                for name, target in targets.items()}

    masks: Masks = {}
    _remask_(weights, masks, at_step(0))

    def remask_on_schedule(_model: nn.Module, step: int) -> None:
        done = step + 1
        if done % prune_every == 0 or done == total_steps:
            _remask_(weights, masks, at_step(done))

    train_epochs(model, batches, prune, loss, masks=masks, step_hook=remask_on_schedule, description="gradual")
    _remask_(weights, masks, at_step(total_steps))
    last_loss = train_epochs(model, batches, finetune, loss, masks=masks, description="gradual fine-tune")
    return masks, last_loss
