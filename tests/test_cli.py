"""Every CLI command runs (on CPU, on tiny inputs) and writes what it says."""
import json

import pytest

from sparsecnn.bench import validate_row
from sparsecnn.cli import main


def test_layers_prints_a_suite(capsys):
    assert main(["layers", "--suite", "pietron-r50-1x1"]) == 0
    out = capsys.readouterr().out
    assert "r50-1x1-256-64" in out and "| 128 |" in out


def test_backends_lists_the_baselines(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("dense", "im2col-cublas", "im2col-cusparse"))


def test_bad_suite_is_a_clear_error(capsys):
    assert main(["layers", "--suite", "nope"]) == 2
    assert "unknown suite" in capsys.readouterr().err


def test_bench_layers_model_and_report(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    assert main(["bench", "layers", "--suite", "dong", "--batch", "1", "--layers", "lenet-conv1,alexnet-conv3",
                 "--device", "cpu", "--out", str(results)]) == 0
    assert main(["bench", "model", "lenet5", "--batch", "2", "--modes", "eager", "--backend", "im2col-cusparse",
                 "--device", "cpu", "--out", str(results)]) == 0
    assert "tuning time:" not in capsys.readouterr().out
    assert main(["bench", "model", "lenet5", "--batch", "2", "--modes", "eager", "--device", "cpu",
                 "--out", str(results)]) == 0
    assert "tuning time: reference pass" in capsys.readouterr().out
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    for row in rows:
        validate_row(row)
    assert {row["kind"] for row in rows} == {"layer", "model"}
    assert {row["layer"] for row in rows if row["kind"] == "layer"} == {"lenet-conv1", "alexnet-conv3"}
    plot, page = tmp_path / "speedup.png", tmp_path / "report.md"
    assert main(["report", str(results), "--plot", str(plot), "--md", str(page), "--plot-dir", str(tmp_path)]) == 0
    assert plot.stat().st_size > 1000 and "lenet-conv1" in page.read_text()


def test_bench_layers_rejects_unknown_layers(tmp_path, capsys):
    assert main(["bench", "layers", "--suite", "dong", "--layers", "nope", "--out", str(tmp_path / "r")]) == 2
    assert "--layers" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--batch", "2", "--device", "cpu"]])
def test_demo_runs_and_reports_speedup(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "relative error" in out and "CPU timings" in out and "speedup" in out
