"""A small seeded training loop with masks kept: the fine-tuning step of every pruning method.

It takes any model, any re-iterable source of batches (a `torch.utils.data.DataLoader`, with or
without a length, or a list or `data.Batches`), and a loss callable `(model, batch) -> scalar
tensor`; the default, `classification_loss`, is the cross-entropy of `model(x)` against `y` for
(x, y) batches. Batches are streamed: each epoch iterates the source afresh and holds one batch at
a time. Tensors in a batch (also inside tuples, lists and dicts) are moved to the model's device.

Masks follow the pruning contract: {module path: bool tensor shaped like that module's weight},
True where the weight may be non-zero. After every optimiser step the masked weights are zeroed
again, so a pruned model stays exactly as sparse as its masks.

Run under torchrun (torch.distributed initialised, or WORLD_SIZE > 1 in the environment) the loop
trains through DistributedDataParallel: each rank iterates its own batches (a DataLoader with a
`DistributedSampler`, or `distributed.ShardedBatches`) and `loss` receives the DDP wrapper (reach
the model's own attributes through `.module`). `TrainConfig.precision` runs the forward and loss
under autocast; `TrainConfig.state` (a `resume.RunState`) makes the run restartable. Rank 0 logs
one line per epoch to the "sparsecnn.prune" logger.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.prune.distributed import init_from_env, is_distributed, is_main, wrap_ddp
from sparsecnn.prune.resume import RunState

log = logging.getLogger("sparsecnn.prune")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
Masks = Dict[str, torch.Tensor]
Batch = Tuple[torch.Tensor, torch.Tensor]
# (model, batch) -> scalar loss tensor; the batch is whatever the iterable yields, on the model's device.
Loss = Callable[[nn.Module, Any], torch.Tensor]
# model -> a score (higher is better, e.g. top-1 accuracy in percent); see `top1_evaluator`.
Evaluate = Callable[[nn.Module], float]
# Called after each optimiser step with (model, step index); e.g. ADMM's or gradual pruning's update.
StepHook = Callable[[nn.Module, int], None]
# Added to the loss before backward, e.g. ADMM's augmented-Lagrangian term.
ExtraLoss = Callable[[nn.Module], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one `train_epochs` run: SGD with `momentum` and `weight_decay`, learning rate
    `lr` decayed on a cosine over all steps when the batches have a length (constant otherwise),
    `epochs` passes over the batches, `seed` for torch's global generator (dropout and the like;
    the batch order is the iterable's own), `progress` for a tqdm bar over epochs (rank 0 only).
    `precision`: "fp32", or "bf16" / "fp16" for the forward and loss under autocast (weights and
    optimiser stay fp32; "fp16" scales the loss with a GradScaler). `state`: a `resume.RunState`
    that records every epoch and resumes a killed run (share one between a run's phases)."""

    epochs: int = 8
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    progress: bool = False
    precision: str = "fp32"
    state: Optional[RunState] = None

    def __post_init__(self):
        for name in ("epochs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"TrainConfig.{name} must be an int, got {value!r}")
        if self.epochs < 0:
            raise ValueError(f"TrainConfig.epochs must be >= 0, got {self.epochs}")
        for name in ("lr", "momentum", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"TrainConfig.{name} must be a finite number, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"TrainConfig.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if not isinstance(self.progress, bool):
            raise TypeError(f"TrainConfig.progress must be a bool, got {self.progress!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.state is not None and not isinstance(self.state, RunState):
            raise TypeError(f"TrainConfig.state must be a RunState or None, got {type(self.state).__name__}")

    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def phase(self, epochs: int, lr: float, seed: int, progress: bool) -> "TrainConfig":
        """This config for one phase of a pruning method: the phase's `epochs`, `lr`, `seed` and
        `progress`, this config's momentum, weight decay, precision and state."""
        return self.replace(epochs=epochs, lr=lr, seed=seed, progress=progress)


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of `model(x)` against `y` for a batch (x, y): x float, y int64 class indices."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def to_device(batch, device: torch.device):
    """`batch` with every tensor in it (also inside tuples, lists and dicts) moved to `device`;
    tensors already there are returned as they are, other objects unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(item, device) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def batch_count(batches: Iterable) -> Optional[int]:
    """len(batches), or None where it has none (a DataLoader over an IterableDataset without
    `__len__` has the method but raises TypeError)."""
    try:
        return len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_reiterable(batches: Iterable, what: str = "batches") -> None:
    """Raise TypeError unless `batches` can be iterated once per epoch (a DataLoader, a list, ...):
    a generator or other one-shot iterator would be empty from the second epoch on."""
    if isinstance(batches, Iterator):
        raise TypeError(f"{what} must be re-iterable (a DataLoader, a list, a Batches, ...), not a one-shot "
                        f"{type(batches).__name__}: training iterates it once per epoch")
    if not isinstance(batches, Iterable) and not hasattr(batches, "__getitem__"):
        raise TypeError(f"{what} must be an iterable of batches, got {type(batches).__name__}")


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


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


def train_epochs(model: nn.Module, batches: Iterable, config: TrainConfig, loss: Loss = classification_loss,
                 masks: Optional[Masks] = None, extra_loss: Optional[ExtraLoss] = None,
                 step_hook: Optional[StepHook] = None, description: str = "train",
                 extra_state: Optional[Any] = None) -> float:
    """Train `model` with SGD as `config` says (a `TrainConfig`) for `config.epochs` passes over
    `batches`, minimising `loss(model, batch)` (+ `extra_loss(model)` when given).

    batches: re-iterable (each epoch iterates it afresh), streamed one batch at a time, never
    collected; the cosine learning-rate schedule needs its `len()` and is left out without one.
    `masks` are re-applied after every step (and once before the first); a resumed run updates
    the dict in place. extra_state: an object with state_dict()/load_state_dict() that
    `config.state` saves and restores with the rest (ADMM's Z, U and rho). Returns the mean loss of
    the last epoch over every rank (nan for 0 epochs).
    """
    from tqdm.auto import tqdm

    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_reiterable(batches)
    torch.manual_seed(config.seed)
    model.train()
    apply_masks_(model, masks)
    device = _device(model)
    init_from_env(device)
    loop = _Loop(model, batches, config, device)
    parts = dict(model=model, optimiser=loop.optimiser, schedule=loop.schedule, scaler=loop.scaler,
                 batches=batches if hasattr(batches, "state_dict") else None, extra=extra_state)
    phase = None if config.state is None else config.state.begin(description)
    resumed = None if phase is None else config.state.resume(phase, parts, masks)
    start, step, last_loss = (0, 0, float("nan")) if resumed is None else (resumed["epoch"], resumed["step"],
                                                                          resumed["loss"])
    if start >= config.epochs:
        return last_loss
    trained = wrap_ddp(model)
    for epoch in tqdm(range(start, config.epochs), desc=description, disable=not (config.progress and is_main()),
                      leave=False, initial=start, total=config.epochs):
        began = time.perf_counter()
        _set_epoch(batches, epoch)
        loss_sum, count = 0.0, 0
        for batch in batches:
            value = loop.step(trained, to_device(batch, device), loss, extra_loss)
            apply_masks_(model, masks)
            if step_hook is not None:
                step_hook(model, step)
            step += 1
            loss_sum += value
            count += 1
            batch = None  # let this batch go before the iterable makes the next one
        last_loss = _global_mean(loss_sum, count, device)
        if is_main():
            log.info("%s: epoch %d/%d, loss %.4f, lr %.3g, %.1f s", description, epoch + 1, config.epochs,
                     last_loss, loop.optimiser.param_groups[0]["lr"], time.perf_counter() - began)
        if phase is not None:
            config.state.save(phase, epoch + 1, epoch + 1 == config.epochs, step, last_loss, parts, masks, device)
    return last_loss


class _Loop:
    """The optimiser, cosine schedule (None without `len(batches)`) and gradient scaler of one
    `train_epochs` call, and its step."""

    def __init__(self, model: nn.Module, batches: Iterable, config: TrainConfig, device: torch.device):
        self.optimiser = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                         weight_decay=config.weight_decay)
        steps_per_epoch = batch_count(batches)
        total = None if steps_per_epoch is None else config.epochs * steps_per_epoch
        self.schedule = None if total is None else torch.optim.lr_scheduler.CosineAnnealingLR(self.optimiser,
                                                                                               max(total, 1))
        self.autocast_dtype = PRECISIONS[config.precision]
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None

    def step(self, model: nn.Module, batch, loss: Loss, extra_loss: Optional[ExtraLoss]) -> float:
        """One optimiser step on `batch` (already on the device); returns the loss as a float."""
        autocast = contextlib.nullcontext() if self.autocast_dtype is None else \
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
        with autocast:
            value = loss(model, batch)
            if extra_loss is not None:
                value = value + extra_loss(getattr(model, "module", model))
        self.optimiser.zero_grad(set_to_none=True)
        if self.scaler is None:
            value.backward()
            self.optimiser.step()
        else:
            self.scaler.scale(value).backward()
            self.scaler.step(self.optimiser)
            self.scaler.update()
        if self.schedule is not None:
            self.schedule.step()
        return value.item()


def _set_epoch(batches: Iterable, epoch: int) -> None:
    """Tell a DataLoader's `DistributedSampler` (or any sampler with `set_epoch`) the epoch, so that
    its shuffle differs between epochs and is the same on a resumed run."""
    sampler = getattr(batches, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def _global_mean(total: float, count: int, device: torch.device) -> float:
    """total / count summed over every rank (nan when no rank saw a batch)."""
    if is_distributed():
        import torch.distributed as dist

        pair = torch.tensor([total, float(count)], dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(pair)
        total, count = pair.tolist()
    return total / count if count else float("nan")


@torch.no_grad()
def accuracy(model: nn.Module, batches: Iterable[Batch]) -> float:
    """Top-1 accuracy in percent of `model` (eval mode) over (x, y) `batches`."""
    model.eval()
    device = _device(model)
    correct = total = 0
    for batch in batches:
        x, y = to_device(batch, device)
        correct += (model(x).argmax(dim=1) == y).sum().item()
        total += y.numel()
        batch = x = y = None
    if total == 0:
        raise ValueError("accuracy needs at least one sample")
    return 100.0 * correct / total


def top1_evaluator(batches: Iterable[Batch]) -> Evaluate:
    """An `Evaluate` callback: the top-1 accuracy in percent over the (x, y) `batches` (re-iterable,
    e.g. a validation DataLoader), the default for classification."""
    check_reiterable(batches)
    return lambda model: accuracy(model, batches)


def mean_gradients(model: nn.Module, batches: Iterable, names: Iterable[str],
                   loss: Loss = classification_loss) -> Dict[str, torch.Tensor]:
    """Mean over `batches` of d(loss)/d(weight) for each module in `names`."""
    modules = dict(model.named_modules())
    names = list(names)
    sums = {name: torch.zeros_like(modules[name].weight) for name in names}
    count = 0
    model.eval()
    device = _device(model)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss(model, to_device(batch, device)).backward()
        for name in names:
            sums[name] += modules[name].weight.grad
        count += 1
        batch = None
    model.zero_grad(set_to_none=True)
    return {name: total / max(count, 1) for name, total in sums.items()}
