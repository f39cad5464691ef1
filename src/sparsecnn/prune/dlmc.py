"""Real ResNet-50 pruning masks from the Deep Learning Matrix Collection (DLMC).

Data layout (see `shared/data/dlmc-rn50/README.md`): one `METHOD-SPARSITY.npz` per set,
one `numpy.packbits` array per layer keyed by the torchvision `resnet50` module name,
flattened in PyTorch weight layout; `index.json` gives each layer's shape, nnz and DLMC
source name, and the source names of layers missing from a set.
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np
import torch
from torch import nn

import sparsecnn.settings as settings

PathLike = Union[str, os.PathLike]
Masks = Dict[str, torch.Tensor]

_SEARCH_NAMES = (Path("shared/data/dlmc-rn50"), Path(".carry/dlmc-rn50"))


def _is_dlmc_dir(path: Path) -> bool:
    return (path / "index.json").is_file()


def dlmc_root(root: Optional[PathLike] = None) -> Path:
    """Directory holding the DLMC ResNet-50 masks (`index.json` and `*.npz`).

    Order: `root` if given, else `$SPARSECNN_DLMC`, else the first `shared/data/dlmc-rn50`
    or `.carry/dlmc-rn50` found in the current directory, the package directory, or any
    of their ancestors. Raises FileNotFoundError listing where it looked.
    """
    explicit = root if root is not None else settings.dlmc_dir()
    if explicit:
        path = Path(explicit).expanduser()
        if _is_dlmc_dir(path):
            return path
        source = "root argument" if root is not None else f"${settings.DLMC.name}"
        raise FileNotFoundError(f"no DLMC data (index.json) in {path} (from {source})")
    starts = (Path.cwd().resolve(), Path(__file__).resolve().parent)
    for start in starts:
        for ancestor in (start, *start.parents):
            for name in _SEARCH_NAMES:
                if _is_dlmc_dir(ancestor / name):
                    return ancestor / name
    raise FileNotFoundError(
        f"DLMC ResNet-50 masks not found: ${settings.DLMC.name} is unset and no "
        f"{' or '.join(map(str, _SEARCH_NAMES))} with an index.json exists in "
        f"{' or '.join(map(str, starts))} or any of their ancestors"
    )


@functools.lru_cache(maxsize=None)
def _read_index(root: Path) -> dict:
    with open(root / "index.json") as f:
        return json.load(f)


def _index(root: Optional[PathLike]) -> dict:
    return _read_index(dlmc_root(root).resolve())


def dlmc_sets(root: Optional[PathLike] = None) -> List[str]:
    """Names of the available sets, e.g. "magnitude_pruning-0.9", sorted."""
    return sorted(key[: -len(".npz")] for key in _index(root))


def _set_entry(pattern: str, root: Optional[PathLike]) -> dict:
    """index.json entry of set `pattern` ("magnitude_pruning-0.9", optionally with a
    "dlmc-" prefix or ".npz" suffix); ValueError listing the sets if unknown."""
    name = pattern.removeprefix("dlmc-").removesuffix(".npz")
    index = _index(root)
    if f"{name}.npz" not in index:
        raise ValueError(f"unknown DLMC set {pattern!r}; available: {', '.join(dlmc_sets(root))}")
    return index[f"{name}.npz"]


def _set_file(pattern: str, root: Optional[PathLike]) -> Path:
    name = pattern.removeprefix("dlmc-").removesuffix(".npz")
    return dlmc_root(root) / f"{name}.npz"


def _all_layers(root: Optional[PathLike]) -> Dict[str, dict]:
    """{torchvision name: {"shape", "source", ...}} over every set, in index order."""
    layers: Dict[str, dict] = {}
    for entry in _index(root).values():
        for name, info in entry["layers"].items():
            layers.setdefault(name, info)
    return layers


def _missing_layers(pattern: str, root: Optional[PathLike]) -> List[str]:
    """Torchvision names of the layers that set `pattern` lacks."""
    missing = set(_set_entry(pattern, root)["missing"])
    return [name for name, info in _all_layers(root).items() if info["source"] in missing]


def _unpack(packed: np.ndarray, shape: List[int]) -> torch.Tensor:
    """uint8 packbits array -> torch.bool tensor of `shape`."""
    bits = np.unpackbits(packed, count=math.prod(shape))
    return torch.from_numpy(bits.reshape(shape).astype(bool))


def load_dlmc_masks(pattern: str, root: Optional[PathLike] = None) -> Masks:
    """All masks of one set: {torchvision module name: bool tensor of the weight's shape}
    (convs (K, C, R, S), `fc` (1000, 2048)); layers missing from the set are absent."""
    layers = _set_entry(pattern, root)["layers"]
    with np.load(_set_file(pattern, root)) as packed:
        return {name: _unpack(packed[name], info["shape"]) for name, info in layers.items()}


def dlmc_layer_mask(pattern: str, layer_name: str, root: Optional[PathLike] = None) -> torch.Tensor:
    """Mask of one layer of one set (bool, weight shape); ValueError if the set lacks it."""
    layers = _set_entry(pattern, root)["layers"]
    if layer_name not in layers:
        raise ValueError(
            f"DLMC set {pattern!r} has no layer {layer_name!r}; it has: {', '.join(layers)}"
        )
    with np.load(_set_file(pattern, root)) as packed:
        return _unpack(packed[layer_name], layers[layer_name]["shape"])


def _layer_generator(seed: int, layer_name: str) -> torch.Generator:
    """CPU generator seeded from (seed, layer_name): the same pair always draws the same values.

    The pair is hashed to 32 bits because the CPU generator (mt19937) uses only those.
    """
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer_name}".encode()))


@torch.no_grad()
def apply_dlmc_(
    model: nn.Module,
    pattern: str,
    seed: int = 0,
    root: Optional[PathLike] = None,
    include_fc: bool = False,
) -> Masks:
    """Give a torchvision-named ResNet-50 the sparsity pattern of DLMC set `pattern`.

    Each conv weight (and `fc` with `include_fc=True`) becomes N(0, 2 / fan_in) values
    where the mask is set and exact 0 elsewhere; each layer's values come from its own
    generator (`_layer_generator(seed, name)`), so they do not depend on which other
    layers are applied. Layers the set lacks stay as they are (a warning names them).
    Returns {module name: bool mask} of the layers changed. Raises ValueError, before
    changing anything, if the model lacks a layer or a weight's shape differs from its mask.
    """
    masks = load_dlmc_masks(pattern, root)
    if not include_fc:
        masks.pop("fc", None)
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        if name not in modules:
            raise ValueError(f"model has no module {name!r} (expects torchvision resnet50 names)")
        shape = tuple(modules[name].weight.shape)
        if shape != tuple(mask.shape):
            raise ValueError(
                f"layer {name!r}: weight shape {shape} != DLMC mask shape {tuple(mask.shape)}"
            )
    skipped = [name for name in _missing_layers(pattern, root) if include_fc or name != "fc"]
    if skipped:
        warnings.warn(f"DLMC set {pattern!r} lacks {', '.join(skipped)}; left dense", stacklevel=2)
    applied = {}
    for name, mask in masks.items():
        weight = modules[name].weight
        std = math.sqrt(2.0 / weight[0].numel())
        values = torch.randn(weight.shape, generator=_layer_generator(seed, name)) * std
        weight.copy_(values * mask)
        applied[name] = mask.to(weight.device)
    return applied
