"""Datasets on disk in torchvision's formats, read without torchvision: image folders and CIFAR-10.

`ImageFolder(root)`: root/<class>/<image> (class index = position of the class folder in sorted
order), decoded with Pillow one image at a time, so a DataLoader streams them. `load_cifar10`:
the python version of CIFAR-10 as torchvision downloads it (cifar-10-batches-py/data_batch_1..5
and test_batch), 60000 uint8 images of 3x32x32, held in memory as uint8 (180 MB).

Both give float32 (C, H, W) images scaled to [0, 1], resized (bilinear) to the model's (H, W) and
then normalised per channel with mean 0.5 and std 0.25, and int64 labels.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")
CIFAR10_FOLDER = "cifar-10-batches-py"


def normalise(images: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """uint8 images (N, C, H0, W0) -> float32 (N, C, *size): [0, 1], resized, then (x - 0.5) / 0.25."""
    images = images.float() / 255.0
    if tuple(images.shape[-2:]) != tuple(size):
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    return (images - 0.5) / 0.25


class ImageFolder(torch.utils.data.Dataset):
    """Images under root/<class>/ (any depth below the class folder), as (image, label): image
    float32 (C, H, W) for `input_shape` = (C, H, W) with C 1 (grey) or 3 (RGB), label int64."""

    def __init__(self, root: str | Path, input_shape: Tuple[int, int, int], what: str = "imagefolder"):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{what}: {self.root} is not a directory")
        if input_shape[0] not in (1, 3):
            raise ValueError(f"{what}: models with {input_shape[0]} input channels need 1 or 3")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples: List[Tuple[Path, int]] = [
            (path, label) for label, name in enumerate(self.classes)
            for path in sorted((self.root / name).rglob("*")) if path.suffix.lower() in IMAGE_SUFFIXES]
        if not self.samples:
            raise ValueError(f"{what}: no images ({', '.join(IMAGE_SUFFIXES)}) in class folders under {self.root}")
        self.input_shape = tuple(input_shape)
        self._pil = _pillow(what)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        path, label = self.samples[index]
        with self._pil.open(path) as image:
            array = np.asarray(image.convert("L" if self.input_shape[0] == 1 else "RGB"), dtype=np.uint8)
        pixels = torch.from_numpy(array.copy()).reshape(array.shape[0], array.shape[1], -1).permute(2, 0, 1)
        return normalise(pixels.unsqueeze(0), self.input_shape[1:])[0], torch.tensor(label, dtype=torch.int64)


def _pillow(what: str):
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError(f"{what} needs Pillow to decode images: pip install 'sparsecnn[data]' "
                          f"(or pip install pillow)") from error
    return Image


def image_folder_splits(root: str | Path, input_shape: Tuple[int, int, int], what: str = "imagefolder"):
    """(train, validation) `ImageFolder`s of root/train and root/val (or root/test) when root has
    them, else (ImageFolder(root), None)."""
    root = Path(root)
    validation = next((root / name for name in ("val", "test") if (root / name).is_dir()), None)
    if (root / "train").is_dir() and validation is not None:
        return ImageFolder(root / "train", input_shape, what), ImageFolder(validation, input_shape, what)
    return ImageFolder(root, input_shape, what), None


def load_cifar10(root: str | Path, input_shape: Tuple[int, int, int] = (3, 32, 32), what: str = "cifar10"):
    """(train, test) `Cifar10` datasets of CIFAR-10 under `root` (the folder holding
    cifar-10-batches-py, or that folder), for a model taking `input_shape` = (3, H, W)."""
    folder = Path(root)
    if (folder / CIFAR10_FOLDER).is_dir():
        folder = folder / CIFAR10_FOLDER
    names = [f"data_batch_{i}" for i in range(1, 6)]
    missing = [name for name in names + ["test_batch"] if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{what}: {folder} lacks {', '.join(missing)} (torchvision's CIFAR-10 python "
                                f"format: {CIFAR10_FOLDER}/data_batch_1..5, test_batch)")
    if input_shape[0] != 3:
        raise ValueError(f"{what}: CIFAR-10 images have 3 channels, the model takes {input_shape[0]}")
    train = Cifar10(*_cifar_batches([folder / name for name in names], what), input_shape[1:])
    return train, Cifar10(*_cifar_batches([folder / "test_batch"], what), input_shape[1:])


class Cifar10(torch.utils.data.Dataset):
    """uint8 images (N, 3, 32, 32) and labels (N,) held in memory; items are (float32 (3, H, W)
    normalised and resized to `size`, int64 label)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: Tuple[int, int]):
        self.images, self.labels, self.size = images, labels, tuple(size)

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return normalise(self.images[index:index + 1], self.size)[0], self.labels[index]


def _cifar_batches(paths: List[Path], what: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenated uint8 images (N, 3, 32, 32) and int64 labels (N,) of CIFAR-10 pickle files."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as file:
            try:
                batch = pickle.load(file, encoding="bytes")  # torchvision's own reader does the same
            except (pickle.UnpicklingError, EOFError) as error:
                raise ValueError(f"{what}: {path} is not a CIFAR-10 batch file: {error}") from error
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"{what}: {path} holds data of shape {data.shape}, expected (N, 3072)")
        images.append(torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()))
        labels.append(torch.tensor(batch[b"labels"], dtype=torch.int64))
    return torch.cat(images), torch.cat(labels)
