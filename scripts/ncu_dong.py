"""Run every `dong` layer through codegen, unrolled, im2col-cusparse and dense (cuDNN), fp32, for Nsight Compute.

Dong et al. Fig. 10 / Table 5 (benchmarks/dong_fig10.py profiles this script and reads the result).
Per layer (sparsity 0.9, random mask, batch 64 as in the paper's Sec. 3.2 unless --batch) and backend:
prepare and bind the layer as a user does (NCHW float32 input, no bias, no epilogue) with the config
the tuner would try first: the backend's first `auto_configs` entry, or where `auto` tries none on
this layer (codegen beyond one slice, unrolled on large outputs) or has no such list, its default
config (`Backend.default_config`, the registry's "default for untuned use"). Then `--warmup` calls
outside any NVTX range (first launches load modules, cuDNN picks its algorithm: cudnn.benchmark on,
TF32 off, as `bench layers` runs fp32), then exactly one call inside the push/pop ranges
PROFILED_RANGE / "<layer>/<backend>", so that `ncu --nvtx --nvtx-include "ncu_dong/"` profiles every
kernel of that one call and nothing else, and attributes each kernel by the inner range. A backend
that refuses the layer (`unsupported_reason`, or a ValueError / compile error from prepare or bind)
is skipped with a note. Prints one line per profiled call and writes --manifest (JSON: the run's
environment, and per layer and backend its range, config and the mask pattern used (`make_weight`'s
label), or why it was skipped).

Usage (GPU; PYTHONPATH=src): python scripts/ncu_dong.py [--batch 64] [--sparsity 0.9] [--pattern random]
    [--seed 0] [--layers a,b] [--backends codegen,unrolled,im2col-cusparse,dense] [--warmup 3]
    [--manifest ncu_dong.json] [--budget-s S] [--no-prefetch]
Without ncu it runs the same calls (the ranges cost nothing): benchmarks/dong_fig10.py does that
first so that the codegen and unrolled compiles are in the disk cache before profiling.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import zlib
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sparsecnn.backends import Backend, config_to_dict, get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import free_memory, precision
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite

SUITE, DTYPE_NAME, DTYPE = "dong", "fp32", torch.float32
BACKENDS = ("codegen", "unrolled", "im2col-cusparse", "dense")
# The outer range around each profiled call: the ncu filter names it. No NVTX filter quantifier
# (@ , [ ] / * +) in it, unlike the inner "<layer>/<backend>" ranges.
PROFILED_RANGE = "ncu_dong"


def range_name(layer: str, backend: str) -> str:
    """The inner NVTX range of one profiled call, e.g. "lenet-conv1/codegen"."""
    return f"{layer}/{backend}"


def split_range_name(name: str) -> Tuple[str, str]:
    """(layer, backend) of a `range_name`; ValueError for anything else."""
    layer, slash, backend = name.rpartition("/")
    if not slash or not layer or not backend:
        raise ValueError(f"NVTX range {name!r} is not '<layer>/<backend>'")
    return layer, backend


@contextlib.contextmanager
def profiled_ranges(name: str) -> Iterator[None]:
    """Within the block: NVTX ranges PROFILED_RANGE and, inside it, `name`; popped even when the
    block raises, so that no later call is profiled."""
    torch.cuda.nvtx.range_push(PROFILED_RANGE)
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()


def chosen_config(backend: Backend, spec: ConvSpec, dtype: torch.dtype) -> Tuple[Any, str]:
    """(config, "auto" | "default"): the first config `backend="auto"` tries on this layer, else the
    backend's default config (see the module docstring)."""
    auto = backend.auto_configs(spec, dtype) if backend.auto_configs is not None else []
    if auto:
        return auto[0], "auto"
    return backend.default_config(spec, dtype), "default"


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _layer_input(spec: ConvSpec, seed: int) -> torch.Tensor:
    """(N, C, H, W) float32 CUDA input, normal(0, 1), the same for every backend of the layer."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{spec.name}/ncu-input".encode()))
    return torch.randn(spec.input_shape, generator=generator).to("cuda")


def _prefetch(specs: List[ConvSpec], backends: List[str], args) -> None:
    """Start the codegen / unrolled compiles of every layer in the backends' worker processes, so that
    binding later takes finished kernels (or the disk cache's)."""
    for spec in specs:
        weight = make_weight(spec, args.sparsity, args.pattern, args.seed, "cpu")[0]
        for name in backends:
            backend = get_backend(name)
            if backend.prefetch is None or backend.unsupported_reason(spec, DTYPE, "cuda") is not None:
                continue
            backend.prefetch(spec, weight, DTYPE, False, configs=[chosen_config(backend, spec, DTYPE)[0]])


def profile_backend(name: str, spec: ConvSpec, weight: torch.Tensor, x: torch.Tensor, warmup: int) -> dict:
    """Bind `name` on the layer, call it `warmup` times, then once inside the profiled ranges.

    weight: (K, C, R, S) float32 CUDA, zeros pruned; x: (N, C, H, W) float32 CUDA. Returns the
    manifest entry: range, status "profiled" | "skipped", reason, config (dict or None), config_source.
    """
    backend = get_backend(name)
    entry = {"layer": spec.name, "backend": name, "range": range_name(spec.name, name), "status": "skipped",
             "reason": backend.unsupported_reason(spec, DTYPE, "cuda"), "config": None, "config_source": None}
    if entry["reason"] is not None:
        return entry
    try:
        config, entry["config_source"] = chosen_config(backend, spec, DTYPE)
        entry["config"] = config_to_dict(config)
        call = backend.bind(backend.prepare(weight, config), spec, config, DTYPE, False)
        with precision(DTYPE_NAME), torch.no_grad():
            for _ in range(warmup):
                call(x)
            torch.cuda.synchronize()
            with profiled_ranges(entry["range"]):
                call(x)
                torch.cuda.synchronize()  # every kernel of the call launched and done inside the ranges
    except Exception as error:  # noqa: BLE001  (a kernel refusing the weight, a compile error: skip it)
        entry["reason"] = f"{type(error).__name__}: {error}"
        free_memory(x.device)
        return entry
    entry.update(status="profiled", reason=None)
    return entry


def _write_manifest(path: str, manifest: dict) -> None:
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="N (the paper's Sec. 3.2: 64)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--pattern", default="random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", default=None, help="comma-separated subset of the dong suite")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
    parser.add_argument("--manifest", default="ncu_dong.json", help="JSON written here (after every layer)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no layer after this many seconds")
    parser.add_argument("--no-prefetch", action="store_true", help="compile in this process, layer by layer")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1 (the first call loads modules and picks algorithms), got {args.warmup}")
    return args


