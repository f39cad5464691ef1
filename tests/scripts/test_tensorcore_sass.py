"""scripts/tensorcore_sass.py: the tensorcore pointer kernel compiled offline for sm_90 (CPU), plain and
with a folded shortcut: wgmma and 128-bit asynchronous copies in both loops. Run in a process of its
own without TRITON_INTERPRET (the interpreter replaces the kernels the script compiles)."""
import json
import os
import subprocess
import sys

from helpers.common import ROOT


def test_the_shortcut_loop_has_the_main_loops_instructions(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "tensorcore_sass.py"), str(out), "fp16",
                           "64,256,1,56,1", "64,256,1,56,1,64,56,1"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, folded = (json.loads(line) for line in out.read_text().splitlines())
    assert (plain["shortcut"], folded["shortcut"]) == (False, True) and plain["sha256"] != folded["sha256"]
    assert plain["mix"]["HGMMA.64"] > 0 and folded["mix"]["HGMMA.64"] == 2 * plain["mix"]["HGMMA.64"]
    assert folded["mix"]["LDGSTS.E"] == 2 * plain["mix"]["LDGSTS.E"]  # the shortcut's loads are 128-bit copies too
