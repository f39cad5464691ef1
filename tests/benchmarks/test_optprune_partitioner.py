"""`benchmarks/optprune_partitioner.py` (issue 33 item 4: OptPrune's blocks with mtkahypar against
Jaccard): its statistics on a mask whose blocks are known, its rounding of a decomposition, its smoke
run as a user runs it (Triton in its interpreter) with schema-valid rows, the same with mtkahypar
(an optional extra), and its report on made-up rows."""
import json
import math

import pytest
import torch
from helpers.common import needs
from helpers.scripts import run_script, script_module

from sparsecnn.backends.blocks.format import BlockParams, extract_blocks
from sparsecnn.bench.layers import round_to
from sparsecnn.bench.schema import FIELDS, validate_row

TIME_FIELDS = ("median_ms", "p20_ms", "p80_ms")


def two_block_weight() -> torch.Tensor:
    """(16, 24) weight with two known dense blocks and one stray non-zero.

    Rows 0-7 x cols 0-7: all 64 cells non-zero. Rows 8-15 x cols 8-15: all but the diagonal, 56
    non-zeros (each column 7 of 8). Row 3, col 20: alone in its column, so in no block.
    """
    weight = torch.zeros(16, 24)
    weight[:8, :8] = torch.arange(1, 65, dtype=torch.float32).reshape(8, 8)
    weight[8:, 8:16] = 1.0 - torch.eye(8)
    weight[3, 20] = -2.0
    return weight


# groups of 8 rows (t1 = 2 of 16); a column joins its group's block with >= 4 of the group's non-zeros
TWO_GROUPS = dict(t1=2, t2=4, b1=4, b2=4)


def _check_two_blocks(partitioner: str) -> None:
    partition = script_module("optprune_partitioner")
    decomposition = extract_blocks(two_block_weight(), BlockParams(**TWO_GROUPS, partitioner=partitioner))
    assert sorted((block.rows.tolist(), block.cols.tolist()) for block in decomposition.blocks) == [
        (list(range(8)), list(range(8))), (list(range(8, 16)), list(range(8, 16)))]
    stats = partition.block_statistics(decomposition)
    nnz, in_blocks, cells = 64 + 56 + 1, 64 + 56, 2 * 64
    assert stats == pytest.approx(dict(
        num_blocks=2, num_levels=1, nnz=nnz, nnz_in_blocks=in_blocks, share_in_blocks=in_blocks / nnz,
        block_cells=cells, fill=in_blocks / cells, extra_flops=(cells - in_blocks) / nnz, mean_block_rows=8,
        mean_block_cols=8, mean_block_cells=64, seconds=decomposition.report.seconds))


def test_statistics_of_known_blocks_with_jaccard():
    _check_two_blocks("jaccard")


@needs("mtkahypar")
def test_statistics_of_known_blocks_with_mtkahypar():
    _check_two_blocks("mtkahypar")


def test_statistics_without_blocks():
    partition = script_module("optprune_partitioner")
    weight = torch.eye(16)  # no column holds 4 non-zeros
    stats = partition.block_statistics(extract_blocks(weight, BlockParams(**TWO_GROUPS, partitioner="jaccard")))
    assert (stats["num_blocks"], stats["num_levels"], stats["nnz"], stats["nnz_in_blocks"]) == (0, 0, 16, 0)
    assert (stats["share_in_blocks"], stats["fill"], stats["extra_flops"]) == (0.0, 0.0, 0.0)
    assert stats["mean_block_rows"] is stats["mean_block_cols"] is stats["mean_block_cells"] is None


@needs("triton")
def test_packed_statistics_of_known_blocks():
    partition = script_module("optprune_partitioner")
    weight = two_block_weight().reshape(16, 24, 1, 1)
    spec = partition.ConvSpec(1, 24, 16, 4, 4, 1, 1)
    decomposition = extract_blocks(weight, BlockParams(**TWO_GROUPS, partitioner="jaccard"))
    # One tile of all 16 channels (K < 64); its dense part spans the blocks' 16 columns, padded to
    # the 32-column reduction step; the stray non-zero is one ELL step of 16 slots.
    assert partition.packed_statistics(decomposition, spec) == pytest.approx(
        dict(tiles=1, tile_fill=120 / (32 * 16), macs_per_nnz=(32 * 16 + 16) / 121))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_rounded_decomposition_is_the_rounded_weight(dtype):
    partition = script_module("optprune_partitioner")
    weight = torch.randn(16, 24, generator=torch.Generator().manual_seed(0)) * (two_block_weight() != 0)
    decomposition = extract_blocks(weight, BlockParams(**TWO_GROUPS, partitioner="jaccard"))
    assert decomposition.blocks and decomposition.remainder.nnz == 1
    rounded = partition.rounded(decomposition, dtype)
    assert torch.equal(rounded.to_dense().reshape(16, 24), round_to(weight, dtype))
    assert not torch.equal(rounded.to_dense().reshape(16, 24), weight)  # it did round
    assert rounded.report == decomposition.report and rounded.params == decomposition.params


