"""`benchmarks/unsparse_table9.py` (UnSparse-Opt Table 9, the sub-batch size sbS) in its CPU smoke
mode: the script run as a user runs it (a fresh interpreter, Triton in its interpreter), its rows
checked (one per layer, dtype and sbS plus cuDNN, each config at its sbS, the fastest candidate,
errors, the schema); the candidate building on the real suites; the report on made-up times."""
import dataclasses
import json

import pytest
from helpers.common import needs
from helpers.scripts import run_script, script_module

from sparsecnn.backends.direct.kernel import DirectConfig
from sparsecnn.bench.schema import FIELDS, validate_row
from sparsecnn.layers.suites import get_suite


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _validate(row):
    validate_row({**{name: row[name] for name in FIELDS}, "kind": "layer"})


def test_paper_constants_cover_the_suites():
    table9 = script_module("unsparse_table9")
    names = {spec.name for suite in table9.SUITES for spec in get_suite(suite)}
    assert set(table9.PAPER_SPARSITY) == names and len(names) == 12
    assert all(spec.N == 128 for suite in table9.SUITES for spec in get_suite(suite))  # the paper's batch
    assert table9.PAPER_SPARSITY["vgg-128x112-128"] == 0.93 and table9.PAPER_SPARSITY["vgg-256x56-256"] == 0.908
    assert table9.PAPER_TABLE9 == {"pietron-r50-1x1": {"sbS=1": 0.10, "sbS=N": 0.38},
                                   "pietron-vgg16": {"sbS=1": 0.10, "sbS=N": 0.45},
                                   "pietron-cnn1d": {"sbS=1": 0.12, "sbS=N": 0.41}}


def test_parse_sbs():
    table9 = script_module("unsparse_table9")
    assert table9.parse_sbs("8, 1,2,4,2") == [1, 2, 4, 8]
    for bad in ("3", "0", "1,x", ",", "-2"):
        with pytest.raises(ValueError, match="--sbs"):
            table9.parse_sbs(bad)


def _accounted(offered, found, sbs):
    """Every offered config that should run at `sbs` (as itself, or with sub_batch replaced when the
    candidates were built) is a candidate or is refused with its repr named."""
    for config in offered:
        if not found.built and config.sub_batch != sbs:
            continue
        try:
            as_sbs = dataclasses.replace(config, sub_batch=sbs)
        except ValueError:
            assert any(reason.startswith(f"{config}: ") for reason in found.refused), config
            continue
        assert as_sbs in found.configs or any(reason.startswith(f"{as_sbs}: ") for reason in found.refused), config


def test_candidates_keep_offered_sub_batches_and_build_the_missing_ones():
    table9 = script_module("unsparse_table9")
    spec = next(s for s in get_suite("pietron-vgg16") if s.name == "vgg-256x28-512")
    offered = table9.offered_configs(spec, "fp32", "all")
    assert len(offered) == len(set(offered)) >= 10
    for sbs in (1, 2, 4):  # the backend offers these: exactly its own configs of that sub_batch
        found = table9.candidates(spec, offered, sbs)
        assert found.configs == [c for c in offered if c.sub_batch == sbs] and found.configs
        assert not found.built and found.refused == []
    found = table9.candidates(spec, offered, 8)  # offered by none: built from every offered config
    assert found.built and found.refused == []
    assert {c.sub_batch for c in found.configs} == {8}
    assert set(found.configs) == {dataclasses.replace(c, sub_batch=8) for c in offered}
    assert {c.variant for c in found.configs} == {"chunk", "ell", "csr", "batch"}
    _accounted(offered, found, 8)
    found = table9.candidates(spec, offered, 16)  # beyond 8 only variant "batch" takes it
    assert found.built and {c.variant for c in found.configs} == {"batch"}
    assert all(c.sub_batch == 16 for c in found.configs)
    assert len(found.refused) == sum(c.variant != "batch" for c in offered)
    assert all("sub_batch" in reason for reason in found.refused)
    _accounted(offered, found, 16)


