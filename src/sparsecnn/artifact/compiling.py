"""`compile_model`: tune a pruned model for one input shape and write it as an artefact directory.

Layer decisions in the manifest ("layers", in call order, then the layers the example input never
reached): {"backend", "config" (dict or null), "activation", "channels_last_output" (bool: an NCHW
output handed on in channels_last), "spec" (the ConvSpec tuned for, null
when unreached), "choice", "time_ms", "dense_ms", "times_ms" (median ms per candidate benchmarked;
null where not measured), "packed" (the packed weight's tree, see `packing`, or null),
"packed_note" (why not stored: rebuilt on load)}. Linear decisions ("linears"): {module path of each
`SplitKLinear`: splits}. Projection shortcuts tuning folded ("shortcuts"): [[conv, shortcut conv],
...], both stored as convs of their own and folded again on load.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import pickle
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from sparsecnn import __version__
from sparsecnn.artifact.codegen_files import (
    CODEGEN_DIR,
    current_toolchain,
    generates_code,
    record_kernels,
)
from sparsecnn.artifact.errors import ArtifactError
from sparsecnn.artifact.manifest import (
    FORMAT,
    VERSION,
    list_files,
    new_directory,
    publish,
    write_manifest,
)
from sparsecnn.artifact.packing import Unencodable, encode_packed
from sparsecnn.artifact.tensors import (
    WEIGHTS_FORMATS,
    default_weights_format,
    read_tensors,
    write_tensors,
)
from sparsecnn.backends import config_to_dict
from sparsecnn.models import build_model
from sparsecnn.nn import SparseConv2d, SplitKLinear
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.passes.shortcut import fold_shortcut, unfold_shortcut
from sparsecnn.prune import load_pruned
from sparsecnn.tuning import LayerResult, Timer, environment_fingerprint
from sparsecnn.tuning.sparsify import autotune_model

SPEC_FIELDS = ("N", "C", "K", "H", "W", "R", "S", "stride", "padding", "dilation", "groups")
PACKED_PREFIX = "packed/"  # tensor names of packed weights; state-dict keys never hold a "/"
_PRUNED_FORMAT = "sparsecnn-pruned"

def _finite(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else float(value)


def _resolve_model(model: str | nn.Module, model_name: Optional[str],
                   num_classes: Optional[int]) -> Tuple[str, nn.Module]:
    if isinstance(model, str):
        if model_name not in (None, model):
            raise ValueError(f"model_name={model_name!r} contradicts model={model!r}")
        return model, build_model(model, num_classes)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a registered model name or an nn.Module, got {type(model).__name__}")
    if not isinstance(model_name, str):
        raise ValueError("model_name= must name the registered architecture of the nn.Module given "
                         "(sparsecnn.load rebuilds it with sparsecnn.models.build_model)")
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in build_model(model_name, num_classes).state_dict().items()}
    found = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    if found != expected:
        differing = sorted(key for key in set(found) | set(expected) if found.get(key) != expected.get(key))
        raise ValueError(f"the model given is not build_model({model_name!r}, num_classes={num_classes}) (differs in "
                         f"{', '.join(differing[:4])}): sparsecnn.load could not rebuild it")
    return model_name, model


def _read_checkpoint(path: Path) -> Any:
    if path.suffix == ".safetensors":
        return read_tensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"checkpoint {path}: refused to load, it holds objects other than tensors and plain "
                         f"containers (weights_only=True): {error}") from error


def load_checkpoint(checkpoint, model: nn.Module, model_name: str) -> Optional[Dict[str, torch.Tensor]]:
    """Load `checkpoint` into `model` in place; returns its masks (None: the weights' non-zeros).

    checkpoint: None (keep the model's weights), a `prune.save_pruned` file (weights and masks), or
    a state dict saved with torch.save or safetensors (its zeros are the pattern)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    payload = _read_checkpoint(path)
    if isinstance(payload, dict) and payload.get("format") == _PRUNED_FORMAT:
        if payload.get("model_name") != model_name:
            raise ValueError(f"checkpoint {path} holds a {payload.get('model_name')!r} model, not {model_name!r}")
        return load_pruned(path, model)[1]
    if not isinstance(payload, dict) or not all(isinstance(v, torch.Tensor) for v in payload.values()):
        raise ValueError(f"checkpoint {path} is neither a sparsecnn pruned checkpoint nor a state dict of tensors")
    try:
        model.load_state_dict(payload)
    except RuntimeError as error:
        raise ValueError(f"checkpoint {path} does not fit model {model_name!r}: {error}") from error
    return None


def _input_shape(input_shape: Sequence[int]) -> List[int]:
    shape = list(input_shape) if isinstance(input_shape, (tuple, list)) else None
    if not shape or len(shape) < 3 or not all(isinstance(v, int) and v > 0 for v in shape):
        raise ValueError(f"input_shape must be (N, C, H, W) (or (N, C, L)) of positive ints, got {input_shape!r}")
    return shape


def _layer_entry(name: str, layer: SparseConv2d, result: Optional[LayerResult], device: torch.device,
                 tensors: Dict[str, torch.Tensor], directory: Path) -> dict:
    entry = {"backend": layer.backend, "config": config_to_dict(layer.config), "activation": layer.activation,
             "channels_last_output": layer.channels_last_output, "spec": None, "choice": None, "time_ms": None,
             "dense_ms": None, "times_ms": {}, "packed": None,
             "packed_note": "not reached by the example input: packed on first use"}
    if result is None:
        return entry
    entry.update(spec={field: getattr(result.spec, field) for field in SPEC_FIELDS}, choice=result.choice,
                 time_ms=_finite(result.time_ms), dense_ms=_finite(result.dense_ms),
                 times_ms={label: _finite(ms) for label, ms in result.times_ms.items()}, packed_note=None)
    if generates_code(layer):
        record_kernels(layer, result.spec, directory)
        entry["packed_note"] = f"kernels in {CODEGEN_DIR}/"
        return entry
    try:
        with torch.no_grad():
            entry["packed"] = encode_packed(layer.packed_weight(), f"{PACKED_PREFIX}{name}/", device, tensors)
    except Unencodable as why:
        entry["packed_note"] = f"repacked on load: {why}"
    return entry


def _state_tensors(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    """The state dict's tensors; its only other entries may be SparseConv2d and SplitKLinear extra states
    (decisions, stored in the manifest)."""
    decisions = {f"{name}._extra_state" for name, module in gm.named_modules()
                 if isinstance(module, (SparseConv2d, SplitKLinear))}
    tensors = {}
    for key, value in gm.state_dict().items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif key not in decisions:
            raise ArtifactError(f"state dict entry {key!r} is a {type(value).__name__}: only tensors and "
                                "SparseConv2d / SplitKLinear decisions can be stored")
    return tensors


def _write(gm: fx.GraphModule, directory: Path, header: dict, device: torch.device, weights_format: str) -> None:
    report = gm.sparsecnn_report
    results = {result.name: result for result in report.layers}
    layers = {name: module for name, module in gm.named_modules() if isinstance(module, SparseConv2d)}
    order = [*results, *(name for name in layers if name not in results)]
    tensors = _state_tensors(gm)
    entries = {name: _layer_entry(name, layers[name], results.get(name), device, tensors, directory)
               for name in order}
    weights = WEIGHTS_FORMATS[weights_format]
    write_tensors(directory / weights, tensors)
    codegen = any(generates_code(layer) for layer in layers.values())
    linears = {name: module.splits for name, module in gm.named_modules() if isinstance(module, SplitKLinear)}
    write_manifest(directory, {
        **header, "environment": environment_fingerprint(device),
        "codegen_toolchain": current_toolchain() if codegen else None,
        "fuse": dataclasses.asdict(gm.fuse_report),
        "tuning": {"max_rel_error": _finite(report.max_rel_error), "unreached": list(report.unreached)},
        "layers": entries, "linears": linears, "weights": weights, "files": list_files(directory)})


def _folded_shortcuts(gm: fx.GraphModule) -> List[List[str]]:
    """The (conv, shortcut conv) pairs tuning folded (`passes.shortcut`)."""
    check = gm.sparsecnn_report.model_check
    return [list(pair) for pair in check.shortcuts] if check is not None else []


def compile_model(model: str | nn.Module, checkpoint=None, input_shape: Sequence[int] = (), dtype: str = "fp32",
                  backends: Optional[List[str]] = None, out_dir=None, *, model_name: Optional[str] = None,
                  num_classes: Optional[int] = None, device=None, cache_dir=None, retune: bool = False,
                  progress: Optional[bool] = None, timer: Optional[Timer] = None,
                  weights_format: Optional[str] = None, seed: int = 0, run_mode: str = "graph") -> fx.GraphModule:
    """Tune `model` for inputs of `input_shape` and write the artefact directory `out_dir`.

    model: a registered name (`sparsecnn.models.build_model(name, num_classes)`) or an nn.Module of
    that architecture with `model_name=` naming it; checkpoint: see `load_checkpoint`. The model is
    simplified (`prepare_for_inference`: BatchNorm folded, ReLU/residual fused) and tuned
    (`autotune_model`) on `device` (default: CUDA when available) with a seeded random input of
    `input_shape` at precision policy `dtype`, over `backends` (None: the autotuner's default set;
    the dense ones always run) and the tuning cache `cache_dir` (retune, progress, timer, run_mode:
    as there; run_mode is kept in the manifest for re-tuning elsewhere).

    The artefact holds `manifest.json` (see `manifest`; decisions per layer, see this module),
    the tensors (`weights.safetensors` if the safetensors package is importable, else `weights.pt`;
    `weights_format` "safetensors" / "pt" forces one): the state dict (masked weights, masks,
    biases, the other layers' parameters) and the packed sparse formats, and `codegen/` with the
    kernels of `codegen` layers. It is written into a temporary directory beside `out_dir` and
    renamed onto it (an older artefact there is replaced). A module given is put in eval mode and
    moved to `device`. Returns the tuned model, with its `TuneReport` as `sparsecnn_report`.
    """
    weights_format = weights_format or default_weights_format()
    if weights_format not in WEIGHTS_FORMATS:
        raise ValueError(f"weights_format must be one of {', '.join(WEIGHTS_FORMATS)}, got {weights_format!r}")
    if out_dir is None:
        raise ValueError("out_dir must name the artefact directory to write")
    shape = _input_shape(input_shape)
    name, module = _resolve_model(model, model_name, num_classes)
    masks = load_checkpoint(checkpoint, module, name)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    module = module.eval().to(device)
    example = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
    gm = prepare_for_inference(module, masks, example_inputs=example[:1])
    gm.sparsecnn_report = autotune_model(gm, example, backends=backends, dtype=dtype, cache_dir=cache_dir,
                                         retune=retune, progress=progress, timer=timer, run_mode=run_mode)
    header = {"format": FORMAT, "version": VERSION, "sparsecnn": __version__,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": {"name": name, "num_classes": num_classes, "input_shape": shape},
              "policy": gm.sparsecnn_report.policy, "run_mode": run_mode, "backends": backends,
              "device": device.type}
    out_dir = Path(out_dir)
    temporary = new_directory(out_dir)
    shortcuts = _folded_shortcuts(gm)
    for name, shortcut_name in shortcuts:  # stored as two convs at their own paths; load folds them again
        unfold_shortcut(gm, name, shortcut_name)
    try:
        _write(gm, temporary, {**header, "shortcuts": shortcuts}, device, weights_format)
        publish(temporary, out_dir)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        for name, shortcut_name in shortcuts:
            fold_shortcut(gm, name, shortcut_name)
    return gm
