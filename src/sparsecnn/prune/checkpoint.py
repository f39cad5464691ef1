"""Pruned-model checkpoints: weights, masks and a report in one file that loads without unpickling code.

The file is `torch.save` of a plain dict {"format", "version", "model_name", "state_dict", "masks",
"report", "blocks"} holding only tensors, strings, numbers, lists and dicts, and it is read back with
`torch.load(weights_only=True)`, which refuses any other pickled object. To run a loaded model
sparsely:

    model, masks, report = load_pruned("lenet5-admm.pt")
    sparsecnn.sparsify_(model, x, backend="auto", masks=masks)   # masks of non-conv layers are ignored

"blocks": {module path: [[rows, cols], ...]}, the dense blocks a re-pruning chose for a layer's
mask (`backends.blocks.extraction.provide_blocks`, e.g. `reprune-tiles`' tiles); loading hands them
to backend `blocks` again, so `sparsify_` and artefacts run them as they are.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Optional, Tuple

import torch
from torch import nn

from sparsecnn.backends.blocks.extraction import provide_blocks, provided_blocks
from sparsecnn.models import build_model
from sparsecnn.prune.distributed import is_main
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.resume import atomic_save
from sparsecnn.prune.training import apply_masks_

FORMAT = "sparsecnn-pruned"
VERSION = 1
PathLike = str | os.PathLike


def save_pruned(path: PathLike, model_name: str, model: nn.Module, masks: Masks, report: dict,
                num_classes: Optional[int] = None) -> None:
    """Write `model`'s state dict (on CPU), its `masks` ({module path: bool tensor}) and `report`
    (JSON-serialisable dict: accuracies, sparsities, method, options) to `path`, atomically (a
    temporary file, then `os.replace`). `num_classes`: the model's outputs where they are not its
    dataset's default, so that `load_pruned` builds it alike. Called on every rank of a distributed run, only rank 0 writes."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict, got {type(report).__name__}")
    try:
        json.dumps(report)
    except (TypeError, ValueError) as error:
        raise TypeError(f"report must hold only JSON values (str, numbers, bool, None, lists, dicts): {error}") from error
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        if name not in modules or tuple(mask.shape) != tuple(modules[name].weight.shape):
            raise ValueError(f"masks[{name!r}] does not match a weight of the model")
    if not is_main():
        return
    atomic_save({
        "format": FORMAT,
        "version": VERSION,
        "model_name": model_name,
        "num_classes": num_classes,
        "state_dict": {key: value.detach().cpu() for key, value in model.state_dict().items()},
        "masks": {name: mask.detach().to("cpu", torch.bool) for name, mask in masks.items()},
        "report": report,
        "blocks": _provided(masks),
    }, path)


def _provided(masks: Masks) -> dict:
    """{module path: [[rows, cols], ...]} of the masks with provided blocks."""
    found = {name: provided_blocks(mask.detach().to("cpu", torch.bool)) for name, mask in masks.items()
             if mask.dim() == 4}
    return {name: [[list(rows), list(cols)] for rows, cols in blocks] for name, blocks in found.items()
            if blocks is not None}


def pruned_model_name(path: PathLike) -> str:
    """The model name a `save_pruned` file records (a zoo name, or e.g. "torchvision:resnet18")."""
    return _read(path)["model_name"]


def _read(path: PathLike) -> dict:
    """The checkpoint's payload dict, checked (ValueError otherwise)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path}: refused to load, it holds objects other than tensors and plain "
                         f"containers (weights_only=True): {error}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a sparsecnn pruned-model checkpoint")
    if payload.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint version {payload.get('version')!r}, expected {VERSION}")
    return payload


def load_pruned(path: PathLike, model: Optional[nn.Module] = None) -> Tuple[nn.Module, Masks, dict]:
    """Read a `save_pruned` file: (model, masks, report).

    model: loaded into in place when given (its device is kept and the masks are moved there);
    otherwise `build_model(model_name)` on CPU. The masks are re-applied, so every weight outside
    its mask is exactly zero, and the file's dense blocks are handed to backend `blocks`
    (`provide_blocks`). Raises ValueError for a file that is not such a checkpoint or that holds
    pickled objects other than tensors and plain containers.
    """
    payload = _read(path)
    if model is None:
        model = build_model(payload["model_name"], payload.get("num_classes"))
    try:
        model.load_state_dict(payload["state_dict"])
    except RuntimeError as error:
        raise ValueError(f"{path} holds a {payload['model_name']!r} model whose weights do not fit the "
                         f"model given: {error}") from error
    device = next(model.parameters()).device
    masks = {name: mask.to(device) for name, mask in payload["masks"].items()}
    apply_masks_(model, masks)
    for name, blocks in payload.get("blocks", {}).items():
        provide_blocks(payload["masks"][name], blocks)
    return model, masks, payload["report"]
