"""CPU tests of the benchmark harness: schema, layer and model benchmarks, patterns, report."""
import time

import pytest
import torch
from helpers.common import INTERPRET, require

from sparsecnn.bench import (
    FIELDS,
    bench_layers,
    bench_model,
    environment,
    markdown_table,
    plot_speedups,
    read_jsonl,
    render_report,
    validate_row,
    write_jsonl,
)
from sparsecnn.backends.blocks.extraction import extraction
from sparsecnn.bench import models as bench_models
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.core.spec import ConvSpec
from sparsecnn.prune import dlmc_layer_mask

FAST = dict(warmup_ms=1, rep_ms=5, min_rep=3)
BACKENDS = ["dense", "im2col-cublas", "im2col-cusparse"]
SPECS = [ConvSpec(2, 3, 5, 9, 9, 3, 3, 1, 1, name="a"), ConvSpec(2, 8, 16, 10, 10, 3, 3, 2, 1, name="b")]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _good_row(**changes):
    row = {
        "run": "r1", "kind": "layer", **environment("cpu"), "suite": "test", "layer": "a", "model": None,
        "N": 2, "C": 3, "K": 5, "H": 9, "W": 9, "R": 3, "S": 3, "stride": 1, "padding": [1, 0],
        "dtype": "fp32", "sparsity": 0.9, "pattern": "random", "backend": "cudnn", "config": None,
        "mode": "eager", "median_ms": 1.0, "p20_ms": 0.9, "p80_ms": 1.1, "rel_err": 1e-7, "floor_ms": 0.1,
    }
    row.update(changes)
    return row


@pytest.fixture(scope="module")
def layer_rows():
    return bench_layers(SPECS, suite="tiny", sparsity=0.7, pattern="random", dtype="fp32", backends=BACKENDS,
                        device="cpu", progress=False, timing=FAST)


def test_schema_accepts_good_rows():
    validate_row(_good_row())
    model_row = _good_row(kind="model", layer=None, model="lenet5", suite=None, floor_ms=None,
                          **{name: None for name in ("C", "K", "H", "W", "R", "S", "stride", "padding")})
    validate_row(model_row)
    assert set(_good_row()) == set(FIELDS)


def _without(name):
    row = _good_row()
    del row[name]
    return row


@pytest.mark.parametrize("row, field", [
    (_without("median_ms"), "median_ms"),
    (_good_row(extra=1), "extra"),
    (_good_row(N="2"), "N"),
    (_good_row(median_ms=True), "median_ms"),
    (_good_row(config="x"), "config"),
    (_good_row(stride=[1, 2, 3]), "stride"),
    (_good_row(dtype="fp64"), "dtype"),
    (_good_row(kind="kernel"), "kind"),
    (_good_row(mode="lazy"), "mode"),
    (_good_row(sparsity=1.5), "sparsity"),
    (_good_row(layer=None), "layer"),
    (_good_row(kind="model"), "model"),
])
def test_schema_rejects_bad_rows(row, field):
    with pytest.raises(ValueError, match=repr(field)):
        validate_row(row)


def test_bench_layers_rows(layer_rows, tmp_path):
    assert {(row["layer"], row["backend"]) for row in layer_rows} == {
        (layer, backend) for layer in "ab" for backend in ["cudnn", *BACKENDS]}
    for row in layer_rows:
        validate_row(row)
        assert row["rel_err"] < 1e-5
        assert 0 < row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        assert row["floor_ms"] > 0 and row["dtype"] == "fp32" and row["kind"] == "layer"
    assert next(row for row in layer_rows if row["layer"] == "b")["stride"] == 2
    path = write_jsonl(layer_rows, tmp_path / "out" / "rows.jsonl")
    write_jsonl(layer_rows[:1], path)
    assert read_jsonl(path) == layer_rows + layer_rows[:1]


