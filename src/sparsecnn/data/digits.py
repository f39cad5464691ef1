"""scikit-learn's `load_digits` (1797 real 8x8 handwritten digits, shipped with the package).

Images are resized (bilinear) to the model's input size and repeated over its channels, then
standardised with the training split's mean and std. The split is stratified and seeded.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class DigitsSplit:
    """train_x (n, C, H, W) float32, train_y (n,) int64, and the same for the test split."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def to(self, device) -> "DigitsSplit":
        return DigitsSplit(*(t.to(device) for t in dataclasses.astuple(self)))


def load_digits_split(input_shape: Tuple[int, int, int] = (1, 28, 28), test_fraction: float = 0.2,
                      seed: int = 0) -> DigitsSplit:
    """Digits resized to `input_shape` = (C, H, W); `test_fraction` of each class held out."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError("the digits data needs scikit-learn: pip install 'sparsecnn[data]'") from error
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    channels, height, width = input_shape
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(height, width), mode="bilinear", align_corners=False)
    images = images.expand(-1, channels, -1, -1).contiguous()
    labels = torch.tensor(digits.target, dtype=torch.int64)
    test = _stratified_test_mask(labels, test_fraction, seed)
    mean, std = images[~test].mean(), images[~test].std()
    images = (images - mean) / std
    return DigitsSplit(images[~test], labels[~test], images[test], labels[test])


def _stratified_test_mask(labels: torch.Tensor, test_fraction: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    test = torch.zeros(labels.numel(), dtype=torch.bool)
    for label in labels.unique():
        members = (labels == label).nonzero().squeeze(1)
        order = members[torch.randperm(members.numel(), generator=generator)]
        test[order[: round(test_fraction * members.numel())]] = True
    return test


class Batches:
    """Iterate (x, y) mini-batches of `batch_size`; shuffled with its own seeded generator when
    `shuffle`, so two runs with one seed see the same order."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool = False,
                 seed: Optional[int] = 0):
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.batch_size, self.shuffle = x, y, batch_size, shuffle
        self.generator = torch.Generator().manual_seed(0 if seed is None else seed)

    def __len__(self) -> int:
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        n = self.x.shape[0]
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        order = order.to(self.x.device)
        for start in range(0, n, self.batch_size):
            index = order[start:start + self.batch_size]
            yield self.x[index], self.y[index]

    def state_dict(self) -> dict:
        """{"generator": uint8 tensor}: the shuffling generator's state, so that a resumed run
        draws the same batch orders as an uninterrupted one."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`."""
        self.generator.set_state(state["generator"])
