"""Per-layer benchmark: cuDNN dense baselines and sparse backends on one weight per layer.

For every layer: one input x ~ N(0, 1) and one pruned weight (`patterns.make_weight`), both rounded
to the requested dtype's precision so that every row computes on the same numbers and `rel_err`
measures arithmetic error only; one float64 reference on the device. Then:

* cuDNN baselines (backend "cudnn", `F.conv2d` with cudnn.benchmark on): "fp32" (TF32 off), "tf32"
  (TF32 on) and "fp16" (half, channels_last), plus "bf16" (channels_last) when the requested dtype is
  bf16. On CPU only "fp32" is timed: TF32 does not exist there and half convolutions are not a
  baseline anyone runs.
* each requested backend at the requested dtype, NCHW contiguous, with its default config (or every
  config with `all_configs=True`).
* each peer system asked for (`peers.Peer`: another project's kernels, loaded from the checkout's
  benchmarks/peers), one row per variant, backend "peer:<variant>", on the same input and weight.

Each measurement: a best-effort poisoning of freed device memory with NaN, one run whose output is
compared with the reference, then timing (`tuning.benchmark`, L2 flushed on CUDA).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsecnn.backends import Backend, config_to_dict, get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.peers import PEER_PREFIX, Peer
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.bench.schema import DTYPES, FIELDS, torch_dtype
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning import benchmark
from sparsecnn.tuning.precision import tf32_variant

CUDNN = "cudnn"
_HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """Within the block: TF32 on for dtype name "tf32" and off otherwise (cuDNN convolutions and
    cuBLAS matmuls), cudnn.benchmark on. The previous flags are restored on exit."""
    allow_tf32 = DTYPES[dtype][1]
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.benchmark)
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def baseline_dtypes(dtype: str, device_type: str) -> List[str]:
    """Dtype names of the cuDNN baseline rows for a run at `dtype` on `device_type`."""
    if device_type != "cuda":
        return ["fp32"]
    return ["fp32", "tf32", "fp16"] + (["bf16"] if dtype == "bf16" else [])


def round_to(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` (float32) with its values rounded to what dtype name `dtype` can hold, still float32."""
    stored = torch_dtype(dtype)
    return t.to(stored).float() if stored in _HALF else t


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached device memory to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def _poison(nbytes: int, device: torch.device) -> None:
    """Fill `nbytes` of the CUDA caching allocator's memory with 0xFF (NaN in every float format)
    and free it, so an output that reuses it and is not fully written shows up as NaN."""
    if device.type == "cuda":
        torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)


def measure(fn: Callable[[], torch.Tensor], ref: torch.Tensor, device: torch.device,
            timing: Dict[str, Any]) -> Dict[str, float]:
    """{"median_ms", "p20_ms", "p80_ms", "rel_err"}: one run of `fn()` into poisoned memory compared
    with `ref`, then `benchmark(fn, device, **timing)`."""
    _poison(ref.numel() * 4, device)
    out = fn()
    err = relative_error(out, ref)
    del out
    return {**benchmark(fn, device, **timing), "rel_err": err}


@dataclasses.dataclass
class _Run:
    """What is shared by every row of one `bench_layers` call."""

    base: Dict[str, Any]  # run id, environment, suite, sparsity, kind, mode, model
    pattern: str
    dtype: str
    device: torch.device
    seed: int
    timing: Dict[str, Any]
    ceilings: Dict[str, float]
    configs: str  # "default", "auto" or "all" (see bench_layers)
    note: Callable[[str], None]


@dataclasses.dataclass
class _Layer:
    """One layer's data: input and weight as float32 (rounded to the run's dtype), fp64 output."""

    spec: ConvSpec
    name: str
    x: torch.Tensor
    weight: torch.Tensor
    ref: torch.Tensor
    density: float
    pattern: str


def _layer_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}/input".encode())


def _prepare_layer(spec: ConvSpec, name: str, sparsity: float, run: _Run) -> _Layer:
    weight, label = make_weight(spec, sparsity, run.pattern, run.seed, run.device)
    if label != run.pattern:
        run.note(f"{name}: no {run.pattern} mask for this layer, using {label}")
    generator = torch.Generator(device=run.device).manual_seed(_layer_seed(run.seed, name))
    x = torch.randn(spec.input_shape, generator=generator, device=run.device)
    x, weight = round_to(x, run.dtype), round_to(weight, run.dtype)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, dilation=spec.dilation,
                         groups=spec.groups, fp64=True)
    density = weight.count_nonzero().item() / weight.numel()
    return _Layer(spec, name, x, weight, ref, density, label)