def _specs(batch: int, layers: Optional[str]) -> List[ConvSpec]:
    specs = get_suite(SUITE, batch=batch)
    if layers is None:
        return specs
    wanted = layers.split(",")
    unknown = sorted(set(wanted) - {spec.name for spec in specs})
    if unknown:
        raise SystemExit(f"--layers: unknown {', '.join(unknown)}; the dong suite has "
                         f"{', '.join(spec.name for spec in specs)}")
    return [spec for spec in specs if spec.name in wanted]


def main(argv: Optional[List[str]] = None) -> None:
    args = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_dong.py needs a CUDA GPU")
    backends = args.backends.split(",")
    for name in backends:
        get_backend(name)  # unknown names fail before any work
    specs = _specs(args.batch, args.layers)
    device = torch.device("cuda")
    manifest = {"run": new_run_id(), "environment": environment(device), "suite": SUITE, "batch": args.batch,
                "dtype": DTYPE_NAME, "sparsity": args.sparsity, "pattern": args.pattern, "seed": args.seed,
                "warmup_calls": args.warmup, "profiled_range": PROFILED_RANGE, "entries": [], "not_started": []}
    if not args.no_prefetch:
        _prefetch(specs, backends, args)
    start = time.perf_counter()
    for spec in specs:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            manifest["not_started"].append(spec.name)
            _note(f"{spec.name}: not started, budget of {args.budget_s:.0f} s spent")
            continue
        weight, label = make_weight(spec, args.sparsity, args.pattern, args.seed, device)
        x = _layer_input(spec, args.seed)
        for name in backends:
            entry = {**profile_backend(name, spec, weight, x, args.warmup), "pattern": label}
            manifest["entries"].append(entry)
            if entry["status"] == "profiled":
                print(f"profiled {entry['range']} ({entry['config_source']} config {json.dumps(entry['config'])})",
                      flush=True)
            else:
                _note(f"skipped {entry['range']}: {entry['reason']}")
        del weight, x
        free_memory(device)  # the next layer's replays save and restore less memory
        _write_manifest(args.manifest, manifest)
    _write_manifest(args.manifest, manifest)


if __name__ == "__main__":
    main()
