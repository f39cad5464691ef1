"""benchmarks/peers_summary.py: our fastest backend per layer against each peer variant, and the
headline entries it writes, recomputed as tests/benchmarks/test_headline.py recomputes every entry."""
import json

import pytest
from helpers.scripts import run_script, script_module
from test_headline import layer_geomean

summary = script_module("peers_summary")
ENV = {"device": "NVIDIA H200", "commit": "abc1234", "torch": "2.11", "cudnn": 91900, "triton": "3.6.0",
       "driver": "580"}


def _row(run, date, layer, backend, dtype, ms, n=1):
    return {**ENV, "run": run, "date": date, "kind": "layer", "suite": "resnet50", "layer": layer, "N": n,
            "dtype": dtype, "sparsity": 0.9, "pattern": "dlmc-magnitude_pruning", "backend": backend,
            "config": {"part": "conv"} if backend.startswith("peer:") else None, "median_ms": ms}


def _run(run="r1", date="2026-11-26T10:00:00Z", scale=1.0):
    """Two layers: ours = the faster of unrolled and codegen; cuDNN at fp32 and tf32; two peer variants."""
    rows = []
    for layer, unrolled, codegen, peer, kernel in (("a", 2.0, 4.0, 1.0, 0.5), ("b", 9.0, 3.0, 6.0, 3.0)):
        rows += [_row(run, date, layer, "cudnn", "fp32", 5.0), _row(run, date, layer, "cudnn", "tf32", 2.5),
                 _row(run, date, layer, "unrolled", "fp32", unrolled * scale),
                 _row(run, date, layer, "codegen", "fp32", codegen * scale),
                 _row(run, date, layer, "peer:sparsert", "fp32", peer),
                 _row(run, date, layer, "peer:sparsert-kernel", "fp32", kernel)]
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _headline(tmp_path, entries=()):
    path = tmp_path / "headline.json"
    path.write_text(json.dumps({"entries": list(entries)}))
    return path


def test_ours_is_the_fastest_of_our_backends_per_layer():
    layers = summary.layer_table(_run(), "fp32")
    assert {layer: slot["ours"]["backend"] for layer, slot in layers.items()} == {"a": "unrolled", "b": "codegen"}
    assert layers["a"]["cudnn"]["dtype"] == "fp32"  # cuDNN at the peers' dtype, not TF32's row
    assert summary.speedups(layers, "peer:sparsert") == pytest.approx([1.0 / 2.0, 6.0 / 3.0])


def test_the_cudnn_column_is_pytorchs_default_tf32_for_fp32_and_fp16_as_is():
    """Ours (2.0 and 3.0 ms) over cuDNN TF32 (2.5 ms), not over cuDNN fp32 with TF32 off (5.0 ms)."""
    rows = _run()
    assert summary.cudnn_default_speedups(rows, summary.layer_table(rows, "fp32"), "fp32") == \
        pytest.approx([2.5 / 2.0, 2.5 / 3.0])
    half = [dict(row, dtype="fp16") for row in rows if row["dtype"] == "fp32"]
    assert summary.cudnn_default_speedups(half, summary.layer_table(half, "fp16"), "fp16") == \
        pytest.approx([5.0 / 2.0, 5.0 / 3.0])


def test_two_rows_of_one_peer_for_a_layer_are_refused():
    rows = _run() + [_row("r1", "2026-11-26T10:00:00Z", "a", "peer:sparsert", "fp32", 1.5)]
    with pytest.raises(ValueError, match="two peer:sparsert rows for layer a"):
        summary.layer_table(rows, "fp32")


def test_entries_are_recomputed_by_the_headline_check(tmp_path):
    results = _write(tmp_path / "rows.jsonl", _run())
    headline = _headline(tmp_path, [{"name": "kept", "readme": True}])
    summary.main([str(results), "--headline", str(headline)])
    entries = {entry["name"]: entry for entry in json.loads(headline.read_text())["entries"]}
    assert set(entries) == {"kept", "peers resnet50 fp32 N=1: ours vs sparsert",
                            "peers resnet50 fp32 N=1: ours vs sparsert-kernel"}
    entry = entries["peers resnet50 fp32 N=1: ours vs sparsert"]
    assert entry["ratio"] == pytest.approx((0.5 * 2.0) ** 0.5, rel=1e-3)
    assert entry["rows"]["backends"] == ["codegen", "unrolled"] and entry["readme"] is False
    count, ratio = layer_geomean(entry, _run())
    assert count == entry["rows"]["N"] == 2 and ratio == pytest.approx(entry["ratio"], rel=1e-3)


