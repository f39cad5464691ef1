"""Fill the inductor caches with a model's dense `torch.compile` baseline, before `bench model` times it.

On the device image `torch.compile(mode="max-autotune")` spends 20-90 s autotuning each conv shape
(H100; a 3x3 GoogLeNet shape: 20 s precompiling and 74 s benchmarking 17 choices), so a
ResNet-50 or a GoogLeNet outlasts one device call. Run this under `TORCHINDUCTOR_CACHE_DIR=D`
(stopped by `timeout` if need be: each finished shape's choice is already on disk), keep D between
calls, and the next call resumes; once it completes, `bench model ... --modes compile` under the same
D compiles from the cache. The model is built as `bench model` builds its dense variant (same dtype,
layout, batch and TF32 flags), so the graphs and their cache keys match; pruning does not change the
graph.

`--part I/N` spreads the work over N processes (run them at once, I = 0..N-1): the model is cut
into about N units holding convolutions (`conv_units`), dealt to the parts by convolution count,
and process I compiles its units, each on the input it receives in the model (recorded in one
eager pass), so each conv shape is autotuned about once in all. The processes share the GPU while
they benchmark, so their timings are noisier than one process's: a choice may be worse than the
one a lone process would make.

    python scripts/warm_dense_compile.py resnet50 --batch 32 --dtype fp32 [--mode max-autotune] [--part 0/4]
    python scripts/warm_dense_compile.py mobilenet_v2 --torchvision --batch 32 --dtype fp16 --part 0/8
"""
from __future__ import annotations

import argparse
import contextlib
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


def conv_count(module: nn.Module) -> int:
    return sum(isinstance(inner, (nn.Conv1d, nn.Conv2d)) for inner in module.modules())


def conv_units(model: nn.Module, count: int) -> List[Tuple[str, nn.Module]]:
    """Modules holding the model's convolutions, to compile apart: starting from the model, the unit
    with the most convolutions is replaced by its children that hold any, until there are `count`
    units or none can be split (torchvision's mobilenet_v2 or vgg16_bn keep every conv in one
    `features` child, so top-level children alone would leave one part)."""
    units = [("", model)]
    while len(units) < count:
        splittable = [(conv_count(module), index) for index, (_, module) in enumerate(units)
                      if sum(conv_count(child) > 0 for child in module.children()) > 0 and conv_count(module) > 1]
        if not splittable:
            break
        _, index = max(splittable)
        prefix, module = units.pop(index)
        units[index:index] = [(f"{prefix}.{name}".lstrip("."), child) for name, child in module.named_children()
                              if conv_count(child) > 0]
    return units


def unit_inputs(model: nn.Module, x: torch.Tensor, units: List[Tuple[str, nn.Module]]) -> Dict[str, tuple]:
    """{unit name: the positional arguments of its first call} in one eager pass (units never called,
    e.g. GoogLeNet's auxiliary heads in eval mode, are absent)."""
    inputs: Dict[str, tuple] = {}
    hooks = [module.register_forward_pre_hook(lambda _, args, name=name: inputs.setdefault(name, args))
             for name, module in units]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return inputs


def assigned_units(model: nn.Module, x: torch.Tensor, index: int,
                   count: int) -> List[Tuple[str, nn.Module, tuple]]:
    """Part `index` of `count`: units dealt largest first to the part with the fewest convolutions."""
    units = conv_units(model, count)
    inputs = unit_inputs(model, x, units)
    loads = [0] * count
    mine = []
    for name, module in sorted(units, key=lambda unit: -conv_count(unit[1])):
        part = loads.index(min(loads))
        loads[part] += conv_count(module)
        if part == index and name in inputs:
            mine.append((name, module, inputs[name]))
    return mine


def compile_and_run(module: nn.Module, args: tuple, mode: str) -> float:
    """Seconds to compile `module` in `mode` and run it once on args."""
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(module, mode=mode)(*args)
        torch.cuda.synchronize()
    return time.perf_counter() - start


def built(args: argparse.Namespace) -> Tuple[nn.Module, torch.Tensor]:
    """(the dense model as the benchmark times it, its input) on the GPU."""
    stored = torch_dtype(args.dtype)
    layout = torch.channels_last if stored in (torch.float16, torch.bfloat16) else torch.contiguous_format
    if args.torchvision:
        import torchvision

        model, shape = torchvision.models.get_model(args.model, weights=None), (3, 224, 224)
    else:
        model, shape = build_model(args.model), default_input_shape(args.model)
    model = model.eval().to("cuda", dtype=stored, memory_format=layout)
    return model, torch.randn(args.batch, *shape, device="cuda").to(stored, memory_format=layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--mode", default="max-autotune")
    parser.add_argument("--part", type=parse_part, default=None, help="I/N: this process's share of N")
    parser.add_argument("--torchvision", action="store_true",
                        help="a torchvision model (224x224 inputs) at PyTorch's flags, as "
                             "benchmarks/torchvision_table.py times it; else our zoo's, under bench's flags")
    args = parser.parse_args()
    model, x = built(args)
    label = f"{args.model} N={args.batch} {args.dtype} mode={args.mode}"
    flags = contextlib.nullcontext() if args.torchvision else precision(args.dtype)
    with flags:
        if args.part is None:
            print(f"compiled {label} in {compile_and_run(model, (x,), args.mode):.1f} s", flush=True)
            return
        for name, unit, unit_args in assigned_units(model, x, *args.part):
            print(f"compiled {label} unit {name} in {compile_and_run(unit, unit_args, args.mode):.1f} s",
                  flush=True)


if __name__ == "__main__":
    main()
