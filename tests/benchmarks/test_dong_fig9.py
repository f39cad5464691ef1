"""`benchmarks/dong_fig9.py` (Dong Sec. 3.3 / Fig. 9) in its CPU smoke mode: the script run as a user
runs it (a fresh interpreter, Triton in its interpreter), its rows checked (structured shapes, the
fastest sparse candidate, errors, the schema), and its pure parts on the real dong suite."""
import json
import math

import pytest
from helpers.common import needs
from helpers.scripts import run_script, script_module

from sparsecnn.bench.schema import FIELDS, read_jsonl, validate_row
from sparsecnn.layers.suites import get_suite


def test_structured_shapes_follow_the_paper_on_the_dong_suite():
    fig9 = script_module("dong_fig9")
    for spec in get_suite("dong", batch=64):
        shapes = fig9.structured_shapes(spec)
        # the paper skips PC on exactly its three layers of 1 or 3 input channels; Both is then PF
        if spec.name in ("lenet-conv1", "alexnet-conv1", "vgg-conv1"):
            assert "PC" not in shapes and shapes["Both"] == shapes["PF"] == (spec.C, spec.K // 2)
        else:
            assert shapes == {"PC": (spec.C // 2, spec.K), "PF": (spec.C, spec.K // 2),
                              "Both": (spec.C // 2, spec.K // 2)}, spec.name
    assert fig9.SPARSITY == {"PC": 0.5, "PF": 0.5, "Both": 0.8}
    assert fig9.PAPER[64] == {"PC": 1.3, "PF": 2.1, "Both": 2.1}
    assert {"codegen", "direct", "blocks", "staged", "unrolled"} <= set(fig9.our_backends())
    assert not {"dense", "dense-tf32", "im2col-cublas", "im2col-cusparse"} & set(fig9.our_backends())


@pytest.mark.slow
@needs("triton")
def test_smoke_run_on_cpu(tmp_path):
    out, raw, png = tmp_path / "fig9.jsonl", tmp_path / "raw.jsonl", tmp_path / "fig9.png"
    # codegen does not run on the CPU: left out with a note; blocks in Triton's interpreter;
    # im2col-cusparse: a second CPU backend, so the fastest of several is picked
    done = run_script("dong_fig9", tmp_path, out, 1, "fp32", "--device", "cpu", "--smoke", "--configs", "refine",
                "--backends", "blocks,im2col-cusparse,codegen", "--raw", raw, "--plot", png)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    full = {spec.name: spec for spec in get_suite("dong", batch=1)}
    expected = {"lenet-conv1": {"Dense": (1, 20), "PF": (1, 10), "Both": (1, 10)},
                "alexnet-conv3": {"Dense": (32, 64), "PC": (16, 64), "PF": (32, 32), "Both": (16, 32)}}
    assert len(rows) == 5 + 7 and {row["layer"] for row in rows} == set(expected)
    run = rows[0]["run"]
    pairs = {}
    for row in rows:
        validate_row({**{name: row[name] for name in FIELDS}, "kind": "layer"})
        assert row["kind"] == "dong-fig9" and row["run"] == run and row["suite"] == "dong"
        assert row["N"] == 1 and row["H"] == row["W"] == 8 and row["dtype"] == "fp32"  # smoke: inputs cut to 8x8
        spec = full[row["layer"]]
        assert (row["full_C"], row["full_K"], row["R"], row["padding"]) == (spec.C, spec.K, spec.R, spec.padding[0])
        assert row["rel_err"] < 1e-5
        pairs.setdefault(row["layer"], {}).setdefault(row["variant"], {})[row["role"]] = row
    for layer, variants in expected.items():
        assert set(pairs[layer]) == set(variants), layer
        dense = pairs[layer]["Dense"]["dense"]
        assert (dense["C"], dense["K"], dense["backend"], dense["sparsity"]) == (*variants["Dense"], "cudnn", 0.0)
        for variant in set(variants) - {"Dense"}:
            pruned, ours = pairs[layer][variant]["structured-dense"], pairs[layer][variant]["sparse-best"]
            c, k = variants[variant]
            assert (pruned["C"], pruned["K"], pruned["backend"], pruned["config"]) == (c, k, "cudnn", None)
            assert pruned["pattern"] == f"structured-{variant.lower()}"
            assert pruned["sparsity"] == pytest.approx(1 - c * k / (variants["Dense"][0] * variants["Dense"][1]))
            assert (ours["C"], ours["K"], ours["pattern"]) == (*variants["Dense"], "random")
            assert ours["sparsity"] == {"PC": 0.5, "PF": 0.5, "Both": 0.8}[variant]
            assert ours["speedup"] == pruned["speedup"] == pytest.approx(pruned["median_ms"] / ours["median_ms"])
            assert ours["dense_ms"] == dense["median_ms"]
            backends = {candidate["backend"] for candidate in ours["candidates"]}
            assert backends == {"blocks", "im2col-cusparse"}  # codegen left out on the CPU
            assert ours["backend"] in backends
    # sparse-best is the fastest of its candidates: check against every raw row of that layer and sparsity
    raw_rows = read_jsonl(raw)
    assert all(row["run"] == run for row in raw_rows)
    for layer, variants in pairs.items():
        for variant, pair in variants.items():
            if variant == "Dense":
                continue
            ours = pair["sparse-best"]
            timed = [row for row in raw_rows if row["layer"] == layer and row["sparsity"] == ours["sparsity"]
                     and row["backend"] != "cudnn"]
            assert len(timed) == len(ours["candidates"]) >= 2
            assert ours["median_ms"] == min(row["median_ms"] for row in timed)
    assert "codegen skipped: codegen does not run on cpu" in done.stdout + done.stderr
    assert "PC  : geomean" in done.stdout and "(paper: 1.5x)" in done.stdout  # Both at N=1
    assert png.stat().st_size > 0
    replot = run_script("dong_fig9", tmp_path, out, "--replot")
    assert f"(run {run})" in replot.stdout and "PF  : geomean" in replot.stdout


def test_report_compares_with_the_paper():
    fig9 = script_module("dong_fig9")

    def row(layer, variant, role, ms):
        return {"run": "r", "device": "d", "N": 64, "dtype": "fp32", "mode": "gpu", "layer": layer, "variant": variant,
                "role": role, "median_ms": ms, "C": 8, "K": 8, "backend": "x", "config": None}

    rows = [row("a", "Dense", "dense", 4.0), row("a", "PC", "structured-dense", 2.0),
            row("a", "PC", "sparse-best", 1.0), row("b", "PC", "structured-dense", 2.0),
            row("b", "PC", "sparse-best", 4.0)]
    text = fig9.report(rows)
    assert "PC  : geomean 1.00x, mean 1.25x, min 0.50x, max 2.00x over 2 layers (paper: 1.3x)" in text
    assert "PF  : no pair measured (paper: 2.1x)" in text
    assert math.isclose(fig9._geomean([2.0, 8.0]), 4.0)