@pytest.mark.slow
def test_worker_processes_extract_the_same_blocks():
    partition = script_module("optprune_partitioner")
    study = partition.Study(0.5, "random", 0, ("jaccard",), (4, 8))
    layers = [("optprune-resnet18-cifar", partition.smoke_spec(spec))
              for spec in partition.get_suite("optprune-resnet18-cifar")[:2]]
    here, spawned = partition.extract_all(layers, study, 1), partition.extract_all(layers, study, 2)
    assert set(here) == set(spawned) == {("optprune-resnet18-cifar", spec.name, "jaccard", t2)
                                         for _, spec in layers for t2 in (4, 8)}
    for key, decomposition in here.items():
        assert torch.equal(decomposition.to_dense(), spawned[key].to_dense())
        assert [(b.rows.tolist(), b.cols.tolist()) for b in decomposition.blocks] == [
            (b.rows.tolist(), b.cols.tolist()) for b in spawned[key].blocks]
    assert sum(len(decomposition.blocks) for decomposition in here.values()) > 0


def _check_blocks_rows(rows, partitioners, layers, sparsity):
    assert {(row["layer"], row["partitioner"], row["t2"]) for row in rows} == {
        (layer, partitioner, t2) for layer in layers for partitioner in partitioners for t2 in (4, 8)}
    for row in rows:
        # a schema row but for the times: those are null, as the extraction has none
        assert all(row[name] is None for name in (*TIME_FIELDS, "rel_err", "floor_ms", "mode"))
        validate_row({**{name: row[name] for name in FIELDS}, "kind": "layer", "mode": "eager",
                      **{name: 0.0 for name in TIME_FIELDS}})
        assert row["kind"] == "optprune-partitioner-blocks" and row["backend"] == "blocks"
        assert row["config"] == dict(t1=8, t2=row["t2"], b1=8, b2=8, partitioner=row["partitioner"], imbalance=0.03)
        assert (row["N"], row["H"], row["W"]) == (1, 8, 8) and row["C"] <= 16 and row["K"] == 64  # smoke cuts
        assert row["nnz"] == round((1 - sparsity) * row["K"] * row["C"] * row["R"] * row["S"])
        assert row["share_in_blocks"] == pytest.approx(row["nnz_in_blocks"] / row["nnz"])
        assert row["fill"] == (pytest.approx(row["nnz_in_blocks"] / row["block_cells"]) if row["num_blocks"] else 0.0)
        assert row["macs_per_nnz"] >= 1.0 and row["tiles"] == 1 and row["seconds"] >= 0


@pytest.mark.slow
@needs("triton")
def test_smoke_run_on_cpu(tmp_path):
    out, png = tmp_path / "partitioner.jsonl", tmp_path / "partitioner.png"
    layers = ("r18c-layer1", "conv2.conv")
    done = run_script("optprune_partitioner", tmp_path, out, "--smoke", "--gpu", "--device", "cpu", "--partitioners",
                      "jaccard", "--sparsity", "0.5", "--layers", ",".join(layers), "--plot", png)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({row["run"] for row in rows}) == 1
    blocks = [row for row in rows if row["kind"] == "optprune-partitioner-blocks"]
    timed = [row for row in rows if row["kind"] == "optprune-partitioner-time"]
    assert len(blocks) + len(timed) == len(rows)
    _check_blocks_rows(blocks, ["jaccard"], layers, 0.5)
    assert sum(row["num_blocks"] for row in blocks) > 0  # at sparsity 0.5, t2 = 4 finds blocks
    assert sorted((row["layer"], row["backend"]) for row in timed) == sorted(
        (layer, backend) for layer in layers for backend in ("cudnn", "blocks"))
    for row in timed:
        validate_row({**{name: row[name] for name in FIELDS}, "kind": "layer"})
        assert row["dtype"] == "fp32" and row["rel_err"] < 1e-5
        if row["backend"] == "cudnn":
            assert row["partitioner"] is None and row["config"] is None and row["sparsity"] == 0.0
            continue
        assert row["partitioner"] == "jaccard" and row["sparsity"] == 0.5
        # --configs all: every candidate config at t2 4 and 8; the fastest reported
        assert {candidate["config"]["t2"] for candidate in row["candidates"]} == {4, 8}
        assert len(row["candidates"]) > 2
        assert row["median_ms"] == min(candidate["median_ms"] for candidate in row["candidates"])
        assert row["t2"] == row["config"]["t2"]
        cudnn = next(r for r in timed if r["layer"] == row["layer"] and r["backend"] == "cudnn")
        assert row["cudnn_ms"] == cudnn["median_ms"] and row["speedup"] == pytest.approx(
            cudnn["median_ms"] / row["median_ms"])
    assert "r18c-layer1" in done.stdout and "jaccard geomean" in done.stdout
    assert png.stat().st_size > 0
    replot = run_script("optprune_partitioner", tmp_path, out, "--replot")
    assert "optprune-resnet18-cifar, t2=4:" in replot.stdout and "times on" in replot.stdout


