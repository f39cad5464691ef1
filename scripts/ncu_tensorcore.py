"""Run one DLMC ResNet-50 layer through the `tensorcore` kernel 3 times, for Nsight Compute: profile
the third launch, e.g. `ncu --clock-control none -k regex:_unit_conv_kernel --launch-skip 2
--launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats
python scripts/ncu_tensorcore.py layer4.1.conv2 64,32,64,4,3`.
Usage: python scripts/ncu_tensorcore.py LAYER GROUP,CHUNK,BLOCK_M,WARPS,STAGES [BATCH] (fp16, masks
tiles64x32i-dlmc-magnitude_pruning at 0.9, index order)
"""
import sys

import torch

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.bench.patterns import make_weight
from sparsecnn.layers.suites import get_suite

layer, fields = sys.argv[1], [int(v) for v in sys.argv[2].split(",")]
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 32
spec = {s.name: s for s in get_suite("resnet50", batch)}[layer]
config = TensorCoreConfig(*fields, order="index")
weight = make_weight(spec, 0.9, "tiles64x32i-dlmc-magnitude_pruning", 0, "cpu")[0].to("cuda", torch.float16)
packed = pack_units(weight, config.group, config.chunk, "index")
x = torch.randn(spec.N, spec.C, spec.H, spec.W, device="cuda", dtype=torch.float16).contiguous(
    memory_format=torch.channels_last)
for _ in range(3):
    unit_conv(x, packed, spec.stride, spec.padding, config)
torch.cuda.synchronize()
print(layer, config, "units", packed.num_units)
