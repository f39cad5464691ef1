"""Training and scoring on a digits-like split (train_x, train_y, test_x, test_y tensors): what the
split-taking pruning methods share."""
from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from sparsecnn.data import Batches
from sparsecnn.prune.distributed import shard_for_this_rank
from sparsecnn.prune.training import TrainConfig, accuracy, train_epochs


def training_batches(model: nn.Module, split, batch_size: int = 64, seed: int = 0) -> Iterable:
    """Shuffled, seeded mini-batches of `batch_size` samples of the split's training part on
    `model`'s device (a `Batches`); in a distributed run, this rank's part of each of them."""
    device = next(model.parameters()).device
    batches = Batches(split.train_x.to(device), split.train_y.to(device), batch_size, shuffle=True, seed=seed)
    return shard_for_this_rank(batches)


def train_dense_(model: nn.Module, split, epochs: int = 8, lr: float = 0.02, seed: int = 0,
                 batch_size: int = 64, progress: bool = False, train: Optional[TrainConfig] = None) -> None:
    """Train `model` on the split's training part without masks (the dense starting point);
    `train` supplies the settings besides epochs, lr and seed (precision, run state, ...)."""
    train = TrainConfig() if train is None else train
    train_epochs(model, training_batches(model, split, batch_size, seed),
                 train.phase(epochs, lr, seed, progress), description="dense")


def top1_accuracy(model: nn.Module, split, batch_size: int = 512) -> float:
    """Top-1 accuracy in percent on the split's test part."""
    device = next(model.parameters()).device
    return accuracy(model, Batches(split.test_x.to(device), split.test_y.to(device), batch_size))