def _row(layer: _Layer, run: _Run, backend: str, dtype: str, config: Optional[dict],
         stats: Dict[str, float]) -> Dict[str, Any]:
    row = {
        **run.base, **layer.spec.as_dict(), "layer": layer.name,
        "dtype": dtype, "pattern": layer.pattern, "backend": backend, "config": config, **stats,
        "floor_ms": floor_ms(layer.spec, layer.density, dtype, run.ceilings),
    }
    return {name: row[name] for name in FIELDS}


def _cudnn_fn(layer: _Layer, dtype: str) -> Callable[[], torch.Tensor]:
    stored = torch_dtype(dtype)
    layout = torch.channels_last if stored in _HALF else torch.contiguous_format
    x = layer.x.to(dtype=stored, memory_format=layout)
    weight = layer.weight.to(dtype=stored, memory_format=layout)
    spec = layer.spec
    return lambda: F.conv2d(x, weight, None, spec.stride, spec.padding, spec.dilation, spec.groups)


def _backend_fn(backend: Backend, layer: _Layer, dtype: str, config: Any) -> Callable[[], torch.Tensor]:
    """The layer's call as a model makes it: packed and bound once, then called, on an input in the
    layout the backend reads (channels_last for such backends, as their previous layer writes it)."""
    stored = torch_dtype(dtype)
    layout = torch.channels_last if backend.channels_last else torch.contiguous_format
    x = layer.x.to(stored).contiguous(memory_format=layout)
    packed = backend.prepare(layer.weight.to(stored).contiguous(), config)
    call = backend.bind(packed, layer.spec, config, stored, False)
    return lambda: call(x, None, None, False)


def _try_measure(make_fn: Callable[[], Callable[[], torch.Tensor]], layer: _Layer, run: _Run,
                 dtype: str, what: str) -> Optional[Dict[str, float]]:
    """`measure` of `make_fn()` under dtype's precision flags, or None (with a note) on out of memory."""
    try:
        with precision(dtype), torch.no_grad():
            return measure(make_fn(), layer.ref, run.device, run.timing)
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
            raise
    free_memory(run.device)
    run.note(f"{layer.name}: {what} at {dtype} skipped: out of memory")
    return None


def _baseline_rows(layer: _Layer, run: _Run) -> List[Dict[str, Any]]:
    rows = []
    for dtype in baseline_dtypes(run.dtype, run.device.type):
        stats = _try_measure(lambda: _cudnn_fn(layer, dtype), layer, run, dtype, CUDNN)
        if stats is not None:
            rows.append(_row(layer, run, CUDNN, dtype, None, stats))
    return rows


def _backend_rows(backend: Backend, layer: _Layer, run: _Run) -> List[Dict[str, Any]]:
    stored = torch_dtype(run.dtype)
    reason = backend.unsupported_reason(layer.spec, stored, run.device.type)
    if reason is not None:
        run.note(f"{layer.name}: {backend.name} skipped: {reason}")
        return []
    if run.configs == "all" or (run.configs == "auto" and backend.auto_configs is None):
        configs = backend.configs(layer.spec, stored)
    elif run.configs == "auto":
        configs = backend.auto_configs(layer.spec, stored)
    else:
        configs = [backend.default_config(layer.spec, stored)]
    if run.dtype == "tf32":  # a TF32 run times each config's TF32 variant too (configs with a precision field)
        configs = list(dict.fromkeys(configs + [v for v in map(tf32_variant, configs) if v is not None]))
    rows = []
    for config in configs:
        try:
            fn = _backend_fn(backend, layer, run.dtype, config)
        except ValueError as error:  # refused for this weight (e.g. too many non-zeros), as the tuner drops it
            run.note(f"{layer.name}: {backend.name} {config} skipped: {error}")
            continue
        stats = _try_measure(lambda: fn, layer, run, run.dtype, backend.name)
        if stats is not None:
            rows.append(_row(layer, run, backend.name, run.dtype, config_to_dict(config), stats))
    return rows


