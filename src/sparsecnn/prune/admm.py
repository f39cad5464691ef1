"""ADMM non-structured pruning (Zhang et al., ECCV 2018), OptPrune's initial pruning step (paper 000).

Pruning is min loss(W) subject to W_l in S_l = {at most k_l non-zeros}. ADMM splits it with a copy
Z_l in S_l and scaled duals U_l:
  W-step: SGD on loss(W) + sum_l rho/2 ||W_l - Z_l + U_l||^2 for one epoch;
  Z-step: Z_l = projection of W_l + U_l onto S_l (keep the k_l largest magnitudes);
  U-step: U_l += W_l - Z_l.
rho is multiplied by `rho_growth` after every ADMM epoch: a smaller rho first lets the weights
follow the loss, a larger one at the end pulls W onto its sparse copy, so the hard pruning that
follows removes weights that are already near zero. Then W is magnitude-pruned to exactly k_l
non-zeros and fine-tuned with its mask fixed.

Scale of rho: the penalty is a plain sum of squares next to a batch-mean cross-entropy, and under
SGD each step moves W towards Z - U by about lr * rho of the gap. The defaults (lr 0.01, rho 1.0
growing 1.2x per epoch, 12 epochs) bring W onto its sparse copy on digits: for lenet5 at 95%, the
weights outside the top-k shrink to a negligible share of ||W||, and hard pruning costs no
accuracy.
In a distributed run rank 0 makes every Z-step and U-step and broadcasts Z, U and the masks.
The paper's rho ~1e-3 goes with Adam, which rescales gradients; with SGD it leaves W unchanged.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.magnitude import Masks, magnitude_mask
from sparsecnn.prune.targets import SparsityTarget, layer_sparsities
from sparsecnn.prune.training import (
    Loss,
    TrainConfig,
    apply_masks_,
    batch_count,
    classification_loss,
    train_epochs,
)


def project_onto_sparsity(tensor: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Euclidean projection of `tensor` onto the tensors with at most k = round((1 - sparsity) * numel)
    non-zeros: the k largest magnitudes keep their values, every other entry becomes 0.

    Exactly k positions are kept; among equal magnitudes the lower flat index wins. Same shape,
    dtype and device as `tensor`.
    """
    keep = magnitude_mask(tensor, sparsity)
    return torch.where(keep, tensor.detach(), torch.zeros((), dtype=tensor.dtype, device=tensor.device))


class _AdmmState:
    """Z, U and rho of every pruned layer, and the augmented-Lagrangian term they define."""

    def __init__(self, weights: Dict[str, torch.Tensor], targets: Dict[str, float], rho: float):
        self.weights, self.targets, self.rho = weights, targets, rho
        self.z = {name: project_onto_sparsity(w, targets[name]) for name, w in weights.items()}
        self.u = {name: torch.zeros_like(w) for name, w in weights.items()}
        broadcast_tensors_(self.z)

    def penalty(self, _model: nn.Module) -> torch.Tensor:
        return self.rho / 2 * sum(((w - self.z[name] + self.u[name]) ** 2).sum()
                                  for name, w in self.weights.items())

    @torch.no_grad()
    def update(self, rho_growth: float) -> None:
        for name, w in self.weights.items():
            self.z[name] = project_onto_sparsity(w + self.u[name], self.targets[name])
            self.u[name] += w - self.z[name]
        broadcast_tensors_(self.z)
        broadcast_tensors_(self.u)
        self.rho *= rho_growth

    def state_dict(self) -> dict:
        """{"z", "u": {module path: tensor}, "rho": float}, for `resume.RunState`."""
        return {"z": dict(self.z), "u": dict(self.u), "rho": self.rho}

    def load_state_dict(self, state: dict) -> None:
        for name in self.weights:
            self.z[name] = state["z"][name].to(self.z[name].device)
            self.u[name] = state["u"][name].to(self.u[name].device)
        self.rho = float(state["rho"])


def admm_prune_(model: nn.Module, batches: Iterable, sparsity: SparsityTarget, *,
                admm_epochs: int = 12, finetune_epochs: int = 6, lr: float = 0.01,
                finetune_lr: float = 0.01, rho: float = 1.0, rho_growth: float = 1.2,
                seed: int = 0, progress: bool = False, loss: Loss = classification_loss,
                train: Optional[TrainConfig] = None) -> Masks:
    """Prune the trained `model` in place by ADMM, then fine-tune it with the masks fixed.

    batches: sized, re-iterable training batches (a list, `data.Batches`, a DataLoader), each one
    passed to `loss(model, batch)` (default: cross-entropy of (x, y)); one ADMM epoch is one pass. sparsity: fraction of zero weights, one float for the default
    layers (`targets.pruned_layers`) or {module path: fraction}. rho starts at `rho` and is
    multiplied by `rho_growth` after each of the `admm_epochs` epochs. Learning rates are SGD's
    (momentum 0.9, cosine decay within each phase). Returns {module path: bool mask}; each layer keeps
    exactly round((1 - s) * numel) weights. train: settings of both phases besides their epochs,
    learning rate and seed (momentum, weight decay, precision, run state); default `TrainConfig()`.
    """
    train = TrainConfig() if train is None else train
    if batch_count(batches) is None:
        raise TypeError("batches must have a length: ADMM updates Z and U once per pass over them")
    if rho <= 0 or rho_growth < 1:
        raise ValueError(f"need rho > 0 and rho_growth >= 1, got rho={rho!r}, rho_growth={rho_growth!r}")
    targets = layer_sparsities(model, sparsity)
    modules = dict(model.named_modules())
    state = _AdmmState({name: modules[name].weight for name in targets}, targets, rho)
    steps_per_epoch = len(batches)

    def end_of_epoch(_model: nn.Module, step: int) -> None:
        if (step + 1) % steps_per_epoch == 0:
            state.update(rho_growth)

    train_epochs(model, batches, train.phase(admm_epochs, lr, seed, progress), loss,
                 extra_loss=state.penalty, step_hook=end_of_epoch, description="admm", extra_state=state)
    masks = broadcast_tensors_({name: magnitude_mask(modules[name].weight, target)
                                for name, target in targets.items()})
    apply_masks_(model, masks)
    train_epochs(model, batches, train.phase(finetune_epochs, finetune_lr, seed + 1, progress),
                 loss, masks=masks, description="admm fine-tune")
    return masks
