"""benchmarks/torchvision_cells.py, the logic of torchvision_table.py: which cells it runs by default,
and one cell end to end on the CPU (a small model instead of torchvision's, aot_eager instead of
inductor): the model as given, it compiled, and ours through sparsecnn.compile, each row checked."""
import contextlib
import functools
import itertools

import pytest
import torch
from helpers.scripts import script_module
from torch import nn

from sparsecnn.backends import backend_names

cells = script_module("torchvision_cells")
ENV = {"device": "cpu", "commit": "abc1234", "torch": "2.13", "cudnn": None, "triton": "3.6.0", "driver": None,
       "date": "2026-12-01T10:00:00Z"}


def test_the_default_cells_are_the_issue_46_table():
    wanted = {cells.Cell(model, dtype, batch) for model, dtype, batch in itertools.product(
        ["resnet50", "googlenet", "mobilenet_v2", "efficientnet_b0", "vgg16", "regnet_y_400mf"], ["fp16", "fp32"],
        [32, 1])}
    default = cells.parse_cells([])
    assert len(default) == len(wanted) == 24 and set(default) == wanted
    assert cells.parse_cells(["vgg16:fp16:1"]) == [cells.Cell("vgg16", "fp16", 1)]
    tiles = cells.parse_cells(["resnet50:fp16:32:tiles64x32i"])
    assert tiles == [cells.Cell("resnet50", "fp16", 32, "tiles64x32i")] and str(tiles[0]) == "resnet50:fp16:32:tiles64x32i"


def test_tiles_cells_prune_into_whole_units_of_channel_runs():
    """"tiles64x32i": each run of 64 output channels keeps whole units (32 input channels at one tap),
    but for one partial unit per layer that makes the kept count exact."""
    def load(name):
        return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 256, 1))

    model = cells.pruned("net", cells.Setup(torch.device("cpu"), load=load, hw=8), "tiles64x32i")
    for conv in (model[3], model[5]):
        K, C, R, S = conv.weight.shape
        kept = conv.weight.ne(0).reshape(K // 64, 64, C // 32, 32, R, S)
        partial = kept.any(dim=3).any(dim=1) & ~kept.all(dim=3).all(dim=1)
        assert kept.all(dim=3).all(dim=1).sum() >= 1 and partial.sum() <= 1
        assert kept.float().mean().item() == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize("spec", ["resnet50:fp16", "resnet50:bf16:32", "resnet50:fp32:0",
                                  "resnet50:fp32:32:max-autotune", "resnet50:fp32:32:tiles:1"])
def test_a_malformed_cell_is_refused_by_name(spec):
    with pytest.raises(ValueError, match=f"cell '{spec}': expected MODEL:DTYPE:BATCH"):
        cells.parse_cells([spec])


def _small(name):
    if name != "small":
        raise KeyError(f"no model {name!r}")
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.SiLU(), nn.Conv2d(8, 16, 1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


@pytest.mark.slow
def test_one_cell_times_the_given_model_it_compiled_and_ours_compiled(tmp_path, capsys):
    setup = cells.Setup(torch.device("cpu"), compiler="aot_eager", load=_small, hw=16)
    written = []
    row = functools.partial(cells.result_row, ENV, "run-1")
    said = cells.run_cells([cells.Cell("small", "fp32", 2), cells.Cell("missing", "fp32", 2)], setup, row,
                           written.extend, budget_s=600)
    rows = {(r["backend"], r["mode"]): r for r in written}
    assert set(rows) == {("cudnn", "eager"), ("inductor", "eager"), ("inductor", "cudagraph"), ("auto", "eager"),
                         ("auto", "cudagraph")}  # no caller-captured CUDA graph on the CPU
    assert all(r["model"] == "small" and r["N"] == 2 and r["dtype"] == "tf32" and r["run"] == "run-1"
               for r in written)
    assert all(r["rel_err"] < 1e-5 for r in written)
    assert rows[("inductor", "eager")]["config"]["compile_mode"] == "max-autotune"
    ours = rows[("auto", "eager")]["config"]
    assert ours["compile_mode"] == "max-autotune" and ours["compiled_kept"] in ("sparse", "dense")
    assert ours["compiled_speedup"] >= 1 and ours["layers"] == 3 and ours["policy"] == "fp32"
    assert {"tuning", "inductor layers", "compile sparsified", "compile as given", "total"} <= set(ours["phases_s"])
    assert any(line.startswith("small:fp32:2 vs inductor: eager ") for line in said)
    assert any(line.startswith("missing:fp32:2: FAILED KeyError") for line in said)
    late = cells.run_cells([cells.Cell("small", "fp16", 1)], setup, row, written.extend, budget_s=1.0, start=0.0)
    assert late == ["budget spent: small:fp16:1 not started"] and len(written) == len(rows)


def test_tuning_rows_time_each_cold_tuning_and_its_phases():
    setup = cells.Setup(torch.device("cpu"), load=_small, hw=16)
    entered = []

    @contextlib.contextmanager
    def around_cold():
        entered.append("in")
        yield
        entered.append("out")

    rows = cells.tuning_rows("small", setup, 2, 2, ENV, "run-2", around_cold=around_cold)
    assert entered == ["in", "out"]  # run 1 only
    assert [row["config"]["run"] for row in rows] == [1, "reload", 2]
    for row in rows:
        config = row["config"]
        assert row["kind"] == "tuning" and row["model"] == "small" and row["N"] == 2 and row["median_ms"] is None
        assert config["tune_s"] > 0 and config["phases_s"]["total"] <= config["tune_s"]
        assert {"reference pass", "layers"} <= set(config["phases_s"])
        assert ("model check" in config["phases_s"]) != config["model_cached"] == (config["run"] == "reload")
        assert config["layers"] == 3 and config["policy"] == "fp32"
        assert len(config["choices"]) == 3 and isinstance(config["worker_jobs"], dict)
        for layer, (choice, choice_ms, dense_ms, timed) in config["choices"].items():
            assert isinstance(choice, str) and choice_ms > 0 and dense_ms > 0 and timed >= 1
            fastest = config["backend_ms"][layer]
            assert fastest["dense"] == dense_ms and all(ms > 0 for ms in fastest.values())
            assert set(fastest) <= set(backend_names()) and len(fastest) <= timed
    assert [row["config"]["cache_hits"] for row in rows] == [0, 3, 0]
    assert ({layer: choice[0] for layer, choice in rows[1]["config"]["choices"].items()}
            == {layer: choice[0] for layer, choice in rows[0]["config"]["choices"].items()})