@needs("triton")
@pytest.mark.slow
def test_budget_stops_timing_but_not_extraction(tmp_path):
    out = tmp_path / "partitioner.jsonl"
    done = run_script("optprune_partitioner", tmp_path, out, "--smoke", "--gpu", "--device", "cpu", "--partitioners",
                      "jaccard", "--layers", "r18c-layer1", "--budget-s", "0")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["kind"] for row in rows] == ["optprune-partitioner-blocks"] * 2  # t2 4 and 8, nothing timed
    assert "budget of 0 s spent: r18c-layer1 and later layers not timed" in done.stderr


@needs("triton", "mtkahypar")
def test_smoke_run_with_mtkahypar(tmp_path, capsys):
    # In this process: the optional mtkahypar may be on this interpreter's path only.
    partition = script_module("optprune_partitioner")
    out = tmp_path / "partitioner.jsonl"
    partition.main([str(out), "--smoke", "--sparsity", "0.5", "--layers", "r18c-layer1"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    _check_blocks_rows(rows, ["jaccard", "mtkahypar"], ["r18c-layer1"], 0.5)
    assert "mtkahypar - jaccard: share in blocks" in capsys.readouterr().out


def test_unknown_or_missing_partitioner_is_refused(monkeypatch):
    partition = script_module("optprune_partitioner")
    with pytest.raises(SystemExit, match="unknown hmetis"):
        partition._check_partitioners(["jaccard", "hmetis"])
    monkeypatch.setattr(partition.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="needs the mtkahypar package"):
        partition._check_partitioners(["mtkahypar"])


def _made_up_rows():
    """Two layers: mtkahypar puts more in blocks on the first and runs it 2x faster, the second alike."""
    common = dict(run="r", device="cpu", pattern="random", sparsity=0.875, suite="s", N=32, C=8, R=3, S=3, K=64,
                  mode="gpu")
    blocks, timed = [], []
    for layer, shares in (("a", (0.5, 0.7)), ("b", (0.4, 0.4))):
        for partitioner, share in zip(("jaccard", "mtkahypar"), shares):
            blocks.append(dict(common, layer=layer, partitioner=partitioner, t2=4, num_blocks=8, nnz=100,
                               nnz_in_blocks=round(100 * share), share_in_blocks=share, block_cells=200,
                               fill=share / 2, macs_per_nnz=2.0, seconds=1.0))
        timed.append(dict(common, layer=layer, dtype="fp16", partitioner=None, backend="cudnn", median_ms=4.0))
        for partitioner, ms in (("jaccard", 2.0), ("mtkahypar", 1.0 if layer == "a" else 2.0)):
            timed.append(dict(common, layer=layer, dtype="fp16", partitioner=partitioner, backend="blocks",
                              median_ms=ms, t2=4, speedup=4.0 / ms))
    return blocks, timed


def test_report_compares_the_partitioners():
    partition = script_module("optprune_partitioner")
    text = partition.report(*_made_up_rows())
    # share +20 points on a, 0 on b; fill +10 points on a; pooled fill 90 / 400 and 110 / 400
    assert "share in blocks +10.0 points on average (range +0.0 .. +20.0; higher on 1, lower on 0 of 2 layers)" in text
    assert "fill +5.0 points" in text
    assert "jaccard  : 2 layers, 16 blocks, mean share in blocks 45.0%, pooled fill 22.5%" in text
    assert "mtkahypar: 2 layers, 16 blocks, mean share in blocks 55.0%, pooled fill 27.5%" in text
    # speed ratios 2 and 1: geomean sqrt(2); speedups over cuDNN 2, 2 and 4, 2
    assert f"speed mtkahypar / jaccard geomean {math.sqrt(2):.3f}" in text
    assert "jaccard geomean 2.00x over cuDNN; mtkahypar geomean 2.83x over cuDNN" in text
