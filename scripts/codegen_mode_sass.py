"""Backend `codegen`'s two compile modes side by side, offline (no GPU): the SASS ptxas makes for one
layer's weight in rewrite mode (placeholder template through nvcc, weights substituted into its PTX)
and in emit mode (CUDA C of the kept terms through nvcc), and what each compile cost.

Usage (CPU; nvcc and ptxas on PATH or as SPARSECNN_NVCC / SPARSECNN_PTXAS; nvdisasm from Triton's
wheel):
    python scripts/codegen_mode_sass.py OUT.jsonl DTYPE C,K,R,HW[,STRIDE] [C,K,R,HW[,STRIDE] ...]
DTYPE is fp32 or fp16; each layer is N=32, stride STRIDE (default 1), padding R // 2, a random weight pruned to 0.9
(seed 0), compiled for sm_90 from an empty cache. One JSON line per layer: its slices, how many
slices have identical SASS, the SASS lines that differ (unified diff, both sides), the instruction
mix of each mode (opcode -> count over all slices) and each mode's nvcc / ptxas / total seconds.
"""
import collections
import dataclasses
import difflib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from sparsecnn.backends.codegen import generator
from sparsecnn.bench.env import environment
from sparsecnn.core import toolchain
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.toolchain import DiskCache

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);")
_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass_lines(cubin: bytes) -> list:
    """The instructions of a cubin's kernels as nvdisasm prints them, without addresses."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(NVDISASM), "-c", file.name], capture_output=True, text=True, check=True).stdout
    return [match.group(1).strip() for match in map(_INSTRUCTION.match, text.splitlines()) if match]


def compile_mode(weight: torch.Tensor, spec: ConvSpec, dtype: torch.dtype, mode: str) -> dict:
    """One fresh compile of the layer's default config in `mode`: its SASS per slice and its costs."""
    config = dataclasses.replace(generator.candidate_configs(spec, dtype)[0], mode=mode)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        compiled = generator.compile_conv(weight, spec, config, has_bias=True, jobs=1, dtype=dtype, arch="90",
                                          cache=DiskCache(Path(cache_dir)))
    seconds = time.perf_counter() - start
    report = compiled.report
    return {"sass": [sass_lines(cubin) for cubin in compiled.cubins], "total_s": round(seconds, 2),
            "nvcc_s": round(report.nvcc_s, 2), "ptxas_s": round(report.ptxas_s, 2), "fallback": report.fallback}


def compare(shape: str, dtype_name: str) -> dict:
    channels, kernels, taps, size, *stride = (int(part) for part in shape.split(","))
    spec = ConvSpec(32, channels, kernels, size, size, taps, taps, stride=stride[0] if stride else 1, padding=taps // 2)
    torch.manual_seed(0)
    weight = torch.randn(kernels, channels, taps, taps) * (torch.rand(kernels, channels, taps, taps) > 0.9)
    modes = {mode: compile_mode(weight, spec, DTYPES[dtype_name], mode) for mode in ("rewrite", "emit")}
    pairs = list(zip(modes["rewrite"]["sass"], modes["emit"]["sass"]))
    differing = sum(1 for old, new in pairs for line in difflib.unified_diff(old, new, n=0, lineterm="")
                    if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    row = {**environment("cpu"), "toolchain": toolchain.toolchain_id("90"), "kind": "codegen modes sass",
           "layer": shape, "dtype": dtype_name, "sparsity": 0.9, "pattern": "random", "slices": len(pairs),
           "identical_slices": sum(old == new for old, new in pairs), "differing_lines": differing}
    for mode, result in modes.items():
        mix = collections.Counter(_OPCODE.match(line).group(1) for kernel in result["sass"] for line in kernel)
        row[mode] = {"instructions": sum(mix.values()), "mix": dict(mix.most_common()),
                     **{key: result[key] for key in ("total_s", "nvcc_s", "ptxas_s", "fallback")}}
    return row


if len(sys.argv) < 4 or sys.argv[2] not in DTYPES:
    raise SystemExit(__doc__)
for layer in sys.argv[3:]:
    result = compare(layer, sys.argv[2])
    with open(sys.argv[1], "a") as out:
        out.write(json.dumps(result) + "\n")
    print(f"{layer} {sys.argv[2]}: {result['identical_slices']}/{result['slices']} slices identical, "
          f"{result['differing_lines']} lines differ; instructions {result['rewrite']['instructions']} / "
          f"{result['emit']['instructions']}; compile s rewrite {result['rewrite']['total_s']}, "
          f"emit {result['emit']['total_s']}", flush=True)
