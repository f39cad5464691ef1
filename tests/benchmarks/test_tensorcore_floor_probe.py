"""benchmarks/floor_kernels.py and tensorcore_floor_probe.py on the CPU (Triton's interpreter): the
floor kernels compute what their reference says on odd shapes, and the probe writes its rows and
summary (the speeds are meaningless here; the values are not)."""
import json

import pytest
import torch
from helpers.common import needs_interpreter, require
from helpers.scripts import run_script, script_module

from sparsecnn.core.reference import relative_error
from sparsecnn.core.spec import ConvSpec

SPECS = [ConvSpec(2, 3, 33, 13, 13, 3, 3, 1, 1),      # C=3, K=33 (two groups, the second of 1 channel)
         ConvSpec(1, 130, 160, 14, 14, 1, 1, 2, 0),   # strided 1x1, a channel share off the block
         ConvSpec(3, 96, 64, 9, 7, 3, 3, 2, 1)]       # strided 3x3 on a non-square input


@pytest.fixture(scope="module")
def floor_kernels():
    return script_module("floor_kernels")


@needs_interpreter
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("indexed", [False, True])
def test_the_floor_kernel_sums_each_groups_share_of_the_centre_pixel(floor_kernels, spec, indexed):
    x = torch.randn(spec.N, spec.C, spec.H, spec.W).contiguous(memory_format=torch.channels_last)
    y = floor_kernels.floor_layer(x, spec, indexed)
    assert y.shape == (spec.N * spec.P * spec.Q, spec.K)
    assert relative_error(y, floor_kernels.floor_reference(x, spec)) < 1e-6
    floor_kernels.launch_only(spec, torch.zeros(1))


@needs_interpreter
def test_the_floor_refuses_layouts_and_layers_it_does_not_model(floor_kernels):
    spec = SPECS[0]
    with pytest.raises(ValueError, match="channels_last"):
        floor_kernels.floor_layer(torch.randn(spec.N, spec.C, spec.H, spec.W), spec, False)
    valid = ConvSpec(1, 8, 8, 9, 9, 3, 3, 1, 0)   # 'valid' padding: its centre tap is not the output pixel
    with pytest.raises(ValueError, match="centre tap"):
        floor_kernels.floor_layer(torch.randn(1, 8, 9, 9).contiguous(memory_format=torch.channels_last), valid, False)


@needs_interpreter
def test_the_probe_times_cudnn_ours_and_the_floors_and_sums_them_up(tmp_path):
    require("dlmc")
    out = tmp_path / "rows.jsonl"
    done = run_script("tensorcore_floor_probe", tmp_path, out, 1, "fp16", "layer4.1.conv2", timeout_s=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    backends = [row["backend"] for row in rows]
    assert backends[0] == "cudnn" and backends[-3:] == ["launch-only", "floor", "floor-indexed"]
    assert set(backends[1:-3]) == {"tensorcore"}
    assert all(row["layer"] == "layer4.1.conv2" and row["N"] == 1 for row in rows)
    assert all(row["rel_err"] < 2e-3 for row in rows if row["backend"] != "launch-only")
    assert "layer4.1.conv2" in done.stdout and "geomean over cuDNN" in done.stdout
