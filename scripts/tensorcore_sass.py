"""Backend `tensorcore`'s pointer kernel compiled offline for sm_90 (no GPU): the SASS Triton makes for
one layer, plain or with a folded projection shortcut, and its instruction mix.

Usage (CPU, without TRITON_INTERPRET; Triton's own ptxas and nvdisasm):
    python scripts/tensorcore_sass.py OUT.jsonl DTYPE C,K,R,H,STRIDE[,C2,H2,STRIDE2] [...]
DTYPE fp16 or bf16. Each layer: N=32, padding R // 2, the default auto config (64 x 32 units, block 64),
bias and ReLU, a residual unless a shortcut (C2 channels of H2 x H2 at STRIDE2) is folded in. One
JSON line per layer: the opcode mix (opcode with its first modifier -> count), the instruction count,
and the SASS text's sha256 (equal hashes: byte-identical kernels, e.g. across commits).
"""
import collections
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

from sparsecnn.backends.tensorcore import kernel
from sparsecnn.backends.tensorcore.format import pack_shortcut_units, pack_units
from sparsecnn.bench.env import environment
from sparsecnn.core.spec import ConvSpec

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_OPCODE = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)?)")


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(NVDISASM), "-c", file.name], capture_output=True, text=True, check=True).stdout


def compile_layer(dtype: torch.dtype, C: int, K: int, R: int, H: int, stride: int, shortcut=None) -> bytes:
    """The cubin of `kernel._unit_conv_kernel` for the layer, as `unit_conv` would launch it on sm_90."""
    spec = ConvSpec(32, C, K, H, H, R, R, stride, R // 2)
    config = kernel.auto_configs(spec, dtype)[0]
    weight = torch.ones(K, C, R, R)
    packed = (pack_units(weight, config.group, config.chunk) if shortcut is None else
              pack_shortcut_units(weight, torch.ones(K, shortcut[0], 1, 1), config.group, config.chunk))
    operands = (dtype, dtype, torch.int32, torch.int32, torch.int32, dtype, dtype, dtype)
    args, meta = _launch(operands, spec, packed, config, dtype, shortcut)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    jit = kernel._unit_conv_kernel
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    options = {**meta, "debug": False, "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, specialization, parsed = binder(*(MockTensor.wrap_dtype(a) if isinstance(a, torch.dtype) else a
                                             for a in args), **options)
    parsed, signature, constexprs, attrs = jit._pack_args(backend, options, bound, specialization, parsed)
    return triton_compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                          options=parsed.__dict__).asm["cubin"]


def _launch(operands, spec: ConvSpec, packed, config, dtype, shortcut):
    """(args, meta) of the launch, tensors as dtypes; a residual only without a shortcut."""
    x, values, code, start, out_channel, bias, residual, y = operands
    precision = "tf32" if dtype == torch.float32 else "ieee"
    stand_ins = (x, start, 1, 1, 1, 1, 1)
    extra = stand_ins if shortcut is None else (x, torch.int32, shortcut[1], shortcut[1], shortcut[0], shortcut[2],
                                                shortcut[2])
    args = (x, values, code, packed.unit_code.shape[1], start, out_channel, bias, residual, y,
            spec.N * spec.P * spec.Q, spec.H, spec.W, spec.C, spec.P, spec.Q, spec.K, spec.S, *spec.stride,
            *spec.padding, packed.num_groups, *extra)
    meta = dict(BLOCK_M=config.block_m, GROUP=config.group, CHUNK=config.chunk,
                ROW_ALIGN=kernel._row_align(spec.C, config.chunk), EVEN_C=spec.C % config.chunk == 0, PERMUTED=False,
                HAS_BIAS=True, HAS_RESIDUAL=shortcut is None, RELU=True, PRECISION=precision,
                SLOTS=kernel.unit_slots(packed.max_units), UNROLL=config.unroll, USE_GDC=True,
                SHORTCUT=shortcut is not None,
                ROW_ALIGN2=kernel._row_align(packed.shortcut_channels or 16, config.chunk),
                EVEN_C2=packed.shortcut_channels % config.chunk == 0, launch_pdl=True, num_warps=config.num_warps,
                num_stages=config.num_stages)
    return args, meta


def mix(text: str) -> dict:
    counts = collections.Counter(match.group(1) for match in map(_OPCODE.match, text.splitlines()) if match)
    return dict(sorted(counts.items()))


def main(out_path: str, dtype_name: str, layers) -> None:
    env = environment(torch.device("cpu"))
    with open(out_path, "a") as out:
        for text in layers:
            values = [int(v) for v in text.split(",")]
            shortcut = tuple(values[5:8]) if len(values) > 5 else None
            listing = sass(compile_layer(DTYPES[dtype_name], *values[:5], shortcut=shortcut))
            opcodes = mix(listing)
            row = {**env, "kind": "sass", "backend": "tensorcore", "dtype": dtype_name, "layer": text,
                   "shortcut": shortcut is not None, "arch": "sm_90", "instructions": sum(opcodes.values()),
                   "mix": opcodes, "sha256": hashlib.sha256(listing.encode()).hexdigest()}
            out.write(json.dumps(row) + "\n")
            print(f"{text}: {row['instructions']} instructions, HGMMA {opcodes.get('HGMMA.64', 0)}, "
                  f"LDGSTS {opcodes.get('LDGSTS.E', 0)}", flush=True)


main(sys.argv[1], sys.argv[2], sys.argv[3:])
