"""`benchmarks/results/headline.json` against the rows it cites: every ratio of RESULTS.md is
recomputed from the committed JSON-lines file it names (both sides from one run)."""
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ROOT / "benchmarks" / "results" / "headline.json"
REQUIRED = ("name", "what", "ours_ms", "baseline", "baseline_ms", "ratio", "device", "commit", "date", "file")
REL_TOL = 1e-2


def _entries():
    return json.loads(HEADLINE.read_text())["entries"]


def _rows(path):
    with open(ROOT / path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _matching(rows, run, fields):
    return [row for row in rows if row.get("run") == run and all(row.get(k) == v for k, v in fields.items())]


def model_ratio(entry, rows):
    """Whole-model entry: one "ours" row and one baseline row of run `rows.run`; returns
    (ours_ms, baseline_ms, ratio) and checks both rows against the entry."""
    sel = entry["rows"]
    ours = _matching(rows, sel["run"], sel["ours"])
    base = _matching(rows, sel["run"], sel["baseline"])
    assert len(ours) == 1 and len(base) == 1, f"{entry['name']}: {len(ours)} ours / {len(base)} baseline rows"
    ours, base = ours[0], base[0]
    assert ours["run"] == base["run"]
    for row in (ours, base):
        assert row["device"] == entry["device"] and row["commit"] == entry["commit"]
        assert row["date"].startswith(entry["date"])
    return ours["median_ms"], base["median_ms"], base["median_ms"] / ours["median_ms"]


def layer_geomean(entry, rows):
    """Geomean entry: per layer (suite, N, layer) the fastest row of the backends at `dtype`
    against the cuDNN row at `baseline_dtype` of the same run; returns (layer count, geomean).
    An entry that lists its "layers" (a peer that runs some layers only) is checked on those."""
    sel = entry["rows"]
    suites = {tuple(s) for s in sel["suites"]} if sel.get("suites") else None
    layers = set(sel["layers"]) if sel.get("layers") else None
    best, base = {}, {}
    for row in rows:
        if row.get("kind") != "layer" or (suites and (row["suite"], row["N"]) not in suites):
            continue
        if layers is not None and row["layer"] not in layers:
            continue
        key = (row["suite"], row["N"], row["layer"])
        if row["backend"] == sel["baseline_backend"] and row["dtype"] == sel["baseline_dtype"]:
            assert key not in base, f"two baseline rows for {key}"
            base[key] = row
        elif row["backend"] in sel["backends"] and row["dtype"] == sel["dtype"]:
            if key not in best or row["median_ms"] < best[key]["median_ms"]:
                best[key] = row
    logs = []
    for key, row in best.items():
        assert key in base, f"{entry['name']}: no baseline row for {key}"
        assert row["run"] == base[key]["run"], f"{entry['name']}: {key} compares two runs"
        assert row["run"] in sel["runs"]
        logs.append(math.log(base[key]["median_ms"] / row["median_ms"]))
    return len(logs), math.exp(sum(logs) / len(logs))


def test_headline_has_entries():
    names = [entry["name"] for entry in _entries()]
    assert len(names) >= 1 and len(set(names)) == len(names)


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: e["name"])
def test_entry_fields(entry):
    missing = [key for key in REQUIRED if key not in entry]
    assert not missing, f"missing keys {missing}"
    assert entry["file"].startswith("benchmarks/results/") and entry["file"].endswith(".jsonl")
    assert (ROOT / entry["file"]).is_file(), f"{entry['file']} does not exist"
    assert entry["baseline"] and entry["what"] and entry["ratio"] > 0


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: e["name"])
def test_ratio_recomputed_from_rows(entry):
    rows = _rows(entry["file"])
    if entry["ours_ms"] is None:
        count, ratio = layer_geomean(entry, rows)
        assert count == entry["rows"]["N"], f"{count} layers, entry says {entry['rows']['N']}"
        assert entry["baseline_ms"] is None
    else:
        ours_ms, baseline_ms, ratio = model_ratio(entry, rows)
        assert ours_ms == pytest.approx(entry["ours_ms"], rel=1e-3)
        assert baseline_ms == pytest.approx(entry["baseline_ms"], rel=1e-3)
    assert ratio == pytest.approx(entry["ratio"], rel=REL_TOL), f"rows give {ratio:.3f}, entry says {entry['ratio']}"


def test_a_wrong_ratio_fails(tmp_path):
    """The check can fail: a tampered ratio or a row from another run is caught."""
    entry = next(e for e in _entries() if e["ours_ms"] is not None)
    rows = _rows(entry["file"])
    _, _, ratio = model_ratio(entry, rows)
    assert ratio != pytest.approx(entry["ratio"] * 1.05, rel=REL_TOL)
    other = dict(entry, rows=dict(entry["rows"], run="no-such-run"))
    with pytest.raises(AssertionError):
        model_ratio(other, rows)