def test_bench_layers_restores_tf32_flags():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, True
    try:
        bench_layers(SPECS[:1], suite="tiny", sparsity=0.5, pattern="random", dtype="tf32", backends=["dense"],
                     device="cpu", progress=False, timing=FAST)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_bench_layers_rejects_unknown_names():
    with pytest.raises(ValueError, match="dtype"):
        bench_layers(SPECS, suite="t", sparsity=0.5, pattern="random", dtype="fp8", backends=[], device="cpu")
    with pytest.raises(ValueError, match="backend"):
        bench_layers(SPECS, suite="t", sparsity=0.5, pattern="random", dtype="fp32", backends=["nope"],
                     device="cpu")
    with pytest.raises(ValueError, match="configs must be 'default', 'auto' or 'all'"):
        bench_layers(SPECS, suite="t", sparsity=0.5, pattern="random", dtype="fp32", backends=[], device="cpu",
                     configs="best")
    with pytest.raises(ValueError, match="mode must be 'gpu' or 'eager'"):
        bench_layers(SPECS, suite="t", sparsity=0.5, pattern="random", dtype="fp32", backends=[], device="cpu",
                     mode="graph")


def test_bench_layers_records_its_mode(layer_rows):
    assert {row["mode"] for row in layer_rows} == {"gpu"}
    eager = bench_layers(SPECS[:1], suite="tiny", sparsity=0.5, pattern="random", dtype="fp32", backends=["dense"],
                         device="cpu", progress=False, timing=FAST, mode="eager")
    assert {row["mode"] for row in eager} == {"eager"}


def test_random_pattern_has_exact_count():
    weight, label = make_weight(SPECS[1], 0.75, "random", seed=3, device="cpu")
    assert label == "random" and weight.shape == SPECS[1].weight_shape
    assert weight.count_nonzero().item() == round(0.25 * weight.numel())
    assert torch.equal(weight, make_weight(SPECS[1], 0.75, "random", seed=3, device="cpu")[0])


def test_dlmc_pattern_falls_back_to_random_for_other_layers():
    weight, label = make_weight(SPECS[0], 0.9, "dlmc-magnitude_pruning", seed=0, device="cpu")
    assert label == "random"
    assert weight.count_nonzero().item() == round((1 - 0.9) * weight.numel())


def test_dlmc_pattern_uses_real_mask():
    require("dlmc")  # skipped without the data locally, failed in CI
    spec = ConvSpec(1, 64, 64, 56, 56, 1, 1, name="layer1.0.conv1")
    weight, label = make_weight(spec, 0.9, "dlmc-magnitude_pruning", seed=0, device="cpu")
    assert label == "dlmc-magnitude_pruning"
    assert torch.equal(weight != 0, dlmc_layer_mask("magnitude_pruning-0.9", "layer1.0.conv1"))


def test_bench_model_lenet5():
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                       modes=("eager",), progress=False, timing=FAST)
    assert [row["backend"] for row in rows] == ["cudnn", "auto"]
    for row in rows:
        validate_row(row)
        assert row["model"] == "lenet5" and row["N"] == 2 and row["layer"] is None
        assert row["rel_err"] < 1e-5 and row["median_ms"] > 0
    choices = rows[1]["config"]
    assert set(choices["layers"]) == {"conv1", "conv2"} and choices["tune_s"] > 0
    assert choices["tune_phases_s"]["layers"] <= choices["tune_phases_s"]["total"] and choices["tune_phases_s"]["total"] > 0
    assert choices["conv_ms"] > 0 and choices["dense_conv_ms"] > 0


