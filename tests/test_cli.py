"""Every CLI command runs (on CPU, on tiny inputs) and writes what it says."""
import builtins
import contextlib
import copy
import io
import json
import re

import pytest

from sparsecnn.bench import FIELDS, read_jsonl, validate_row, write_jsonl
from sparsecnn.bench.report import model_speedups
from sparsecnn.cli import main
from sparsecnn.demo import _layer_table, run_demo
from sparsecnn.tuning import Candidate


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


@pytest.mark.slow
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


def test_bench_layers_peers_fail_at_once_naming_the_option(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPARSECNN_SPUTNIK_LIB", raising=False)
    out = tmp_path / "r.jsonl"
    assert main(["bench", "layers", "--suite", "dong", "--peers", "sputnik", "--device", "cpu", "--out", str(out)]) == 2
    assert "--peers sputnik: SPARSECNN_SPUTNIK_LIB is not set" in capsys.readouterr().err
    assert main(["bench", "layers", "--suite", "dong", "--peers", "nope", "--device", "cpu", "--out", str(out)]) == 2
    assert re.search(r"--peers nope: no peer adapter 'nope'.*sputnik", capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.slow
def test_demo_runs_and_reports_speedup(capsys):
    assert main(["demo", "--batch", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "relative error" in out and "CPU timings" in out and "speedup" in out
    assert "nan" not in out.lower()


def _table_rows(out: str) -> dict:
    """layer -> cells of the demo's per-layer table."""
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| layer | density | backend |")))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


@pytest.fixture(scope="module")
def lenet_demo():
    """(printed output, sparse model) of the demo on lenet5, batch 2, CPU."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model = run_demo("lenet5", 0.9, batch=2, device="cpu")["model"]
    return out.getvalue(), model


def test_demo_table_shows_the_running_backends_times_from_the_report(lenet_demo):
    out, model = lenet_demo
    assert "nan" not in out.lower()
    report = model.sparsecnn_report
    rows = _table_rows(out)
    assert list(rows) == [layer.name for layer in report.layers]
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        _, density, backend, time_ms, dense_ms, speedup, _ = rows[layer.name]
        runs = Candidate(module.backend, module.config).label()
        assert backend == runs
        expected = layer.time_ms if runs == layer.choice else layer.times_ms[runs]
        assert time_ms == f"{expected:.4f}" and dense_ms == f"{layer.dense_ms:.4f}"
        assert speedup == f"{layer.dense_ms / expected:.2f}x"
        assert density == f"{module.density:.3f}"


def test_demo_table_marks_unmeasured_times(lenet_demo, monkeypatch):
    model = lenet_demo[1]
    monkeypatch.setattr(model, "sparsecnn_report", copy.deepcopy(model.sparsecnn_report))
    layer = model.sparsecnn_report.layers[0]
    layer.dense_ms = float("nan")
    layer.dropped["dense"] = "slower than the drop ratio"
    table = _layer_table(model)
    cells = _table_rows(table)[layer.name]
    assert cells[4] == "-" and cells[5] == "-" and "nan" not in table
    assert f"- {layer.name}: dense not timed (dropped: slower than the drop ratio)" in table


def _model_row(backend: str, mode: str, median_ms: float, run: str = "r1", model: str = "lenet5",
               dtype: str = "fp32", n: int = 8) -> dict:
    row = dict.fromkeys(FIELDS)
    row.update(run=run, kind="model", device="cpu", torch="2.x", cudnn=None, triton=None, driver=None,
               commit="abc", date="2026-11-26T00:00:00Z", suite=None, model=model, N=n, dtype=dtype,
               sparsity=0.9, pattern="random", backend=backend, config=None, mode=mode,
               median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms, rel_err=None, floor_ms=None)
    return row


@pytest.fixture
def model_results(tmp_path):
    """A results file of model rows only: two runs, two models, two modes."""
    rows = [_model_row("cudnn", "eager", 2.0), _model_row("auto", "eager", 1.0),
            _model_row("cudnn", "cudagraph", 1.5), _model_row("auto", "cudagraph", 0.5),
            _model_row("cudnn", "eager", 4.0, run="r2", model="resnet18-cifar", dtype="fp16", n=32),
            _model_row("auto", "eager", 5.0, run="r2", model="resnet18-cifar", dtype="fp16", n=32)]
    path = tmp_path / "models.jsonl"
    write_jsonl(rows, path)
    return path


def test_report_plots_model_rows(model_results, tmp_path, capsys):
    plot = tmp_path / "models.png"
    assert main(["report", str(model_results), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000
    assert model_speedups(read_jsonl(model_results)) == {
        "lenet5 N=8 fp32 s=0.9": {"auto eager": 2.0, "auto cudagraph": 3.0},
        "resnet18-cifar N=32 fp16 s=0.9": {"auto eager": 0.8}}


def test_report_compares_model_rows_within_a_run_only(tmp_path, capsys):
    path = tmp_path / "models.jsonl"
    write_jsonl([_model_row("cudnn", "eager", 2.0, run="r1"), _model_row("auto", "eager", 1.0, run="r2")], path)
    assert model_speedups(read_jsonl(path)) == {}
    assert main(["report", str(path), "--plot", str(tmp_path / "p.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err


def _without(monkeypatch, package: str) -> None:
    """Make `import <package>` (and its submodules) fail as if it were not installed."""
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)


def test_plot_without_matplotlib_names_the_plot_extra(model_results, tmp_path, monkeypatch, capsys):
    _without(monkeypatch, "matplotlib")
    assert main(["report", str(model_results)]) == 0  # tables need no matplotlib
    assert main(["report", str(model_results), "--plot", str(tmp_path / "p.png")]) == 2
    assert "plotting needs matplotlib: pip install 'sparsecnn[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_digits_without_scikit_learn_names_the_data_extra(tmp_path, monkeypatch, capsys):
    from sparsecnn.data import load_digits_split

    _without(monkeypatch, "sklearn")
    with pytest.raises(ImportError, match=re.escape("pip install 'sparsecnn[data]'")):
        load_digits_split()
    assert main(["prune", "lenet5", "--data", "digits", "--device", "cpu", "-o", str(tmp_path / "c.pt")]) == 2
    assert "needs scikit-learn: pip install 'sparsecnn[data]'" in capsys.readouterr().err
    assert not (tmp_path / "c.pt").exists()
