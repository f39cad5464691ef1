"""Whole-model benchmark: the pruned model run densely by cuDNN, then sparsified, in several modes.

Modes: "eager" (plain calls, timed as wall time of back-to-back calls: the CPU's launch cost
counts, as in an eager loop; `tuning.timing.eager_benchmark`), "cudagraph" (captured once with
`torch.cuda.CUDAGraph` after a warm-up on a side stream, timed as `graph.replay()`; CUDA only,
skipped with a note elsewhere) and "compile" (`torch.compile` with `compile_mode`, "max-autotune"
by default, for the dense and the sparse model alike: inductor fuses the dense model's BatchNorm
and ReLU, and the ops around the sparse model's convs, which are opaque custom ops to it). The sparse model is first simplified for inference (`passes.prepare_for_inference`: BatchNorm
folded, ReLU and residual adds fused into the convs), then tuned (`sparsify_`). Every row's
`rel_err` compares that mode's output with the masked model run in float64 on the same input.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import CUDNN, free_memory, precision, round_to
from sparsecnn.bench.patterns import DLMC_PREFIX, split_tiles_pattern, tiled
from sparsecnn.bench.schema import FIELDS, MODES, torch_dtype
from sparsecnn.core.reference import relative_error
from sparsecnn.models import build_model, default_input_shape
from sparsecnn.nn import SparseConv2d
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.prune import (
    apply_dlmc_,
    load_pruned,
    masks_from_weights,
    prune_magnitude_,
)
from sparsecnn.prune.checkpoint import FORMAT as PRUNED_FORMAT
from sparsecnn.tuning import benchmark
from sparsecnn.tuning.sparsify import sparsify_
from sparsecnn.tuning.timing import eager_benchmark

_SHAPE_NULLS = dict(suite=None, layer=None, C=None, K=None, H=None, W=None, R=None, S=None,
                    stride=None, padding=None, floor_ms=None)
CHECKPOINT_PATTERN = "checkpoint"


def _pruned_model(name: str, sparsity: float, pattern: str, seed: int,
                  checkpoint: Optional[str | os.PathLike]) -> Tuple[nn.Module, str, float]:
    """(float32 model in eval mode on CPU, pattern label, sparsity to record).

    Random init seeded by `seed`; then the checkpoint (a `prune.save_pruned` file or a plain state
    dict, already pruned: its zeros are the pattern; recorded as pattern "checkpoint" with the measured conv sparsity), or magnitude pruning of
    each conv to `sparsity` ("random": the init is i.i.d., so the mask is random), or the DLMC masks
    ("dlmc-<method>", resnet50 only), or "tiles<rows>[x<chunk>][i]-<pattern>": that pattern's convs re-pruned
    into tiles (`patterns.tiled`, the cells the tiles add filled with values of the layer's scale).
    """
    tiles, base = split_tiles_pattern(pattern)
    if tiles is not None and checkpoint is None:
        model, label, sparsity = _pruned_model(name, sparsity, base, seed, None)
        _tile_convs_(model, *tiles, seed)
        return model, f"{pattern.partition('-')[0]}-{label}", sparsity
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(name)
    if checkpoint is not None:
        _load_checkpoint_(model, checkpoint)
        masks = masks_from_weights(model)
        kept = sum(int(mask.sum()) for mask in masks.values())
        total = sum(mask.numel() for mask in masks.values())
        return model.eval(), CHECKPOINT_PATTERN, round(1 - kept / total, 6)
    if pattern == "random":
        prune_magnitude_(model, sparsity, scope="layer")
    elif pattern.startswith(DLMC_PREFIX):
        if name != "resnet50":
            raise ValueError(f"pattern {pattern!r} needs model 'resnet50' (DLMC masks), got {name!r}")
        apply_dlmc_(model, f"{pattern[len(DLMC_PREFIX):]}-{sparsity:g}", seed)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected 'random', 'dlmc-<method>' or "
                         f"'tiles<rows>-<pattern>'")
    return model.eval(), pattern, float(sparsity)


def _tile_convs_(model: nn.Module, rows: int, chunk: int, order: str, seed: int) -> None:
    """Every pruned Conv2d with groups == 1 re-pruned into tiles of `rows` channels (units of `chunk`
    input channels, channels grouped in `order`), in place."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for module in model.modules():
            if not isinstance(module, nn.Conv2d) or module.groups != 1:
                continue
            weight = module.weight.detach()
            if bool((weight == 0).any()) and bool(weight.any()):
                values = torch.randn_like(weight) * weight[weight != 0].abs().mean()
                module.weight.copy_(tiled(weight, values, rows, chunk, order))


def _load_checkpoint_(model: nn.Module, checkpoint: str | os.PathLike) -> None:
    """Load a `prune.save_pruned` checkpoint (weights re-masked) or a plain state dict into `model`."""
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if isinstance(payload, dict) and payload.get("format") == PRUNED_FORMAT:
        load_pruned(checkpoint, model)
    else:
        model.load_state_dict(payload)


def _round_model_(model: nn.Module, dtype: str) -> nn.Module:
    """Round every float parameter and buffer to dtype's precision, keeping float32."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(round_to(tensor, dtype))
    return model


def capture_cuda_graph(model: nn.Module, x: torch.Tensor) -> Tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """(replay, output): `model(x)` captured in a CUDA graph after three warm-up calls on a side stream."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)

    def output() -> torch.Tensor:
        graph.replay()
        return static_y

    return graph.replay, output


def _runner(model: nn.Module, x: torch.Tensor, mode: str,
            compile_mode: Optional[str]) -> Tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """(what to time, one run returning the output) for `model(x)` in `mode`."""
    if mode == "cudagraph":
        return capture_cuda_graph(model, x)
    if mode == "compile":
        compiled = torch.compile(model, mode=compile_mode)
        return (lambda: compiled(x)), (lambda: compiled(x))
    return (lambda: model(x)), (lambda: model(x))


def _sparse_choices(model: nn.Module, tune_s: float) -> Dict[str, Any]:
    """The sparse row's `config`: {"layers": {module path: {"backend", "config", "ms", "dense_ms"}},
    "tune_s": seconds spent in `sparsify_`, "conv_ms" / "dense_conv_ms": the tuned convs' summed
    times and the same convs run densely (per-layer medians from tuning; null when not tuned),
    "model_check": the whole-model check against dense (`tuning.ModelCheck` as a dict, or null),
    "tune_phases_s": where the tuning time went (`TuneReport.phase_s`, rounded; {} when not tuned),
    "tune_workers": the worker jobs' times (`TuneReport.worker_jobs`), "layout_ms": the whole-model
    times with NCHW and batch-innermost outputs between "batch" layers (`TuneReport.layout_ms`),
    "linears": the split-K choice of each timed linear (`TuneReport.linears`: path -> {"splits", "ms",
    "dense_ms"}); "policy": the precision policy tuned for; `_variant` adds "backends", the sparse backends tuning was limited to (null: all)}."""
    report = getattr(model, "sparsecnn_report", None)
    timed = {} if report is None else {layer.name: layer for layer in report.layers}
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseConv2d):
            result = timed.get(name)
            layers[name] = {"backend": module.backend, "config": config_to_dict(module.config),
                            "ms": None if result is None else result.time_ms,
                            "dense_ms": None if result is None else result.dense_ms}
    check = None if report is None or report.model_check is None else dataclasses.asdict(report.model_check)
    phases = {} if report is None else {name: round(value, 2) for name, value in report.phase_s.items()}
    workers = {} if report is None else report.worker_jobs
    layout_ms = {} if report is None else report.layout_ms
    linears = {} if report is None else report.linears
    return {"layers": layers, "tune_s": round(tune_s, 3), "policy": None if report is None else report.policy,
            "model_check": check, "tune_phases_s": phases,
            "tune_workers": workers, "layout_ms": layout_ms, "linears": linears,
            "conv_ms": sum(layer.time_ms for layer in timed.values()) if timed else None,
            "dense_conv_ms": sum(layer.dense_ms for layer in timed.values()) if timed else None}