def test_the_newest_run_of_a_cell_wins_and_readme_flags_are_kept(tmp_path):
    old = _write(tmp_path / "old.jsonl", _run("r0", "2026-11-25T10:00:00Z", scale=10.0))
    new = _write(tmp_path / "new.jsonl", _run("r1", "2026-11-26T10:00:00Z"))
    name = "peers resnet50 fp32 N=1: ours vs sparsert"
    headline = _headline(tmp_path, [{"name": name, "readme": True, "ratio": 9.0}])
    summary.main([str(new), str(old), "--headline", str(headline)])
    entry = next(e for e in json.loads(headline.read_text())["entries"] if e["name"] == name)
    assert entry["rows"]["runs"] == ["r1"] and entry["file"] == str(new) and entry["readme"] is True
    assert entry["ratio"] == pytest.approx(1.0, rel=1e-3)


@pytest.mark.slow
def test_the_script_prints_the_table(tmp_path):
    results = _write(tmp_path / "rows.jsonl", _run())
    headline = _headline(tmp_path)
    done = run_script("peers_summary", tmp_path, results, "--headline", headline)
    assert "| a | 5000.0 | 2000.0 | unrolled | 1000.0 | 500.0 |" in done.stdout
    assert "ours over sparsert: geomean 1.00x (0.50-2.00x, 2 layers)" in done.stdout


def test_a_cell_run_one_layer_per_process_takes_each_layers_newest_run(tmp_path):
    """Layers from separate runs of one file form one cell; a rerun of a layer replaces its older run."""
    rows = _run("r1", "2026-11-26T10:00:00Z", scale=10.0)
    per_layer = [row for row in _run("r2", "2026-11-26T11:00:00Z") if row["layer"] == "a"]
    per_layer += [row for row in _run("r3", "2026-11-26T12:00:00Z") if row["layer"] == "b"]
    results = _write(tmp_path / "rows.jsonl", rows + per_layer)
    (path, runs, picked), = summary.newest_cells([str(results)]).values()
    assert runs == ["r2", "r3"] and {(row["layer"], row["run"]) for row in picked} == {("a", "r2"), ("b", "r3")}
    headline = _headline(tmp_path)
    summary.main([str(results), "--headline", str(headline)])
    entry = next(e for e in json.loads(headline.read_text())["entries"] if e["name"].endswith("vs sparsert"))
    count, ratio = layer_geomean(entry, per_layer)
    assert entry["rows"]["runs"] == ["r2", "r3"] and count == 2 and ratio == pytest.approx(entry["ratio"], rel=1e-3)


def test_a_cell_mixing_devices_is_refused(tmp_path):
    rows = [row for row in _run("r1") if row["layer"] == "a"]
    rows += [{**row, "device": "NVIDIA H100"} for row in _run("r2", "2026-11-26T11:00:00Z") if row["layer"] == "b"]
    with pytest.raises(ValueError, match="mixes devices"):
        summary.newest_cells([str(_write(tmp_path / "rows.jsonl", rows))])


def test_a_peer_that_skips_a_layer_is_compared_on_the_layers_it_ran(tmp_path):
    """The entry lists the layers both ran; the headline check recomputes over those and fails on a
    listed layer without the peer's row."""
    rows = [row for row in _run() if not (row["layer"] == "b" and row["backend"] == "peer:sparsert")]
    results = _write(tmp_path / "rows.jsonl", rows)
    headline = _headline(tmp_path)
    summary.main([str(results), "--headline", str(headline)])
    entry = next(e for e in json.loads(headline.read_text())["entries"] if e["name"].endswith("vs sparsert"))
    assert entry["rows"]["layers"] == ["a"] and entry["ratio"] == pytest.approx(0.5, rel=1e-3)
    assert layer_geomean(entry, rows) == (1, pytest.approx(0.5, rel=1e-3))
    with pytest.raises(AssertionError, match="no baseline row"):
        layer_geomean(dict(entry, rows=dict(entry["rows"], layers=["a", "b"])), rows)


def test_the_summary_has_one_line_per_cell_with_cudnn_at_pytorchs_default(tmp_path):
    """Per cell: ours over each peer variant, then over cuDNN TF32 (2.5 ms against ours 2.0 and 3.0 ms)."""
    rows = [dict(row, N=32) for row in _run()]
    done = run_script("peers_summary", tmp_path, _write(tmp_path / "n32.jsonl", rows), "--headline",
                      _headline(tmp_path))
    assert "| resnet50, fp32, 32 | 1.00x (0.50-2.00x, 2) | 0.50x (0.25-1.00x, 2) | 1.02x (0.83-1.25x, 2) |" in done.stdout