def test_candidates_name_every_refusal():
    table9 = script_module("unsparse_table9")
    spec = dataclasses.replace(next(iter(get_suite("pietron-r50-1x1"))), N=4)
    offered = table9.offered_configs(spec, "fp32", "all")
    found = table9.candidates(spec, offered, 8)
    batch = [c for c in offered if c.variant == "batch"]
    assert batch and found.built  # N=4: "batch" at sub_batch 4 is offered; 8 does not divide N
    refused = [r for r in found.refused if "divide N=4" in r]
    assert len(refused) == len({dataclasses.replace(c, sub_batch=8) for c in batch})
    assert all(c.variant != "batch" for c in found.configs) and found.configs
    _accounted(offered, found, 8)
    # too many accumulators per thread at sbS=8: DirectConfig refuses it, and the refusal is listed
    wide = DirectConfig(block_pix=1024, block_k=1, sub_batch=1, num_warps=1, variant="chunk")
    found = table9.candidates(spec, [wide, DirectConfig(sub_batch=2)], 8)
    assert found.configs == [DirectConfig(sub_batch=8)]
    assert len(found.refused) == 1 and found.refused[0].startswith(f"{wide}: ") and "too few" in found.refused[0]


@needs("triton")
@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path):
    table9 = script_module("unsparse_table9")
    out, png = tmp_path / "table9.jsonl", tmp_path / "table9.png"
    done = run_script("unsparse_table9", tmp_path, out, "--device", "cpu", "--smoke", "--plot", png)
    rows = _rows(out)
    first_layers = {suite: get_suite(suite)[0] for suite in table9.SUITES}
    assert len(rows) == len(first_layers) * (4 + 1)  # per layer: sbS 1, 2, 4, 8 and cuDNN; fp32 only on CPU
    assert len({row["run"] for row in rows}) == 1
    seen = set()
    for row in rows:
        _validate(row)
        full = first_layers[row["suite"]]
        assert row["kind"] == "unsparse-table9" and row["layer"] == full.name and row["config_set"] == "default"
        smoke = table9._smoke_spec(full)
        assert (row["N"], row["C"], row["K"], row["H"], row["W"]) == (8, smoke.C, smoke.K, smoke.H, smoke.W)
        assert smoke.C <= 4 and smoke.K <= 4 and smoke.H <= 8 and smoke.W <= 8
        assert (row["R"], row["S"], row["dtype"], row["pattern"]) == (full.R, full.S, "fp32", "random")
        assert row["sparsity"] == table9.PAPER_SPARSITY[full.name]
        assert row["rel_err"] < 1e-5
        if row["backend"] == "cudnn":
            assert row["sbs"] is None and row["config"] is None
        else:
            assert row["backend"] == "direct" and row["config"]["sub_batch"] == row["sbs"]
            assert [c["config"]["sub_batch"] for c in row["candidates"]] == [row["sbs"]]  # "default": one config
            assert row["built"] == (row["sbs"] != 2) and row["refused"] == []  # the default config has sbS 2
        seen.add((row["layer"], row["backend"], row["sbs"]))
    assert len(seen) == len(rows)
    assert "loss at sbS=1 against the best of sbS 2, 4, 8" in done.stdout
    assert "(paper Table 9: 12%)" in done.stdout  # pietron-cnn1d at sbS=1 (D * bS thread blocks)
    assert png.stat().st_size > 0
    replot = run_script("unsparse_table9", tmp_path, out, "--replot")
    assert f"(run {rows[0]['run']})" in replot.stdout and "pietron-vgg16 fp32 (1 layers, N=8)" in replot.stdout