def _time_modes(model: nn.Module, x: torch.Tensor, ref: torch.Tensor, modes: Sequence[str], dtype: str,
                timing: Dict[str, Any], compile_mode: Optional[str]) -> List[Tuple[str, Dict[str, float]]]:
    """[(mode, {"median_ms", "p20_ms", "p80_ms", "rel_err", "first_call_s"})] of `model(x)` (first_call_s:
    wall seconds of the first call, torch.compile's compile time in mode "compile"). cudagraph is skipped with
    a note off CUDA or when capture fails (e.g. a library call that cannot be captured)."""
    results = []
    for mode in modes:
        if mode == "cudagraph" and x.device.type != "cuda":
            tqdm.write(f"mode cudagraph skipped: needs CUDA, input is on {x.device.type}")
            continue
        with precision(dtype), torch.no_grad():
            try:
                timed, once = _runner(model, x, mode, compile_mode)
            except RuntimeError as error:
                if mode != "cudagraph":
                    raise
                tqdm.write(f"mode cudagraph skipped: capture failed: {error}")
                continue
            start = time.perf_counter()
            err = relative_error(once(), ref)  # mode "compile": this first call compiles (and autotunes)
            first_call_s = time.perf_counter() - start
            stats = eager_benchmark(timed, x.device) if mode == "eager" else benchmark(timed, x.device, **timing)
            results.append((mode, {**stats, "rel_err": err, "first_call_s": first_call_s}))
    return results


