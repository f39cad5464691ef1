"""benchmarks/tensorcore_shortcut_probe.py on the CPU (Triton's interpreter): one block, one config,
its rows and summary line (the speeds are meaningless here; the errors are not)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.common import needs_interpreter, require

ROOT = Path(__file__).resolve().parents[2]


@needs_interpreter
def test_the_probe_times_cudnn_two_kernels_and_one_and_checks_them(tmp_path):
    require("dlmc")
    out = tmp_path / "rows.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "tensorcore_shortcut_probe.py", str(out), "1", "fp16", "layer4.0", "1"],
                          cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["backend"] for row in rows] == ["cudnn", "tensorcore-separate", "tensorcore-shortcut"]
    assert all(row["layer"] == "layer4.0.conv3" and row["shortcut_layer"] == "layer4.0.downsample.0" for row in rows)
    assert rows[2]["shortcut_stride"] == 2 and rows[2]["units"] > rows[1]["units"]  # conv3's units and the shortcut's
    assert all(row["rel_err"] < 2e-3 for row in rows)
    assert "layer4.0: cuDNN" in done.stdout and "over two" in done.stdout and "one kernel per block saves" in done.stdout
