"""benchmarks/tensorcore_probe_rows.py, what the tensorcore layer probes share (they run on a GPU):
a DLMC layer's seeded inputs and fp64 reference, and the rows they write, checked on the CPU."""
import json

import pytest
import torch
from helpers.common import require
from helpers.scripts import script_module

from sparsecnn.backends.tensorcore.format import pack_units

probe_rows = script_module("tensorcore_probe_rows")


def test_a_layer_and_its_row(tmp_path):
    require("dlmc")
    rows = probe_rows.ProbeRows(str(tmp_path / "rows.jsonl"), 1, torch.float32, "fp32", torch.device("cpu"))
    spec, x, bias, weight, ref = rows.layer("layer4.1.conv2")
    assert x.shape == (1, 512, 7, 7) and x.is_contiguous(memory_format=torch.channels_last)
    assert weight.shape == (512, 512, 3, 3) and float(weight.ne(0).float().mean()) == pytest.approx(0.1, abs=0.01)
    again = rows.layer("layer4.1.conv2")
    assert torch.equal(again[1], x) and torch.equal(again[3], weight)  # seeded
    expected = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(), 1, 1)
    assert ref.dtype == torch.float64 and torch.allclose(ref, expected)
    extra = probe_rows.unit_counts(pack_units(weight, 64, 32, "index"))
    assert 0 < extra["max_group_units"] <= extra["units"]
    row = rows.emit(spec, "cudnn", {"bias": True}, {"median_ms": 0.02}, 1e-4, extra)
    written = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
    assert written == [row] and row["layer"] == "layer4.1.conv2" and row["pattern"] == probe_rows.PATTERN
    assert (row["N"], row["C"], row["K"], row["dtype"], row["units"]) == (1, 512, 512, "fp32", extra["units"])