def test_bench_model_compiles_dense_and_sparse_models_in_the_same_mode(monkeypatch):
    compiled_modes = []

    def recording_compile(model, mode=None, **kwargs):
        compiled_modes.append(mode)
        first = []

        def compiled(*args):
            if not first:  # the first call is where torch.compile compiles
                first.append(time.sleep(0.05))
            return model(*args)

        return compiled

    monkeypatch.setattr(torch, "compile", recording_compile)
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                       modes=("compile",), progress=False, timing=FAST, compile_mode="reduce-overhead")
    assert compiled_modes == ["reduce-overhead", "reduce-overhead"]
    assert [(row["backend"], row["mode"]) for row in rows] == [("cudnn", "compile"), ("auto", "compile")]
    assert [row["config"]["compile_mode"] for row in rows] == ["reduce-overhead", "reduce-overhead"]
    assert all(row["config"]["compile_s"] >= 0.05 for row in rows)  # the compile time is recorded
    assert "| cudnn | compile (reduce-overhead) |" in markdown_table(rows)


def test_bench_model_sparse_modes_and_rows_as_measured(monkeypatch):
    """sparse_modes restricts the sparse model's modes; on_rows gets each model's rows as soon as
    they are measured, so the dense rows are out before the sparse model is tuned."""
    delivered = []

    def fake_compile(model, mode=None):
        return model

    def recording_variant(model, x, dtype, variant, backends, run_mode):
        delivered.append(("tuning", variant))
        return real_variant(model, x, dtype, variant, backends, run_mode)

    real_variant = bench_models._variant
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(bench_models, "_variant", recording_variant)
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                       modes=("eager", "compile"), sparse_modes=("eager",), progress=False, timing=FAST,
                       on_rows=lambda measured: delivered.append([(r["backend"], r["mode"]) for r in measured]))
    assert [(row["backend"], row["mode"]) for row in rows] == [("cudnn", "eager"), ("cudnn", "compile"),
                                                               ("auto", "eager")]
    assert delivered == [("tuning", "cudnn"), [("cudnn", "eager"), ("cudnn", "compile")], ("tuning", "auto"),
                         [("auto", "eager")]]
    with pytest.raises(ValueError, match="unknown mode 'graphs'"):
        bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                    modes=("eager",), sparse_modes=("graphs",), progress=False, timing=FAST)


def test_bench_model_limits_tuning_to_the_named_backends():
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                       modes=("eager",), progress=False, timing=FAST, backends=["im2col-cublas"])
    choices = rows[1]["config"]
    assert choices["backends"] == ["im2col-cublas"]
    assert {layer["backend"] for layer in choices["layers"].values()} <= {"dense", "im2col-cublas"}
    assert rows[1]["rel_err"] < 1e-5


def test_bench_model_runs_with_cudnn_benchmark_and_restores_the_flag(monkeypatch):
    seen = []
    original = bench_models._variant

    def recording_variant(*args, **kwargs):
        seen.append(torch.backends.cudnn.benchmark)
        return original(*args, **kwargs)

    monkeypatch.setattr(bench_models, "_variant", recording_variant)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="random", device="cpu",
                       modes=("eager",), progress=False, timing=FAST, cudnn_benchmark=True)
    assert seen == [True, True] and torch.backends.cudnn.benchmark is False
    assert [row["config"]["cudnn_benchmark"] for row in rows] == [True, True]
    assert rows[1]["config"]["layers"] and rows[1]["rel_err"] < 1e-5


def test_bench_model_reads_pruned_checkpoints(tmp_path):
    from sparsecnn.models import build_model
    from sparsecnn.prune import magnitude_mask, save_pruned

    model = build_model("lenet5")
    masks = {name: magnitude_mask(getattr(model, name).weight, 0.75) for name in ("conv1", "conv2")}
    save_pruned(tmp_path / "lenet5.pt", "lenet5", model, masks, {"method": "magnitude"})
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.0, pattern="random", device="cpu",
                       modes=("eager",), progress=False, timing=FAST, checkpoint=tmp_path / "lenet5.pt")
    assert rows[0]["pattern"] == "checkpoint" and rows[0]["sparsity"] == pytest.approx(0.75, abs=1e-3)
    assert all(row["rel_err"] < 1e-5 for row in rows)


