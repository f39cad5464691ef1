"""What `sparsecnn prune` prunes and on what: MODEL and --data parsed, models built, DataLoaders made.

MODEL: a zoo name (`models.MODEL_NAMES`), the path of a `save_pruned` checkpoint (the run starts
from its weights and masks), or "torchvision:NAME" (a torchvision classification model, untrained,
where torchvision is installed). --data: "digits" (scikit-learn, in memory), "imagefolder:PATH"
(PATH/<class>/<image>, or PATH/train and PATH/val with such folders) or "cifar10:PATH"
(torchvision's on-disk CIFAR-10, python version). Errors name the argument at fault.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn

from sparsecnn.models import MODEL_NAMES, build_model, default_input_shape
from sparsecnn.prune.distributed import rank, world_size

DATA_KINDS = ("digits", "imagefolder", "cifar10")
TORCHVISION = "torchvision:"
TORCHVISION_INPUT = (3, 224, 224)


@dataclasses.dataclass(frozen=True)
class DataSource:
    """A parsed --data: `kind` one of DATA_KINDS, `path` the folder (None for digits)."""

    kind: str
    path: Optional[Path] = None


def parse_data_source(text: str) -> DataSource:
    """"digits", "imagefolder:PATH" or "cifar10:PATH" (~ expanded) -> DataSource; ValueError naming
    --data for anything else (unknown kind, missing or non-directory PATH)."""
    if not isinstance(text, str):
        raise TypeError(f"--data must be a string, got {type(text).__name__}")
    kind, colon, path = text.partition(":")
    if kind not in DATA_KINDS:
        raise ValueError(f"--data: unknown source {kind!r}; expected digits, imagefolder:PATH or cifar10:PATH")
    if kind == "digits":
        if colon:
            raise ValueError(f"--data digits takes no path, got {text!r}")
        return DataSource("digits")
    if not path:
        raise ValueError(f"--data {kind} needs a folder: {kind}:PATH")
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"--data {kind}:{path}: no such directory")
    return DataSource(kind, Path(path).expanduser())


def model_spec(text: str) -> Tuple[str, Optional[Path]]:
    """MODEL -> (model name, checkpoint path or None); ValueError naming MODEL when it is neither a
    zoo name, "torchvision:NAME" nor an existing file."""
    if text.startswith(TORCHVISION):
        if not text[len(TORCHVISION):]:
            raise ValueError("MODEL torchvision:NAME needs a NAME, e.g. torchvision:resnet18")
        return text, None
    if text in MODEL_NAMES:
        return text, None
    if Path(text).is_file():
        from sparsecnn.prune.checkpoint import pruned_model_name

        return pruned_model_name(text), Path(text)
    raise ValueError(f"MODEL {text!r} is not a zoo model ({', '.join(MODEL_NAMES)}), a checkpoint file or "
                     f"torchvision:NAME")


def input_shape(name: str, source: DataSource) -> Tuple[int, int, int]:
    """(C, H, W) the model `name` is fed: the zoo's own, (3, 32, 32) for torchvision models on
    CIFAR-10, else (3, 224, 224)."""
    if not name.startswith(TORCHVISION):
        return tuple(default_input_shape(name))
    return (3, 32, 32) if source.kind == "cifar10" else TORCHVISION_INPUT


def build(name: str, num_classes: int) -> nn.Module:
    """A fresh model: zoo `name`, or "torchvision:NAME" through torchvision.models.get_model."""
    if not name.startswith(TORCHVISION):
        return build_model(name, num_classes)
    try:
        import torchvision
    except ImportError as error:
        raise ValueError(f"MODEL {name}: torchvision is not installed here (pip install torchvision)") from error
    try:
        return torchvision.models.get_model(name[len(TORCHVISION):], weights=None, num_classes=num_classes)
    except ValueError as error:
        raise ValueError(f"MODEL {name}: {error}") from error


def datasets(source: DataSource, shape: Tuple[int, int, int], seed: int):
    """(train, validation, number of classes) map-style datasets of an imagefolder or cifar10
    source; an image folder without train/val subfolders gives a seeded 10% of it to validation."""
    from sparsecnn.data import image_folder_splits, load_cifar10

    what = f"--data {source.kind}:{source.path}"
    if source.kind == "cifar10":
        train, validation = load_cifar10(source.path, shape, what)
        return train, validation, 10
    train, validation = image_folder_splits(source.path, shape, what)
    classes = len(train.classes)
    if validation is None:
        held_out = max(1, len(train) // 10)
        if held_out >= len(train):
            raise ValueError(f"{what}: {len(train)} image(s) is too few to hold out a validation part")
        generator = torch.Generator().manual_seed(seed)
        train, validation = torch.utils.data.random_split(train, [len(train) - held_out, held_out], generator)
    return train, validation, classes


def loaders(train, validation, batch_size: int, seed: int, workers: int):
    """(training DataLoader, validation DataLoader). `batch_size` is the global batch: each of the
    world's ranks loads batch_size / world samples of it through a seeded `DistributedSampler`
    (also in a single process, so that a resumed run sees the same orders); ValueError when the
    world does not divide it."""
    world = world_size()
    if batch_size < 1 or batch_size % world:
        raise ValueError(f"--batch-size {batch_size} must be a positive multiple of the {world} process(es)")
    sampler = torch.utils.data.DistributedSampler(train, num_replicas=world, rank=rank(), shuffle=True, seed=seed,
                                                  drop_last=True)
    train_loader = torch.utils.data.DataLoader(train, batch_size // world, sampler=sampler, num_workers=workers,
                                               drop_last=True)
    return train_loader, torch.utils.data.DataLoader(validation, 256, num_workers=workers)


def calibration_inputs(batches, count: int = 256) -> torch.Tensor:
    """The first `count` inputs x of (x, y) `batches`, concatenated: float32 (<= count, C, H, W)."""
    taken, total = [], 0
    for x, _ in batches:
        taken.append(x[: count - total])
        total += taken[-1].shape[0]
        if total >= count:
            break
    return torch.cat(taken)
