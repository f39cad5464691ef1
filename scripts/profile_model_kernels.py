"""Where a sparsified model's GPU time goes: kernel time per conv layer and per kernel name.

Tunes the model as `sparsecnn bench model` does (its cache is reused), then profiles eager calls
with torch.profiler: every SparseConv2d's forward is a record_function range, so its GPU time
(its input packing included) is summed per layer; kernels outside the ranges are "other". The
kernels are the ones a CUDA-graph replay runs, so their durations are what the graph spends.
Writes one JSON line (the results schema, kind "profile") and prints the tables.
Usage: python scripts/profile_model_kernels.py resnet50 --pattern dlmc-magnitude_pruning --out FILE
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import precision
from sparsecnn.bench.models import _input, _pruned_model, _variant
from sparsecnn.nn import SparseConv2d

RUNS = 5


def annotate_convs(model: torch.nn.Module) -> None:
    """Wrap every SparseConv2d forward of `model` in a record_function range `conv:<path>`."""
    for name, module in model.named_modules():
        if isinstance(module, SparseConv2d):
            def pre(mod, args, name=name):
                mod._range = record_function(f"conv:{name}")
                mod._range.__enter__()

            def post(mod, args, out):
                mod._range.__exit__(None, None, None)

            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)


def layer_kernel_ms(prof, runs: int = RUNS) -> dict:
    """{layer: Counter(kernel name -> GPU ms per call)} of each `conv:<layer>` range (`annotate_convs`),
    over `runs` profiled calls: the kernels whose start lies inside the range's GPU-side annotation.
    (The ranges' own `device_time_total` in `key_averages`, used before, overstated some layers:
    layer2.0.conv2 of the DLMC ResNet-50 0.256 against 0.171 ms of kernels.)"""
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ranges = [e for e in gpu if e.name.startswith("conv:")]
    layers = collections.defaultdict(collections.Counter)
    for kernel in gpu:
        if kernel.name.startswith("conv:"):
            continue
        start = kernel.time_range.start
        owner = next((r.name[5:] for r in ranges if r.time_range.start <= start < r.time_range.end), None)
        if owner is not None:
            layers[owner][kernel.name] += kernel.time_range.elapsed_us() / runs / 1e3
    return dict(layers)


def model_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of the profiling scripts that say which model is pruned and tuned, and how."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--pattern", default="random")
    return parser


def tuned_model(args: argparse.Namespace, device: torch.device):
    """(sparsified model, its input, pattern label, sparsity, config row), tuned as `bench model` does."""
    model, label, sparsity = _pruned_model(args.model, args.sparsity, args.pattern, 0, None)
    x = _input(args.model, args.batch, 0, device, args.dtype)
    sparse, x, config = _variant(model.to(device), x, args.dtype, "auto", None)
    return sparse, x, label, sparsity, config


def main() -> None:
    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = torch.device(args.device)
    sparse, x, label, sparsity, config = tuned_model(args, device)
    annotate_convs(sparse)
    with precision(args.dtype), torch.no_grad():  # fp32: TF32 off, as `bench model` runs it
        for _ in range(3):
            sparse(x)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(RUNS):
                sparse(x)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
    events = prof.key_averages()
    layers = {layer: sum(kernels.values()) for layer, kernels in layer_kernel_ms(prof).items()}
    kernels = collections.Counter()
    for e in events:  # the conv:<layer> ranges also carry device time: counting them would count kernels twice
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("conv:"):
            kernels[e.key] += e.self_device_time_total / RUNS / 1e3
    total = sum(kernels.values())
    print(f"GPU kernel time per call {total:.3f} ms; in conv layers {sum(layers.values()):.3f} ms")
    for name, ms in sorted(layers.items(), key=lambda kv: -kv[1]):
        choice = config["layers"].get(name, {})
        print(f"{name:28s} {ms:.4f} ms  {choice.get('backend')} {json.dumps(choice.get('config'))[:90]}")
    print("kernels:")
    for name, ms in kernels.most_common(25):
        print(f"{ms:.4f} ms  {name[:110]}")
    row = {"run": new_run_id(), "kind": "profile", **environment(device), "model": args.model, "batch": args.batch,
           "dtype": args.dtype, "sparsity": sparsity, "pattern": label, "backend": "auto", "mode": "eager",
           "gpu_ms": total, "layer_ms": layers, "kernel_ms": dict(kernels), "config": config}
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