def test_bench_model_rejects_dlmc_for_other_models():
    with pytest.raises(ValueError, match="resnet50"):
        bench_model("lenet5", batch=1, dtype="fp32", sparsity=0.9, pattern="dlmc-magnitude_pruning",
                    device="cpu", modes=("eager",), progress=False, timing=FAST)


def test_floor_is_memory_or_compute_bound():
    ceilings = {"copy_GBps": 1.0, "fp32_TFLOPs": 1e-9, "fp16_TFLOPs": 2e-9}
    spec = SPECS[0]
    assert floor_ms(spec, 0.5, "fp32", ceilings) == pytest.approx(0.5 * spec.dense_flops / 1e3 * 1e3)
    assert floor_ms(spec, 0.5, "fp16", ceilings) == pytest.approx(0.5 * floor_ms(spec, 0.5, "tf32", ceilings))
    memory_bound = dict(ceilings, fp32_TFLOPs=1e9)
    assert floor_ms(spec, 0.5, "fp32", memory_bound) == pytest.approx(spec.min_bytes(4, 0.5) / 1e9 * 1e3)
    assert set(measure_ceilings("cpu")) == {"copy_GBps", "fp32_TFLOPs", "fp16_TFLOPs"}


def test_markdown_table(layer_rows):
    text = markdown_table(layer_rows)
    assert "| a |" in text and "| b |" in text
    assert "Geomean speedup vs cuDNN fp32" in text and "im2col-cusparse" in text


def test_plots_and_report(layer_rows, tmp_path):
    path = plot_speedups(layer_rows, tmp_path / "speedups.png")
    assert path.stat().st_size > 0 and path.read_bytes()[:8] == PNG_MAGIC
    page = render_report(layer_rows, tmp_path / "report.md", tmp_path / "plots")
    text = page.read_text()
    assert "![" in text and (tmp_path / "plots" / "speedups.png").exists()


def test_commit_from_the_environment_wins_over_the_checkout(monkeypatch):
    from sparsecnn.bench.env import git_commit
    from sparsecnn.settings import COMMIT

    monkeypatch.setenv(COMMIT.name, "abc1234")
    git_commit.cache_clear()
    assert git_commit() == "abc1234"
    monkeypatch.delenv(COMMIT.name)
    git_commit.cache_clear()
    assert git_commit() != "abc1234"


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.slow
def test_bench_layers_times_the_auto_configs():
    from sparsecnn.backends import get_backend

    spec = SPECS[0]
    rows = bench_layers([spec], suite="tiny", sparsity=0.5, pattern="random", dtype="fp32", backends=["direct"],
                        device="cpu", progress=False, timing=FAST, configs="auto", baselines=False)
    auto = get_backend("direct").auto_configs(spec, torch.float32)
    assert len(rows) == len(auto) >= 2
    assert all(row["rel_err"] < 1e-6 for row in rows)


def test_efficiency_is_non_zero_macs_over_the_cuda_core_fma_rate_of_the_rows_gpu():
    from sparsecnn.bench.report import efficiency

    row = {"kind": "layer", "device": "NVIDIA H100 80GB HBM3", "N": 32, "C": 64, "K": 64, "H": 56, "W": 56, "R": 3,
           "S": 3, "stride": [1, 1], "padding": [1, 1], "sparsity": 0.9, "median_ms": 1.0, "dtype": "fp32"}
    macs = 32 * 56 * 56 * 64 * 64 * 9 * 0.1
    assert efficiency(row) == pytest.approx(macs / (1e-3 * 132 * 128 * 1.98e9))
    assert efficiency({**row, "dtype": "fp16"}) == pytest.approx(macs / (1e-3 * 132 * 256 * 1.98e9))
    assert efficiency({**row, "device": "NVIDIA H100 PCIe"}) == pytest.approx(macs / (1e-3 * 114 * 128 * 1.755e9))
    assert efficiency({**row, "device": "cpu"}) is None and efficiency({**row, "kind": "model"}) is None


