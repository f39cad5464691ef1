"""scripts/codegen_mode_sass.py: both codegen modes compiled offline for sm_90 and their SASS compared (CPU)."""
import importlib.util
import json
import sys

import pytest
from helpers.codegen import needs_tools
from helpers.common import ROOT


def _run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["codegen_mode_sass.py", *argv])
    spec = importlib.util.spec_from_file_location("codegen_mode_sass", ROOT / "scripts" / "codegen_mode_sass.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@needs_tools
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_both_modes_make_the_same_fmas_loads_and_stores(tmp_path, monkeypatch, dtype):
    out = tmp_path / "rows.jsonl"
    _run(monkeypatch, str(out), dtype, "5,7,3,9", "3,4,3,13,2")  # C, K off any tile; H=13, stride 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["layer"] for row in rows] == ["5,7,3,9", "3,4,3,13,2"]
    for row in rows:
        rewrite, emit = row["rewrite"]["mix"], row["emit"]["mix"]
        assert row["slices"] >= 1 and 0 <= row["identical_slices"] <= row["slices"] and row["differing_lines"] >= 0
        assert rewrite["FFMA"] > 0  # the default config accumulates in float in both dtypes
        for opcode in ("FFMA", "LDS", "LDG", "STG"):  # index math and moves may differ (HFMA2 moves too)
            assert rewrite.get(opcode) == emit.get(opcode), opcode
        assert row["commit"] and row["toolchain"].endswith("sm_90") and row["emit"]["total_s"] > 0


def test_bad_arguments_print_the_usage(monkeypatch):
    with pytest.raises(SystemExit, match="Usage"):
        _run(monkeypatch, "out.jsonl", "fp64", "3,4,3,8")