def _peer_rows(peer: Peer, layer: _Layer, run: _Run) -> List[Dict[str, Any]]:
    """One row per variant of `peer`, timed as the backends are (`_try_measure`, same flags)."""
    reason = peer.unsupported_reason(layer.spec, run.dtype, run.device.type)
    if reason is not None:
        run.note(f"{layer.name}: peer {peer.name} skipped: {reason}")
        return []
    stored = torch_dtype(run.dtype)
    weight, x = layer.weight.to(stored).contiguous(), layer.x.to(stored).contiguous()
    rows = []
    for variant in peer.variants:
        backend = PEER_PREFIX + variant
        stats = _try_measure(lambda: peer.bind(variant, weight, x, layer.spec, run.dtype), layer, run, run.dtype,
                             backend)
        if stats is not None:
            rows.append(_row(layer, run, backend, run.dtype, peer.config(variant, layer.spec, run.dtype), stats))
    return rows


def _bench_one(spec: ConvSpec, name: str, sparsity: float, backends: List[Backend], peers: Sequence[Peer],
               baselines: bool, run: _Run) -> List[Dict[str, Any]]:
    layer = _prepare_layer(spec, name, sparsity, run)
    rows = _baseline_rows(layer, run) if baselines else []
    for backend in backends:
        rows.extend(_backend_rows(backend, layer, run))
    for peer in peers:
        rows.extend(_peer_rows(peer, layer, run))
    return rows


def bench_layers(specs: Sequence[ConvSpec], *, suite: str, sparsity: float, pattern: str, dtype: str,
                 backends: Sequence[str], device: torch.device | str, seed: int = 0,
                 run_id: Optional[str] = None, ceilings: Optional[Dict[str, float]] = None,
                 baselines: bool = True, progress: bool = True, timing: Optional[Dict[str, Any]] = None,
                 configs: str = "default", mode: str = "gpu",
                 on_rows: Optional[Callable[[List[Dict[str, Any]]], None]] = None,
                 peers: Sequence[Peer] = ()) -> List[Dict[str, Any]]:
    """Benchmark every layer of `specs`; returns results rows (see `schema`), kind "layer".

    suite: label recorded in the rows. sparsity: fraction of zero weights in [0, 1). pattern: "random"
    or "dlmc-<method>" (layers without a DLMC mask fall back to random; the row records the label
    used). dtype: "fp32" (TF32 off), "tf32", "fp16" or "bf16". backends: registered backend names.
    timing: keyword arguments for `tuning.benchmark` (warmup_ms, rep_ms, min_rep, flush_l2).
    configs: which configs of each backend to time: "default" (its default), "auto" (those
    `backend="auto"` tries) or "all" (every candidate).
    mode: "gpu" (on CUDA the GPU time alone, the CPU's launch overhead hidden, for cuDNN and the
    backends alike: what a CUDA-graph or compiled model pays; a Triton launch costs tens of us of
    CPU, more than some layers' GPU time) or "eager" (launch overhead included).
    ceilings: `roofline.measure_ceilings(device)` (measured when None). A backend that does not
    support a layer, or runs out of memory, is skipped with a printed note and gives no row.
    on_rows: called with each layer's rows as soon as they are measured (so a run cut short by a
    time limit still leaves the rows of the layers it finished).
    peers: loaded peer systems (`peers.load_peer`), each variant a row of backend "peer:<variant>"
    at the requested dtype; a layer or dtype a peer does not run is skipped with a note.
    """
    torch_dtype(dtype)
    if configs not in ("default", "auto", "all"):
        raise ValueError(f"configs must be 'default', 'auto' or 'all', got {configs!r}")
    if mode not in ("gpu", "eager"):
        raise ValueError(f"mode must be 'gpu' or 'eager', got {mode!r}")
    chosen = [get_backend(name) for name in backends]
    device = torch.device(device)
    ceilings = measure_ceilings(device) if ceilings is None else ceilings
    base = {"run": run_id or new_run_id(), "kind": "layer", **environment(device), "suite": suite,
            "model": None, "sparsity": float(sparsity), "mode": mode}
    timing = {**(timing or {}), "hide_launch": mode == "gpu" and device.type == "cuda"}
    run = _Run(base, pattern, dtype, device, seed, timing, ceilings, configs, tqdm.write)
    rows: List[Dict[str, Any]] = []
    for index, spec in enumerate(tqdm(specs, desc=f"{suite} {dtype}", unit="layer", disable=not progress)):
        layer_rows = _bench_one(spec, spec.name or f"layer{index}", sparsity, chosen, peers, baselines, run)
        if on_rows is not None:
            on_rows(layer_rows)
        rows.extend(layer_rows)
        free_memory(device)
    return rows