@pytest.mark.slow
@needs("triton")
def test_smoke_run_picks_the_fastest_candidate_of_each_sbs(tmp_path):
    table9 = script_module("unsparse_table9")
    out = tmp_path / "table9.jsonl"
    layer = "r50-1x1-256-64"
    run_script("unsparse_table9", tmp_path, out, "--device", "cpu", "--smoke", "--configs", "auto",
               "--suites", "pietron-r50-1x1", "--layers", layer, "--sbs", "2,4")
    rows = _rows(out)
    spec = table9._smoke_spec(next(s for s in get_suite("pietron-r50-1x1") if s.name == layer))
    offered = table9.offered_configs(spec, "fp32", "auto")
    direct = {row["sbs"]: row for row in rows if row["backend"] == "direct"}
    assert sorted(direct) == [2, 4] and len(rows) == 3
    for sbs, row in direct.items():
        _validate(row)
        found = table9.candidates(spec, offered, sbs)
        timed = [DirectConfig.from_dict(c["config"]) for c in row["candidates"]]
        assert timed == found.configs and len(timed) >= 2  # every candidate timed, none failed
        assert (row["built"], row["refused"]) == (found.built, found.refused)
        assert all(config.sub_batch == sbs for config in timed)
        assert row["median_ms"] == min(c["median_ms"] for c in row["candidates"])
        assert DirectConfig.from_dict(row["config"]) in timed and row["rel_err"] < 1e-5
    assert not direct[2]["built"] and direct[4]["built"]  # auto offers sub_batch 2, never 4


def test_report_compares_with_the_paper():
    table9 = script_module("unsparse_table9")

    def row(layer, backend, sbs, ms, suite="pietron-vgg16"):
        return {"run": "r", "device": "d", "mode": "gpu", "config_set": "all", "suite": suite, "layer": layer,
                "dtype": "fp16", "sparsity": 0.9, "N": 128, "backend": backend, "sbs": sbs, "median_ms": ms}

    rows = [row("a", "cudnn", None, 3.0), row("a", "direct", 1, 2.0), row("a", "direct", 2, 1.0),
            row("a", "direct", 4, 1.6), row("b", "direct", 1, 1.0), row("b", "direct", 2, 1.0),
            row("b", "direct", 4, 0.9)]
    text = table9.report(rows)
    assert "pietron-vgg16 fp16 (2 layers, N=128):" in text
    # sbS=2: 2x and 1x -> geomean 1.41x; sbS=4: 1.25x and 1.11x -> 1.18x
    assert "geomean speedup over sbS=1: sbS=2 1.41x, sbS=4 1.18x" in text
    # loss at sbS=1: 1 - 1/2 = 50% and 1 - 0.9 = 10%; geomean 1 - sqrt(0.5 * 0.9) = 33%
    assert "loss at sbS=1 against the best of sbS 2, 4, 8: geomean 33%, layers 10% to 50% (paper Table 9: 10%)" in text
    assert "sbS=N=128 (D thread blocks): not measured (paper Table 9: 45%)" in text
    line_a = next(line for line in text.splitlines() if line.startswith("pietron-vgg16    a "))
    assert "3.0000" in line_a and "2.0000  1.00x" in line_a and "1.0000  2.00x" in line_a and line_a.endswith("2")
    assert table9.losses([{1: 2.0, 2: 1.0}, {1: 1.0}], 1) == [0.5]  # a layer without sbS 2, 4, 8 is left out


def test_bad_options_name_the_option():
    table9 = script_module("unsparse_table9")
    assert table9.parse_dtypes("fp16, fp32,fp16") == ["fp16", "fp32"]
    assert table9.parse_suites("pietron-vgg16") == ["pietron-vgg16"]
    with pytest.raises(ValueError, match="--dtypes"):
        table9.parse_dtypes("fp64")
    with pytest.raises(ValueError, match="--suites"):
        table9.parse_suites("dong")
    with pytest.raises(SystemExit):
        table9._parse(["out.jsonl", "--sbs", "3"])
