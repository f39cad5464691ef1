"""Registry of pruning methods: name -> function that prunes a trained model and fine-tunes it.

A method is called as `fn(model, split, sparsity, seed=0, progress=False, **options)`:
model: a trained dense `nn.Module`, pruned and fine-tuned in place; split: a `DigitsSplit`-like
object (train_x, train_y used; the test part is never touched) on any device (moved to the
model's); sparsity: one float for `pruned_layers(model)` or {module path: fraction}. Options are
the method's own; the built-in ones take `epochs` (None: the tuned default; an int: the length of
each of its training phases, what `sparsecnn prune --finetune-epochs` sets) and `batch_size`.
It returns {module path: bool mask} and leaves every weight outside its mask at exactly zero.
Adding one: `register_method("name", fn)` (`registry`, below every method: the re-pruning methods
look up "magnitude" there at call time). The digits-split helpers they share are in `splits`.

`prune_and_finetune` is the entry for any model, any re-iterable batches (a
`torch.utils.data.DataLoader`) and any loss `(model, batch) -> tensor`; the digits "magnitude"
method is one call of it, "gradual" shares its loop (`gradual.gradual_phases_`). "admm" takes a
`loss` through `admm_prune_`; "evolutionary", "reprune", "reprune-tiles" and "reprune-select" still take a digits split.
Every built-in method takes `train`, a `TrainConfig` whose momentum, weight decay, precision and
run state apply to all its phases. In a distributed run `training_batches` gives each rank its
share of every batch, and masks are decided on rank 0 and broadcast.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

from torch import nn

from sparsecnn.prune.admm import admm_prune_
from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.evolutionary import evolutionary_prune_
from sparsecnn.prune.gradual import gradual_phases_, gradual_prune_
from sparsecnn.prune.magnitude import Masks, magnitude_mask
from sparsecnn.prune.registry import PruneMethod, get_method, method_names, register_method
from sparsecnn.prune.reprune import reprune_method
from sparsecnn.prune.selection import reprune_select_method
from sparsecnn.prune.splits import top1_accuracy, train_dense_, training_batches
from sparsecnn.prune.targets import SparsityTarget, layer_sparsities, pruned_layers
from sparsecnn.prune.tiles import reprune_tiles_method
from sparsecnn.prune.training import (
    Evaluate,
    Loss,
    TrainConfig,
    apply_masks_,
    check_reiterable,
    classification_loss,
    train_epochs,
)

def prune_with(method: str, model: nn.Module, split, sparsity: SparsityTarget, seed: int = 0,
               progress: bool = False, **options) -> Masks:
    """Run registered `method` on `model` (see the module docstring for the arguments)."""
    fn = get_method(method)
    layer_sparsities(model, sparsity)  # bad targets fail here, before any training
    return fn(model, split, sparsity, seed=seed, progress=progress, **options)


def _phase(epochs: Optional[int], default: int) -> int:
    return default if epochs is None else epochs


def magnitude_method(model: nn.Module, split, sparsity: SparsityTarget, seed: int = 0, progress: bool = False,
                     epochs: Optional[int] = None, batch_size: int = 64, lr: float = 0.01,
                     train: Optional[TrainConfig] = None) -> Masks:
    """One-shot magnitude pruning of each layer to its target, then `epochs` (default 8) of masked
    fine-tuning."""
    train = (TrainConfig() if train is None else train).phase(_phase(epochs, 8), lr, seed, progress)
    return prune_and_finetune(model, sparsity, training_batches(model, split, batch_size, seed), train=train)[0]


def gradual_method(model: nn.Module, split, sparsity: SparsityTarget, seed: int = 0, progress: bool = False,
                   epochs: Optional[int] = None, batch_size: int = 64, **options) -> Masks:
    """`gradual_prune_`: `epochs` sets both its pruning and fine-tuning phases; other options pass on."""
    if epochs is not None:
        options.update(prune_epochs=epochs, finetune_epochs=epochs)
    return gradual_prune_(model, training_batches(model, split, batch_size, seed), sparsity, seed=seed,
                          progress=progress, **options)


def admm_method(model: nn.Module, split, sparsity: SparsityTarget, seed: int = 0, progress: bool = False,
                epochs: Optional[int] = None, batch_size: int = 64, **options) -> Masks:
    """`admm_prune_`: `epochs` sets both its ADMM and fine-tuning phases; other options pass on."""
    if epochs is not None:
        options.update(admm_epochs=epochs, finetune_epochs=epochs)
    return admm_prune_(model, training_batches(model, split, batch_size, seed), sparsity, seed=seed,
                       progress=progress, **options)


FINETUNE_METHODS = ("magnitude", "gradual")


def prune_and_finetune(model: nn.Module, sparsity: SparsityTarget, batches: Iterable, *, method: str = "magnitude",
                       loss: Loss = classification_loss, train: TrainConfig = TrainConfig(),
                       evaluate: Optional[Evaluate] = None, **options) -> Tuple[Masks, dict]:
    """Prune `model` in place to `sparsity` and fine-tune it on `batches` with `loss`.

    model: any trained `nn.Module` (its device is the training device). sparsity: one float for
    `targets.pruned_layers(model)` (every conv and linear layer but the last) or {module path:
    fraction}. batches: re-iterable, e.g. a `torch.utils.data.DataLoader` (without a length too,
    for "magnitude"), streamed batch by batch each epoch; tensors in a batch are moved to the
    model's device. loss: `(model, batch) -> scalar tensor`; the default is the cross-entropy of
    `model(x)` against `y` for (x, y) batches. train: the SGD settings (`TrainConfig`).
    evaluate: `model -> float` (e.g. `top1_evaluator(validation_loader)`), called before and after.

    method "magnitude": one-shot magnitude masks, then `train.epochs` of masked fine-tuning.
    method "gradual": `gradual_prune_`'s cubic schedule over `prune_epochs` (option; default
    `train.epochs`) passes of `train`, re-masking every `prune_every` (option, 10) steps from
    `initial_sparsity` (option, 0), then `train.epochs` of fine-tuning with seed `train.seed + 1`;
    it needs `len(batches)`. Under torchrun each rank passes its own share of the batches (a
    DataLoader with a `DistributedSampler`); the masks are rank 0's, broadcast.

    Returns (masks {module path: bool tensor}, report {"method", "sparsity": {module path:
    measured fraction of zeros}, "loss": mean loss of the last fine-tuning epoch (nan for 0
    epochs), and with `evaluate` "metric_before" and "metric"}). Every layer keeps exactly
    round((1 - s) * numel) weights.
    """
    if method not in FINETUNE_METHODS:
        raise ValueError(f"prune_and_finetune: unknown method {method!r}; expected one of {', '.join(FINETUNE_METHODS)}")
    if not isinstance(train, TrainConfig):
        raise TypeError(f"train must be a TrainConfig, got {type(train).__name__}")
    allowed = {"magnitude": set(), "gradual": {"prune_epochs", "prune_every", "initial_sparsity"}}[method]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"prune_and_finetune: method {method!r} takes no option {', '.join(map(repr, unknown))}"
                        + (f"; its options are {', '.join(sorted(allowed))}" if allowed else ""))
    targets = layer_sparsities(model, sparsity)  # bad targets fail here, before any training
    check_reiterable(batches)
    report: dict = {"method": method}
    if evaluate is not None:
        report["metric_before"] = float(evaluate(model))
    if method == "magnitude":
        modules = dict(model.named_modules())
        masks = broadcast_tensors_({name: magnitude_mask(modules[name].weight, target)
                                    for name, target in targets.items()})
        apply_masks_(model, masks)
        report["loss"] = train_epochs(model, batches, train, loss, masks=masks, description="magnitude fine-tune")
    else:
        prune = train.replace(epochs=options.pop("prune_epochs", train.epochs))
        masks, report["loss"] = gradual_phases_(model, batches, sparsity, prune, train.replace(seed=train.seed + 1),
                                                loss=loss, **options)
    modules = dict(model.named_modules())
    report["sparsity"] = {name: 1.0 - modules[name].weight.count_nonzero().item() / modules[name].weight.numel()
                          for name in masks}
    if evaluate is not None:
        report["metric"] = float(evaluate(model))
    return masks, report


register_method("magnitude", magnitude_method)
register_method("gradual", gradual_method)
register_method("admm", admm_method)
register_method("evolutionary", evolutionary_prune_)
register_method("reprune", reprune_method)
register_method("reprune-tiles", reprune_tiles_method)
register_method("reprune-select", reprune_select_method)

__all__ = ["PruneMethod", "get_method", "method_names", "prune_and_finetune", "prune_with", "pruned_layers",
           "register_method", "top1_accuracy", "train_dense_", "training_batches"]
