"""Re-pruning into a structure in rounds of rising sparsity, shared by `reprune-tiles --steps` and
`reprune-select --unit-shapes ... --steps`.

Round i of n prunes every layer by magnitude to `gradual.polynomial_sparsity(i, n, its target)`
(the cubic schedule: the target exactly at round n), lets `restructure` re-prune the masks into
the structure at that kept count, and trains `epochs // n` epochs with those masks. Why: one-shot
re-pruning of a 90%-pruned alexnet-cifar into 16x16 units lost 1.39 points against magnitude at
equal epochs, three rounds 0.37 (docs/accuracy.md).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.gradual import polynomial_sparsity
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.registry import get_method
from sparsecnn.prune.splits import training_batches
from sparsecnn.prune.targets import SparsityTarget, layer_sparsities
from sparsecnn.prune.training import TrainConfig, apply_masks_, train_epochs

# (model, magnitude masks at this round's sparsity) -> the masks re-pruned into the structure;
# it may change the model's weights in place (the masks are applied after it in any case).
Restructure = Callable[[nn.Module, Masks], Masks]


def check_steps(steps, name: str = "steps") -> int:
    """`steps` if it is an int >= 1, else ValueError naming it as `name`."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name} must be an int >= 1, got {steps!r}")
    return steps


def prune_in_rounds(model: nn.Module, split, sparsity: SparsityTarget, steps: int, epochs: int,
                    restructure: Restructure, *, seed: int, progress: bool, batch_size: int, lr: float,
                    train: Optional[TrainConfig], description: str) -> Masks:
    """`steps` rounds (module docstring) on `model` in place, `epochs` in all; returns the last
    round's masks (rank 0's on every rank). Round i's training is described as
    f"{description} round {i}/{steps}"."""
    targets = layer_sparsities(model, sparsity)
    batches = training_batches(model, split, batch_size, seed)
    masks: Masks = {}
    for step in range(1, check_steps(steps) + 1):
        at_step = {name: polynomial_sparsity(step, steps, target) for name, target in targets.items()}
        masks = get_method("magnitude")(model, split, at_step, seed=seed, progress=progress, epochs=0,
                                        batch_size=batch_size, lr=lr, train=train)
        masks = broadcast_tensors_(restructure(model, masks))  # rank 0's re-pruning decisions
        apply_masks_(model, masks)
        train_epochs(model, batches, (train or TrainConfig()).phase(epochs // steps, lr, seed, progress), masks=masks,
                     description=f"{description} round {step}/{steps}")
    return masks
