"""Packed weight formats as a JSON tree plus tensors, so an artefact restores them without repacking.

Repacking is slow on one CPU core (OptPrune's Algorithm 1 for `blocks`, CSR/ELL for `direct`,
per layer), more than a load may take, so every packed form
made of sparsecnn dataclasses, tuples, lists, dicts and tensors (CSR arrays, ELL, chunked CSR,
OptPrune blocks, ...) is stored; plain tensors (dense layouts) are rebuilt. Tree nodes:
{"dataclass": "module:QualName", "fields": {...}} (init fields; fields named "_..." are caches,
rebuilt on first use), {"tuple": [...]}, {"list": [...]}, {"dict": {...}} (str keys),
{"tensor": key, "perm": [...] | None, "on": "cpu" | "device"}, {"float": "nan" | "inf" | "-inf"},
{"dtype": "float16"}, {"value": str | int | float | bool | None}.

A tensor is stored contiguous in its memory order (`perm` permutes it back, so ELL's step-major
views keep their strides); "on" says whether it lived on the CPU or on the layer's device (blocks
keeps its decomposition on the CPU). Tensors seen twice are stored once and decoded as one object.
Decoding builds only dataclasses defined in sparsecnn's own modules, never arbitrary objects.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from sparsecnn.artifact.errors import ArtifactError


class Unencodable(ValueError):
    """The packed weight holds something this tree cannot express (it is then repacked on load)."""


def _permutation(tensor: torch.Tensor) -> Optional[List[int]]:
    """The dim order that makes `tensor` contiguous (None when it already is or none does)."""
    if tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim))
    return order if tensor.permute(order).is_contiguous() else None


def _is_on(place: torch.device, device: torch.device) -> bool:
    """Whether `place` is `device`, where a device without an index ("cuda") means any of its type."""
    return place.type == device.type and (device.index is None or place.index == device.index)


class _Encoder:
    def __init__(self, prefix: str, device: torch.device, tensors: Dict[str, torch.Tensor]):
        self.prefix, self.device, self.tensors = prefix, device, tensors
        self.seen: Dict[Tuple, str] = {}

    def tensor(self, tensor: torch.Tensor) -> dict:
        perm = _permutation(tensor)
        stored = tensor.detach() if perm is None else tensor.detach().permute(perm)
        identity = (stored.data_ptr(), tuple(stored.shape), tuple(stored.stride()), stored.dtype, stored.device)
        key = self.seen.get(identity)
        if key is None or stored.numel() == 0:
            key = f"{self.prefix}{len(self.tensors)}"
            self.tensors[key] = stored.contiguous()
            self.seen[identity] = key
        on = "device" if _is_on(tensor.device, self.device) else "cpu"
        if on == "cpu" and tensor.device.type != "cpu":
            raise Unencodable(f"a tensor on {tensor.device} while the layer is on {self.device}")
        return {"tensor": key, "perm": perm, "on": on}

    def node(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": repr(value)}
        if value is None or isinstance(value, (str, int, float, bool)):
            return {"value": value}
        if isinstance(value, tuple):
            return {"tuple": [self.node(item) for item in value]}
        if isinstance(value, list):
            return {"list": [self.node(item) for item in value]}
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                raise Unencodable("a dict with non-string keys")
            return {"dict": {key: self.node(item) for key, item in value.items()}}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.dataclass(value)
        raise Unencodable(f"a {type(value).__module__}.{type(value).__qualname__}")

    def dataclass(self, value: Any) -> dict:
        cls = type(value)
        if not cls.__module__.startswith("sparsecnn.") or "." in cls.__qualname__:
            raise Unencodable(f"dataclass {cls.__module__}.{cls.__qualname__} is not a top-level sparsecnn class")
        fields = {}
        for field in dataclasses.fields(value):
            if field.name.startswith("_") or not field.init:
                if field.init and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                    raise Unencodable(f"{cls.__qualname__}.{field.name} is private and has no default")
                continue
            fields[field.name] = self.node(getattr(value, field.name))
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def encode_packed(packed: Any, prefix: str, device: torch.device, tensors: Dict[str, torch.Tensor]) -> dict:
    """The tree of `packed` (a layer's packed weight on `device`); its tensors are added to `tensors`
    under keys starting with `prefix`. Raises Unencodable (leaving `tensors` as it was) for a plain
    tensor (dense layouts: cheap to rebuild) and for anything the tree cannot express (codegen's
    compiled kernels, stored as generated code instead)."""
    added: Dict[str, torch.Tensor] = {}
    if isinstance(packed, torch.Tensor):
        raise Unencodable("the packed weight is a layout of the weight itself (at most one copy to rebuild)")
    tree = _Encoder(prefix, device, added).node(packed)
    tensors.update(added)
    return tree


def _dataclass_type(name: Any) -> type:
    module_name, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not module_name.startswith("sparsecnn.") or not qualname.isidentifier():
        raise ArtifactError(f"packed weight names {name!r}: only sparsecnn dataclasses are allowed")
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as error:
        raise ArtifactError(f"packed weight names {name!r}, which this sparsecnn lacks: {error}") from error
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ArtifactError(f"packed weight names {name!r}, which is not a dataclass")
    return cls


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor], device: torch.device):
        self.tensors, self.device = tensors, device
        self.moved: Dict[Tuple[str, str], torch.Tensor] = {}

    def tensor(self, node: dict) -> torch.Tensor:
        key, perm, on = node.get("tensor"), node.get("perm"), node.get("on")
        if key not in self.tensors or on not in ("cpu", "device"):
            raise ArtifactError(f"packed weight refers to tensor {key!r} (on {on!r}), which the weights file lacks")
        if (key, on) not in self.moved:
            self.moved[(key, on)] = self.tensors[key].to(self.device if on == "device" else "cpu")
        tensor = self.moved[(key, on)]
        if perm is None:
            return tensor
        if sorted(perm) != list(range(tensor.dim())):
            raise ArtifactError(f"packed tensor {key!r} has a bad permutation {perm!r}")
        return tensor.permute([perm.index(dim) for dim in range(tensor.dim())])

    def node(self, node: Any) -> Any:
        if not isinstance(node, dict) or len(node) < 1:
            raise ArtifactError(f"packed weight tree has a malformed node {str(node)[:80]!r}")
        kind = next(iter(node))
        if kind == "tensor":
            return self.tensor(node)
        if kind == "value":
            return node["value"]
        if kind == "float":
            return float(node["float"])
        if kind == "dtype":
            dtype = getattr(torch, str(node["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ArtifactError(f"packed weight names an unknown dtype {node['dtype']!r}")
            return dtype
        if kind in ("tuple", "list") and isinstance(node[kind], list):
            items = [self.node(item) for item in node[kind]]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict" and isinstance(node["dict"], dict):
            return {key: self.node(item) for key, item in node["dict"].items()}
        if kind == "dataclass" and isinstance(node.get("fields"), dict):
            cls = _dataclass_type(node["dataclass"])
            try:
                return cls(**{name: self.node(item) for name, item in node["fields"].items()})
            except (TypeError, ValueError) as error:
                raise ArtifactError(f"packed {node['dataclass']} does not rebuild: {error}") from error
        raise ArtifactError(f"packed weight tree has a malformed node {str(node)[:80]!r}")


def decode_packed(tree: Any, tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """The packed weight of `encode_packed`'s `tree`, its device tensors on `device`; ArtifactError
    when the tree is malformed or names anything but a sparsecnn dataclass."""
    return _Decoder(tensors, device).node(tree)