def test_tiles_pattern_re_prunes_into_tiles_handed_to_blocks():
    spec = ConvSpec(1, 3, 33, 13, 13, 3, 3, name="odd")
    weight, label = make_weight(spec, 0.8, "tiles16-random", seed=0, device="cpu", dtype=torch.float16)
    assert label == "tiles16-random" and weight.dtype == torch.float16
    mask = weight != 0
    assert mask.sum().item() == round(0.2 * mask.numel())
    rows = mask.reshape(33, -1)
    assert len({tuple(row.tolist()) for row in rows}) <= -(-33 // 16) + 1  # rows of a tile share columns
    decomposition = extraction(weight.float(), 8)
    assert decomposition.report.partitioner == "given" and decomposition.report.share_in_blocks == 1.0
    with pytest.raises(ValueError, match="tiles of 16, 32, 64 rows"):
        make_weight(spec, 0.8, "tiles8-random", seed=0, device="cpu")
    with pytest.raises(ValueError, match="chunk of 1, 8, 16, 32"):
        make_weight(spec, 0.8, "tiles16x4-random", seed=0, device="cpu")


def test_chunked_tiles_pattern_keeps_whole_units():
    spec = ConvSpec(1, 32, 64, 13, 13, 3, 3, name="odd")
    weight, label = make_weight(spec, 0.9, "tiles32x16-random", seed=0, device="cpu")
    assert label == "tiles32x16-random"
    units = (weight != 0).reshape(64, 2, 16, 9)
    assert torch.equal(units.all(dim=2), units.any(dim=2))  # a unit is all kept or all pruned
    assert abs((weight != 0).float().mean().item() - 0.1) < 0.02
    indexed, label = make_weight(spec, 0.9, "tiles32x16i-random", seed=0, device="cpu")
    assert label == "tiles32x16i-random"
    rows = [tuple(row) for row in (indexed != 0).reshape(64, -1).tolist()]
    assert rows[:32] == [rows[0]] * 32 or rows[32:] == [rows[32]] * 32  # tiles are channel runs (one may split)


def test_bench_model_tiles_pattern_labels_rows_and_hands_tiles_to_blocks():
    model, label, sparsity = bench_models._pruned_model("lenet5", 0.8, "tiles16-random", 0, None)
    assert label == "tiles16-random" and sparsity == 0.8
    for conv in (model.conv1, model.conv2):
        weight = conv.weight.detach()
        assert (weight != 0).sum().item() == round(0.2 * weight.numel())
        assert extraction(weight, 8).report.partitioner == "given"
    rows = bench_model("lenet5", batch=2, dtype="fp32", sparsity=0.8, pattern="tiles16-random", device="cpu",
                       modes=("eager",), progress=False, timing=FAST)
    assert {row["pattern"] for row in rows} == {"tiles16-random"}
    assert rows[1]["rel_err"] < 1e-5


def test_a_config_the_backend_refuses_for_this_weight_is_skipped_with_a_note(monkeypatch, capsys):
    from sparsecnn.bench import layers as bench_layers_module

    real = bench_layers_module._backend_fn

    def refuse_direct(backend, layer, dtype, config):
        if backend.name == "direct":
            raise ValueError("235929 non-zeros exceed the kernel's 60000")
        return real(backend, layer, dtype, config)

    monkeypatch.setattr(bench_layers_module, "_backend_fn", refuse_direct)
    rows = bench_layers(SPECS[:1], suite="tiny", sparsity=0.5, pattern="random", dtype="fp32",
                        backends=["direct", "dense"], device="cpu", timing=FAST, progress=False)
    assert {row["backend"] for row in rows} == {"cudnn", "dense"}  # the run went on past the refusal
    printed = capsys.readouterr()
    assert "direct" in printed.out + printed.err and "non-zeros exceed" in printed.out + printed.err