def _row(base: Dict[str, Any], backend: str, config: Optional[dict], mode: str,
         stats: Dict[str, float], compile_mode: Optional[str], cudnn_benchmark: bool) -> Dict[str, Any]:
    """One result row; a "compile" row's config records `torch.compile`'s mode ("compile_mode") and the
    first call's seconds ("compile_s": compiling and autotuning), and
    every row's config says `cudnn_benchmark: true` when the run had cudnn.benchmark on."""
    if mode == "compile":
        config = {**(config or {}), "compile_mode": compile_mode or "default",
                  "compile_s": round(stats["first_call_s"], 2)}
    if cudnn_benchmark:
        config = {**(config or {}), "cudnn_benchmark": True}
    row = {**base, "backend": backend, "config": config, "mode": mode, **stats}
    return {name: row[name] for name in FIELDS}


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """torch.backends.cudnn.benchmark set to `enabled` inside, restored on exit."""
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def _check_args(dtype: str, backend: str, modes: Sequence[str]) -> None:
    torch_dtype(dtype)
    if backend != "auto":
        get_backend(backend)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} in modes; expected one of {', '.join(MODES)}")


def _input(name: str, batch: int, seed: int, device: torch.device, dtype: str) -> torch.Tensor:
    """x ~ N(0, 1) of the model's input shape at `batch`, rounded to dtype's precision, float32."""
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}/input".encode()))
    x = torch.randn((batch, *default_input_shape(name)), generator=generator, device=device)
    return round_to(x, dtype)


def _variant(model: nn.Module, x: torch.Tensor, dtype: str, backend: str, backends: Optional[List[str]],
             run_mode: str = "graph") -> Tuple[nn.Module, torch.Tensor, Optional[dict]]:
    """(copy of `model` to run, its input, the row's config) for backend "cudnn" (the masked model in
    dtype) or a sparse backend (`prepare_for_inference`, then `sparsify_` at the dtype's precision
    policy, or for "tf32" at PyTorch's defaults: `dtype=None` with TF32 convs on, which tunes an fp32
    model under "fp32-default"; config: see `_sparse_choices`). Both get the same input: x in dtype, channels_last for
    fp16/bf16 (where cuDNN runs NHWC), else NCHW."""
    stored = torch_dtype(dtype)
    layout = torch.channels_last if stored in (torch.float16, torch.bfloat16) else torch.contiguous_format
    if backend == CUDNN:
        dense = copy.deepcopy(model).to(dtype=stored, memory_format=layout)
        return dense, x.to(dtype=stored, memory_format=layout), None
    sparse = prepare_for_inference(copy.deepcopy(model))
    start = time.perf_counter()
    with precision(dtype):  # "tf32": PyTorch's defaults, tuned as a user of them would (dtype=None)
        sparsify_(sparse, x.contiguous(memory_format=layout), backend=backend, dtype=None if dtype == "tf32" else dtype,
                  backends=backends, progress=False, run_mode=run_mode)
    return sparse, x.to(dtype=stored, memory_format=layout), {
        **_sparse_choices(sparse, time.perf_counter() - start), "backends": backends, "run_mode": run_mode}


