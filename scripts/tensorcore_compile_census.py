"""How many Triton kernels tuning compiles for backend `tensorcore` on a model (CPU, no GPU needed).

For every conv of the zoo model at batch N, the weight of `bench.patterns.make_weight` (PATTERN,
0.9), the tensorcore auto configs for DTYPE on a GPU of --arch (its SM count decides the small-grid
launches), optionally cut by `kernel.least_work_configs` as the tuner does since dd5bc43 (--all
keeps every auto config), each with the layer's ResNet epilogue (relu; relu + residual for conv3;
none for downsample): the distinct specializations Triton compiles, i.e. the kernel's constexprs
and launch options plus, per runtime int, Triton's own specialization (== 1, divisible by 16).

    SPARSECNN_DLMC=... PYTHONPATH=src python scripts/tensorcore_compile_census.py resnet50 32 fp16 \\
        tiles64x32i-dlmc-magnitude_pruning [--all] [--breakdown]
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

from sparsecnn.backends.tensorcore import kernel
from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.tma_kernel import unit_slots
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core import device
from sparsecnn.layers.suites import get_suite


def epilogue(name: str):
    """(relu, residual) of a zoo ResNet conv after BatchNorm folding and fusion."""
    if name.endswith("conv3"):
        return True, True
    return ("downsample" not in name), False


def int_specialization(value: int) -> str:
    return "1" if value == 1 else ("D" if value % 16 == 0 else "")


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model")
parser.add_argument("batch", type=int)
parser.add_argument("dtype", choices=("fp16", "bf16", "tf32"))
parser.add_argument("pattern")
parser.add_argument("--arch", default="90")
parser.add_argument("--all", action="store_true", help="every auto config, not only least_work_configs'")
parser.add_argument("--breakdown", action="store_true",
                    help="also count the compiles left if Triton did not specialize the runtime ints, if SLOTS "
                         "were one value, and both (what each costs in compiles; kernel speed not measured)")
args = parser.parse_args()
mock.patch.object(device, "current", lambda: device.for_arch(args.arch)).start()
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32}[args.dtype]
compiles, configs_timed = set(), 0
without_ints, one_slots, neither = set(), set(), set()
for spec in get_suite(args.model, args.batch):
    if spec.groups != 1:
        continue
    weight, _ = make_weight(spec, 0.9, args.pattern, 0, "cpu")
    configs = kernel.auto_configs(spec, dtype)
    configs = configs if args.all else kernel.least_work_configs(weight, configs)
    configs_timed += len(configs)
    relu, residual = epilogue(spec.name)
    for config in configs:
        packed = pack_units(weight, *config.packing[:2])
        ints = (spec.N * spec.P * spec.Q, spec.H, spec.W, spec.C, spec.P, spec.Q, spec.K, spec.S, *spec.stride,
                *spec.padding, packed.num_groups, packed.unit_code.shape[1])
        constants = (config, kernel._row_align(spec.C, config.chunk), spec.C % config.chunk == 0, relu, residual,
                     unit_slots(packed.max_units))
        specialized = tuple(map(int_specialization, ints))
        compiles.add((constants, specialized))
        without_ints.add(constants)
        one_slots.add((constants[:-1], specialized))
        neither.add(constants[:-1])
print(f"{args.model} N={args.batch} {args.dtype} {args.pattern}: {configs_timed} configs timed, "
      f"{len(compiles)} distinct Triton compiles ({'every auto config' if args.all else 'least_work_configs'})")
if args.breakdown:
    print(f"without int specialization {len(without_ints)}, with one SLOTS value {len(one_slots)}, "
          f"with neither {len(neither)}")
