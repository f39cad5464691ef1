"""Fill the inductor caches with a model's dense `torch.compile` baseline, before `bench model` times it.

On the device image `torch.compile(mode="max-autotune")` spends 20-90 s autotuning each conv shape
(H100; a 3x3 GoogLeNet shape: 20 s precompiling and 74 s benchmarking 17 choices), so a
ResNet-50 or a GoogLeNet outlasts one device call. Run this under `TORCHINDUCTOR_CACHE_DIR=D`
(stopped by `timeout` if need be: each finished shape's choice is already on disk), keep D between
calls, and the next call resumes; once it completes, `bench model ... --modes compile` under the same
D compiles from the cache. The model is built as `bench model` builds its dense variant (same dtype,
layout, batch and TF32 flags), so the graphs and their cache keys match; pruning does not change the
graph.

`--part I/N` spreads the work over N processes (run them at once, I = 0..N-1): process I compiles
only the top-level children of the model holding convolutions whose rank among them is I mod N,
each on the input it receives in the model (recorded in one eager pass), so each conv shape is
autotuned once in all. The processes share the GPU while they benchmark, so their timings are
noisier than one process's: a choice may be worse than the one a lone process would make.

    python scripts/warm_dense_compile.py resnet50 --batch 32 --dtype fp32 [--mode max-autotune] [--part 0/4]
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Tuple

import torch
from torch import nn

from sparsecnn.bench.layers import precision
from sparsecnn.bench.schema import torch_dtype
from sparsecnn.models import build_model, default_input_shape


def parse_part(text: str) -> Tuple[int, int]:
    """"I/N" -> (I, N), 0 <= I < N."""
    try:
        index, count = (int(value) for value in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part must be I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--part I/N needs 0 <= I < N, got {text!r}")
    return index, count


def conv_children_inputs(model: nn.Module, x: torch.Tensor) -> List[Tuple[str, nn.Module, torch.Tensor]]:
    """(name, child, the input it receives) of every top-level child holding a convolution, model order."""
    inputs: Dict[str, torch.Tensor] = {}
    children = [(name, child) for name, child in model.named_children()
                if any(isinstance(module, (nn.Conv1d, nn.Conv2d)) for module in child.modules())]
    hooks = [child.register_forward_pre_hook(lambda module, args, name=name: inputs.setdefault(name, args[0]))
             for name, child in children]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return [(name, child, inputs[name]) for name, child in children if name in inputs]


def compile_and_run(module: nn.Module, x: torch.Tensor, mode: str) -> float:
    """Seconds to compile `module` in `mode` and run it once on x."""
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(module, mode=mode)(x)
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--mode", default="max-autotune")
    parser.add_argument("--part", type=parse_part, default=None, help="I/N: this process's share of N")
    args = parser.parse_args()
    stored = torch_dtype(args.dtype)
    layout = torch.channels_last if stored in (torch.float16, torch.bfloat16) else torch.contiguous_format
    model = build_model(args.model).eval().to("cuda", dtype=stored, memory_format=layout)
    x = torch.randn(args.batch, *default_input_shape(args.model), device="cuda").to(stored, memory_format=layout)
    label = f"{args.model} N={args.batch} {args.dtype} mode={args.mode}"
    with precision(args.dtype):
        if args.part is None:
            print(f"compiled {label} in {compile_and_run(model, x, args.mode):.1f} s", flush=True)
            return
        index, count = args.part
        for rank, (name, child, child_x) in enumerate(conv_children_inputs(model, x)):
            if rank % count == index:
                print(f"compiled {label} child {name} in {compile_and_run(child, child_x, args.mode):.1f} s",
                      flush=True)


if __name__ == "__main__":
    main()
