"""`load`: restore a compiled artefact as a ready-to-run model, re-tuning only where it must.

Nothing is unpickled: the manifest is JSON, the tensors are safetensors or a weights-only torch
file, packed formats are rebuilt from JSON and tensors as sparsecnn dataclasses only, and the
codegen files are bytes copied into the codegen cache.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch import fx

from sparsecnn.artifact.codegen_files import current_toolchain, install_codegen
from sparsecnn.artifact.compiling import PACKED_PREFIX
from sparsecnn.artifact.errors import ArtifactError
from sparsecnn.artifact.manifest import MANIFEST, read_manifest, verify_files
from sparsecnn.artifact.packing import decode_packed
from sparsecnn.artifact.tensors import read_tensors
from sparsecnn.core.spec import ConvSpec
from sparsecnn.models import build_skeleton
from sparsecnn.nn import SparseConv2d, SplitKLinear
from sparsecnn.nn.graphed import enable_cuda_graphs
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.passes.shortcut import fold_shortcut, shortcut_pairs
from sparsecnn.tuning import (
    LayerResult,
    PhaseClock,
    Timer,
    TuneReport,
    environment_fingerprint,
)
from sparsecnn.tuning.fingerprint import describe_difference
from sparsecnn.tuning.sparsify import autotune_model

_LOAD_SEED = 0


def _device(device, manifest: dict) -> torch.device:
    """`device`, else where the artefact was tuned when that device type is present here, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if manifest["device"] == "cuda" and torch.cuda.is_available() else "cpu")


def _sparse_layers(gm: fx.GraphModule) -> Dict[str, SparseConv2d]:
    return {name: module for name, module in gm.named_modules() if isinstance(module, SparseConv2d)}


def _skeleton(manifest: dict, path: Path) -> fx.GraphModule:
    """The model's inference graph with uninitialised CPU tensors (`build_skeleton`), checked against
    the recorded fusion."""
    model = manifest["model"]
    try:
        built = build_skeleton(model["name"], model.get("num_classes"))
        gm = prepare_for_inference(built, example_inputs=torch.zeros(1, *model["input_shape"][1:]))
    except ValueError as error:
        raise ArtifactError(f"{path}: cannot rebuild model {model['name']!r}: {error}") from error
    fuse = gm.fuse_report
    if dataclasses.asdict(fuse) != manifest["fuse"]:
        raise ArtifactError(f"{path}: model {model['name']!r} no longer simplifies as it did when compiled "
                            f"(now {fuse.summary()}): compile the artefact again")
    return gm


def _load_state(gm: fx.GraphModule, manifest: dict, tensors: Dict[str, torch.Tensor], path: Path) -> None:
    """Weights, masks, biases and the other parameters from `tensors`; each conv's backend, config,
    activation and output layout and each linear's splits from the manifest."""
    state = {key: value for key, value in tensors.items() if not key.startswith(PACKED_PREFIX)}
    for name in _sparse_layers(gm):
        entry = manifest["layers"].get(name)
        if not isinstance(entry, dict):
            raise ArtifactError(f"{path}: no decision for conv layer {name!r}")
        state[f"{name}._extra_state"] = {key: entry.get(key)
                                         for key in ("backend", "config", "activation", "channels_last_output")}
    for name, module in gm.named_modules():
        if isinstance(module, SplitKLinear):
            if name not in manifest["linears"]:
                raise ArtifactError(f"{path}: no decision for linear layer {name!r}")
            state[f"{name}._extra_state"] = {"splits": manifest["linears"][name]}
    try:
        gm.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, ValueError, TypeError, KeyError) as error:
        raise ArtifactError(f"{path}: the stored weights or decisions do not fit model "
                            f"{manifest['model']['name']!r}: {error}") from error
    stored = set(gm.state_dict())  # strict loading assigned all of these; the skeleton's values remain elsewhere
    left = [name for name, _ in gm.named_buffers() if name not in stored]
    if left:
        raise ArtifactError(f"{path}: non-persistent buffers {', '.join(left[:5])} cannot be restored from the "
                            "weights file")


def _environment_change(manifest: dict, device: torch.device) -> Optional[str]:
    """Why the recorded decisions do not hold on `device` (None: they do)."""
    reasons = []
    recorded = manifest["environment"]
    if recorded != environment_fingerprint(device):
        reasons.append(describe_difference(recorded, environment_fingerprint(device)))
    toolchain = manifest.get("codegen_toolchain")
    if toolchain is not None and current_toolchain() != toolchain:
        reasons.append(f"codegen toolchain: {toolchain!r} -> {current_toolchain()!r}")
    return "; ".join(reasons) or None