def bench_model(name: str, *, batch: int, dtype: str, sparsity: float, pattern: str, backend: str = "auto",
                device: torch.device | str, modes: Sequence[str] = ("eager", "cudagraph"), seed: int = 0,
                run_id: Optional[str] = None, checkpoint: Optional[str | os.PathLike] = None,
                progress: bool = True, timing: Optional[Dict[str, Any]] = None,
                compile_mode: Optional[str] = "max-autotune",
                backends: Optional[List[str]] = None, run_mode: str = "graph",
                cudnn_benchmark: bool = False, sparse_modes: Optional[Sequence[str]] = None,
                on_rows: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> List[Dict[str, Any]]:
    """Benchmark model `name` at `batch`; returns results rows of kind "model".

    Rows: backend "cudnn" (the pruned model run densely; fp16/bf16 in channels_last) in each mode,
    then the model after `sparsify_(..., backend=backend)` (row backend = `backend`, "auto" included;
    `config` = each layer's chosen backend and config) in each mode. pattern/sparsity: see
    `_pruned_model`; with `checkpoint` the weights come from that state dict instead. dtype: "fp32"
    (TF32 off), "tf32", "fp16", "bf16". timing: keyword arguments for `tuning.benchmark` (modes other than eager).
    compile_mode: `torch.compile`'s mode for both models in mode "compile" (None: default).
    backends: with backend "auto", the only sparse backends tuning may pick (None: all; the sparse
    row's config records it). run_mode: what tuning times (`autotune_model`; the row's config
    records it). cudnn_benchmark: run everything (dense baselines, tuning, timing) with
    `torch.backends.cudnn.benchmark` on, so cuDNN times its engines for every convolution shape and
    keeps the fastest (rows' config records it); the flag is restored on return. sparse_modes: the
    sparse model's modes (None: `modes`), e.g. the dense model under "compile" as the baseline and
    the sparse one only under "cudagraph", which spares a second inductor compile. on_rows: called
    with each model's rows as soon as they are measured (a long run killed later keeps them).
    """
    sparse_modes = tuple(modes if sparse_modes is None else sparse_modes)
    _check_args(dtype, backend, (*modes, *sparse_modes))
    device, timing = torch.device(device), dict(timing or {})
    model, label, recorded_sparsity = _pruned_model(name, sparsity, pattern, seed, checkpoint)
    model = _round_model_(model, dtype).to(device)
    x = _input(name, batch, seed, device, dtype)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    base = {"run": run_id or new_run_id(), "kind": "model", **environment(device), **_SHAPE_NULLS,
            "model": name, "N": batch, "dtype": dtype, "sparsity": recorded_sparsity, "pattern": label}
    rows = []
    with _cudnn_benchmark(cudnn_benchmark):
        for variant in tqdm((CUDNN, backend), desc=f"{name} {dtype}", disable=not progress):
            runnable, x_cast, config = _variant(model, x, dtype, variant, backends, run_mode)
            variant_modes = modes if variant == CUDNN else sparse_modes
            measured = [_row(base, variant, config, mode, stats, compile_mode, cudnn_benchmark)
                        for mode, stats in _time_modes(runnable, x_cast, ref, variant_modes, dtype, timing,
                                                       compile_mode)]
            if on_rows is not None:
                on_rows(measured)
            rows += measured
            del runnable, x_cast
            free_memory(device)
    return rows
