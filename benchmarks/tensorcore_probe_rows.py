"""What the `tensorcore` layer probes (`tensorcore_loads_probe.py`, `tensorcore_launch_probe.py`)
share: a DLMC ResNet-50 layer's inputs, weight and fp64 reference, and their JSON-lines rows.
Imports no CUDA: the device is the caller's."""
import json

import torch
import torch.nn.functional as F

from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.layers.suites import get_suite

PATTERN = "tiles64x32i-dlmc-magnitude_pruning"  # channel-run tiles of 64 x units of 32, 0.9


class ProbeRows:
    """The layers of the resnet50 suite at `batch` in `dtype` (named `dtype_name` in the rows) on
    `device`; `emit` appends one row to `out_path` and prints it."""

    def __init__(self, out_path: str, batch: int, dtype: torch.dtype, dtype_name: str, device: torch.device):
        self.out_path, self.dtype, self.device = out_path, dtype, device
        self.base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50",
                     "dtype": dtype_name, "sparsity": 0.9, "mode": "gpu", "pattern": PATTERN}
        self.specs = {spec.name: spec for spec in get_suite("resnet50", batch)}

    def layer(self, name: str):
        """(spec, x (N, C, H, W) channels_last, bias (K,), weight (K, C, R, S), conv(x, weight) +
        bias in fp64) of layer `name`, seeded, on the device in the dtype."""
        spec = self.specs[name]
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(self.device, self.dtype).contiguous(
            memory_format=torch.channels_last)
        bias = torch.randn(spec.K, generator=gen).to(self.device, self.dtype)
        weight = make_weight(spec, 0.9, PATTERN, 0, "cpu")[0].to(self.device, self.dtype)
        ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
        return spec, x, bias, weight, ref

    def emit(self, spec, backend: str, config, timing: dict, err: float, extra=None) -> dict:
        row = {**self.base, "layer": spec.name, "N": spec.N, "C": spec.C, "K": spec.K, "H": spec.H, "W": spec.W,
               "R": spec.R, "S": spec.S, "stride": spec.stride[0], "padding": spec.padding[0],
               "backend": backend, "config": config, **timing, "rel_err": err, **(extra or {})}
        with open(self.out_path, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{spec.name:22s} {backend:12s} {timing['median_ms'] * 1e3:7.1f} us err {err:.1e} {config}", flush=True)
        return row


def unit_counts(packed) -> dict:
    """The row extras of a `UnitWeights`: its units in all and the most any group keeps."""
    counts = (packed.group_start[1:] - packed.group_start[:-1]).tolist()
    return {"units": packed.num_units, "max_group_units": max(counts)}
