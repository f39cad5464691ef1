"""A small seeded training loop with masks kept: the fine-tuning step of every pruning method.

Masks follow the pruning contract: {module path: bool tensor shaped like that module's weight},
True where the weight may be non-zero. After every optimiser step the masked weights are zeroed
again, so a pruned model stays exactly as sparse as its masks.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Masks = Dict[str, torch.Tensor]
Batch = Tuple[torch.Tensor, torch.Tensor]
# Called after each optimiser step with (model, step index); e.g. ADMM's or gradual pruning's update.
StepHook = Callable[[nn.Module, int], None]
# Added to the cross-entropy loss before backward, e.g. ADMM's augmented-Lagrangian term.
ExtraLoss = Callable[[nn.Module], torch.Tensor]


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: Optional[Masks]) -> None:
    """Zero every weight outside its mask, in place."""
    if not masks:
        return
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        if name not in modules:
            raise KeyError(f"mask for {name!r} but the model has no such module")
        weight = modules[name].weight
        if mask.shape != weight.shape:
            raise ValueError(f"mask for {name!r} has shape {tuple(mask.shape)}, weight {tuple(weight.shape)}")
        weight.mul_(mask.to(weight.device))


def train_epochs(model: nn.Module, batches: Iterable[Batch], epochs: int, lr: float = 0.01,
                 masks: Optional[Masks] = None, seed: int = 0, weight_decay: float = 0.0,
                 extra_loss: Optional[ExtraLoss] = None, step_hook: Optional[StepHook] = None,
                 progress: bool = False, description: str = "train") -> float:
    """Train `model` with SGD (momentum 0.9, cosine learning rate) for `epochs` over `batches`
    ((x, y) pairs: x a float tensor on the model's device, y int64 class indices).

    `masks` are re-applied after every step (and once before the first). Returns the mean loss of
    the last epoch.
    """
    from tqdm.auto import tqdm

    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    torch.manual_seed(seed)
    model.train()
    apply_masks_(model, masks)
    optimiser = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    steps_per_epoch = len(batches) if hasattr(batches, "__len__") else None
    total = None if steps_per_epoch is None else epochs * steps_per_epoch
    schedule = None if total is None else torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, max(total, 1))
    step, last_loss = 0, float("nan")
    for _ in tqdm(range(epochs), desc=description, disable=not progress, leave=False):
        losses = []
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            if schedule is not None:
                schedule.step()
            apply_masks_(model, masks)
            if step_hook is not None:
                step_hook(model, step)
            step += 1
            losses.append(loss.item())
        last_loss = sum(losses) / max(len(losses), 1)
    return last_loss


@torch.no_grad()
def accuracy(model: nn.Module, batches: Iterable[Batch]) -> float:
    """Top-1 accuracy in percent of `model` (eval mode) over `batches`."""
    model.eval()
    correct = total = 0
    for x, y in batches:
        correct += (model(x).argmax(dim=1) == y).sum().item()
        total += y.numel()
    if total == 0:
        raise ValueError("accuracy needs at least one sample")
    return 100.0 * correct / total


def mean_gradients(model: nn.Module, batches: Iterable[Batch], names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Mean over `batches` of d(cross-entropy)/d(weight) for each module in `names`."""
    modules = dict(model.named_modules())
    names = list(names)
    sums = {name: torch.zeros_like(modules[name].weight) for name in names}
    count = 0
    model.eval()
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        for name in names:
            sums[name] += modules[name].weight.grad
        count += 1
    model.zero_grad(set_to_none=True)
    return {name: total / max(count, 1) for name, total in sums.items()}
