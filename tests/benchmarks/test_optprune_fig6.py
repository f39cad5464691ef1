"""`benchmarks/optprune_fig6.py` (OptPrune Sec. 4.2 / Fig. 6) in its CPU smoke mode: the script run
as a user runs it (a fresh interpreter, Triton in its interpreter), its rows checked (K values, one
given dense block, tiles, errors, the schema), and its analysis on made-up curves."""
import json
import math

import pytest
from helpers.common import needs
from helpers.scripts import run_script, script_module

from sparsecnn.bench.schema import FIELDS, validate_row


@pytest.mark.slow
@needs("triton")
def test_smoke_run_on_cpu(tmp_path):
    out, png = tmp_path / "fig6.jsonl", tmp_path / "fig6.png"
    ks = [1, 2, 3, 16, 17, 31, 32, 33]
    done = run_script("optprune_fig6", tmp_path, out, "--device", "cpu", "--smoke", "--configs", "tiles", "--kernel-sizes", "3,1",
                "--plot", png)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * len(ks) * 2  # two kernel sizes, every K, cuDNN and blocks
    assert len({row["run"] for row in rows}) == 1
    for row in rows:
        validate_row({**{name: row[name] for name in FIELDS}, "kind": "layer"})
        assert row["kind"] == "optprune-fig6" and row["suite"] == "optprune-fig6" and row["layer"] == row["shape"]
        assert (row["N"], row["C"], row["H"], row["W"], row["stride"]) == (1, 4, 6, 6, 1)
        assert row["R"] == row["S"] and row["padding"] == row["R"] // 2 and row["shape"] == f"k{row['R']}-c4-h6-n1"
        assert (row["sparsity"], row["pattern"], row["dtype"]) == (0.0, "dense", "fp32")
        assert row["rel_err"] < 1e-5
    for r in (1, 3):
        for backend in ("cudnn", "blocks"):
            assert sorted(row["K"] for row in rows if row["R"] == r and row["backend"] == backend) == ks
    for row in rows:
        if row["backend"] == "cudnn":
            assert row["config"] is None and row["candidates"] is None
            continue
        # --configs tiles: block_m 16, 32, ... up to K's power of two; the fastest one reported
        widest = max(16, 1 << (row["K"] - 1).bit_length())
        assert [c["config"]["block_m"] for c in row["candidates"]] == [m for m in (16, 32, 64, 128) if m <= widest]
        assert row["median_ms"] == min(c["median_ms"] for c in row["candidates"])
        assert all(c["rel_err"] < 1e-5 for c in row["candidates"])
        assert row["config"]["precision"] == "tf32x3"  # fp32-level error on tensor cores (TF32 off)
        assert row["tiles"] == math.ceil(row["K"] / row["config"]["block_m"])  # one block: no remainder tiles
    assert "fit t =" in done.stdout and "at multiples of 32: 32->33" in done.stdout
    assert png.stat().st_size > 0
    replot = run_script("optprune_fig6", tmp_path, out, "--replot")
    assert "k1-c4-h6-n1 blocks: 8 K values" in replot.stdout


def test_k_values_and_their_order():
    fig6 = script_module("optprune_fig6")
    assert fig6.parse_ks("1-4,8-20:4, 7,3") == [1, 2, 3, 4, 7, 8, 12, 16, 20]
    default = fig6.parse_ks(fig6.DEFAULT_KS)
    assert default[:65] == list(range(1, 66)) and default[-1] == 256
    assert all(k - 1 in default and k + 1 in default for k in range(32, 256, 32))
    assert 255 in default
    with pytest.raises(ValueError, match="bad K range"):
        fig6.parse_ks("5-2")
    order = fig6.coarse_to_fine(default)
    assert sorted(order) == default and order[:3] == [1, 31, 32]
    first_pass = order[:order.index(8)]  # before the first multiple of 8 that is not a multiple of 32
    assert {k for k in default if k % 32 in (0, 1, 31)} <= set(first_pass)


def test_analysis_tells_a_line_from_steps_at_32():
    fig6 = script_module("optprune_fig6")
    ks = list(range(1, 100))
    line = {k: 0.5 + 0.01 * k for k in ks}
    stepped = {k: 1.0 + math.ceil(k / 32) for k in ks}  # cuDNN-like: jumps 1.5x, 1.33x, 1.25x at 33, 65, 97
    fit = fig6.linear_fit(ks, [line[k] for k in ks])
    assert fit["slope"] == pytest.approx(0.01) and fit["intercept"] == pytest.approx(0.5)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_dev"] == pytest.approx(0.0, abs=1e-12)
    found = fig6.steps(stepped)
    assert found["median_jump"] == pytest.approx(4 / 3) and found["median_other"] == pytest.approx(1.0)
    assert fig6.steps(line)["median_jump"] < 1.05

    def rows(times, backend):
        return [{"run": "r", "device": "d", "dtype": "fp32", "shape": "s", "backend": backend, "K": k, "median_ms": t}
                for k, t in times.items()]

    text = fig6.report(rows(line, "blocks") + rows(stepped, "cudnn"), 0.1)
    blocks, cudnn = text.split("s cudnn")[0], text.split("s cudnn")[1]
    assert "-> linear" in blocks and "-> no steps at multiples of 32" in blocks
    assert "-> not linear" in cudnn and "-> steps at multiples of 32" in cudnn