def _layer_input(layer: SparseConv2d, spec: ConvSpec, device: torch.device) -> torch.Tensor:
    shape = (spec.N, spec.C, spec.W) if layer.conv_dims == 1 else (spec.N, spec.C, spec.H, spec.W)
    return torch.empty(shape, dtype=layer.weight.dtype, device=device)


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _restore(gm: fx.GraphModule, manifest: dict, tensors: Dict[str, torch.Tensor], device: torch.device,
             prepare: bool, clock: PhaseClock) -> TuneReport:
    """Adopt the stored packed weights, bind each tuned layer for its recorded input; the report."""
    results = []
    for name, layer in _sparse_layers(gm).items():
        entry = manifest["layers"][name]
        if entry.get("packed") is not None:
            with clock.phase("packed weights"):
                layer.adopt_packed(decode_packed(entry["packed"], tensors, device))
        if entry.get("spec") is None:
            continue
        spec = ConvSpec(**entry["spec"])
        if prepare:
            with clock.phase(f"bind {layer.backend}"):
                layer.prepare(_layer_input(layer, spec, device))
        results.append(LayerResult(name, spec, layer.backend, layer.config, entry.get("choice") or layer.backend,
                                   _number(entry.get("time_ms")), _number(entry.get("dense_ms")),
                                   {label: _number(ms) for label, ms in (entry.get("times_ms") or {}).items()},
                                   {}, "artefact"))
    tuning = manifest["tuning"]
    return TuneReport(results, manifest["policy"], tuning.get("max_rel_error"), list(tuning.get("unreached", [])))


def load(out_dir, device=None, *, prepare: bool = True, cache_dir=None, progress: Optional[bool] = None,
         timer: Optional[Timer] = None, cuda_graphs: bool = True) -> fx.GraphModule:
    """The model compiled into the artefact `out_dir` (`compile_model`), in eval mode on `device`.

    device: default where it was tuned when that device type exists here, else the CPU. Every file
    is checked against the manifest's sizes and sha256 first: a missing, truncated or damaged file,
    or a manifest that is not one, raises ArtifactError (a ValueError) naming it. When this device
    or toolchain differs from the one tuned on (GPU, torch/CUDA/cuDNN/triton/driver versions, or
    the codegen nvcc/ptxas), it warns why and re-tunes here (`autotune_model` on a seeded random
    input of the recorded shape, same policy and backends; cache_dir, progress, timer as there);
    otherwise nothing is timed. prepare: bind every tuned layer for its recorded input shape now,
    so the first forward does no setup. The model's `sparsecnn_report` holds the decisions (cache
    column "artefact" when taken from it) and `sparsecnn_retuned` the reason it re-tuned, or None;
    `sparsecnn_load_phases` says where the time went (`tuning.PhaseClock.seconds`). cuda_graphs: on
    CUDA, plain calls replay CUDA graphs and parameters are frozen, as `sparsify_` leaves a model.
    """
    clock = PhaseClock()
    with clock.phase("total"):
        gm, manifest, device = _load(Path(out_dir), device, prepare, clock)
        if gm.sparsecnn_retuned is not None:
            with clock.phase("re-tuning"):
                _retune(gm, manifest, device, Path(out_dir), cache_dir, progress, timer)
    gm.sparsecnn_load_phases = clock.seconds
    if cuda_graphs and device.type == "cuda":
        gm.requires_grad_(False)
        enable_cuda_graphs(gm)
    return gm


def _load(directory: Path, device, prepare: bool, clock: PhaseClock) -> Tuple[fx.GraphModule, dict, torch.device]:
    """`load` up to the environment check: (the model restored, with `sparsecnn_retuned` set and
    the report too when nothing needs re-tuning; the manifest; the device)."""
    with clock.phase("read and verify files"):
        manifest = read_manifest(directory)
        verify_files(directory, manifest)
        device = _device(device, manifest)
        tensors = read_tensors(directory / manifest["weights"], aligned=device.type == "cpu")
    path = directory / MANIFEST
    with clock.phase("rebuild model"):
        gm = _skeleton(manifest, path)
        _load_state(gm, manifest, tensors, path)
    with clock.phase("to device"):
        gm = gm.to(device).eval()
    with clock.phase("codegen files"):
        install_codegen(directory, manifest["files"])
    with clock.phase("environment check"):
        gm.sparsecnn_retuned = _environment_change(manifest, device)
    if gm.sparsecnn_retuned is None:
        gm.sparsecnn_report = _restore(gm, manifest, tensors, device, prepare, clock)
        _fold_shortcuts(gm, manifest, path)
    return gm, manifest, device


def _fold_shortcuts(gm: fx.GraphModule, manifest: dict, path: Path) -> None:
    """Fold the projection shortcuts tuning had folded ("shortcuts"; absent in older artefacts)."""
    foldable = set(shortcut_pairs(gm))
    for pair in manifest.get("shortcuts", []):
        if not (isinstance(pair, list) and len(pair) == 2 and tuple(pair) in foldable):
            raise ArtifactError(f"{path}: 'shortcuts' entry {pair!r} is not a (conv, shortcut conv) pair of this model")
        fold_shortcut(gm, *pair)


def _retune(gm: fx.GraphModule, manifest: dict, device: torch.device, directory: Path, cache_dir,
            progress: Optional[bool], timer: Optional[Timer]) -> None:
    why = gm.sparsecnn_retuned
    warnings.warn(f"sparsecnn.load({str(directory)!r}): re-tuning, the artefact was tuned in another environment "
                  f"({why}); compile it again here to keep the new decisions", stacklevel=3)
    example = torch.randn(manifest["model"]["input_shape"], generator=torch.Generator().manual_seed(_LOAD_SEED))
    gm.sparsecnn_report = autotune_model(gm, example.to(device), backends=manifest.get("backends"),
                                         dtype=manifest["policy"], cache_dir=cache_dir, progress=progress,
                                         timer=timer, run_mode=manifest.get("run_mode", "graph"))

