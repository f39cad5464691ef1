"""scripts/ncu_dong.py and benchmarks/dong_fig10.py (Dong Fig. 10 / Table 5 from Nsight Compute) on the CPU:
the raw-CSV parser on a hand-written `ncu --csv --page raw` export (a header row of names, a row of
units, a row per kernel; the NVTX push/pop column as Nsight Compute 2025 writes it), the stall-share
arithmetic, the duration-weighted aggregation of multi-kernel calls, the rows and tables of `parse`,
the ncu command lines, and the driver's config choice and range names."""
import csv
import dataclasses
import importlib.util
import io
import json
import sys

import pytest
import torch
from helpers.common import ROOT
from helpers.scripts import script_module

from sparsecnn.backends import get_backend
from sparsecnn.layers import get_suite

NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
ATTRIBUTES = ["ID", "Process ID", "Process Name", "Host Name", NVTX, "Kernel Name", "Context", "Stream",
              "Block Size", "Grid Size", "Device", "CC"]
METRIC_UNITS = {  # the units `--print-units base` prints
    "gpu__time_duration.sum": "nsecond",
    "dram__bytes.sum.per_second": "byte/second",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "%",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second": "byte/second",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second": "byte/second",
    "smsp__warp_issue_stalled_no_instruction_per_warp_active.pct": "%",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio": "",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": "",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycle",
}


def _fig10():
    return script_module("dong_fig10")


def _driver():
    spec = importlib.util.spec_from_file_location("ncu_dong", ROOT / "scripts" / "ncu_dong.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvtx_cell(*ranges, thread=4688):
    return f"{thread}  " + "  ".join(f'"<default domain>:{name}:none:none:none:none:none:none"' for name in ranges)


def _kernel(kid, call, name, duration_ns, dram, dram_pct, load, store, no_instr_pct, no_instr, selected, cycles):
    """One data row: metric values as strings with thousands separators, as ncu prints them."""
    values = [f"{duration_ns:,}", f"{dram:,}", f"{dram_pct}", f"{load:,}", f"{store:,}", f"{no_instr_pct}",
              f"{no_instr}", f"{selected}", f"{cycles}"]
    attributes = [str(kid), "4688", "python3.12", "127.0.0.1", _nvtx_cell("ncu_dong", call), name, "1", "7",
                  "(128, 1, 1)", "(196, 4, 1)", "0", "9.0"]
    return attributes + values


# lenet-conv1: codegen one kernel; im2col-cusparse three (weighted by duration); dense one.
KERNELS = [
    _kernel(0, "lenet-conv1/codegen", "sparsecnn_codegen_conv", 10_000, 500_000_000_000, 15.0,
            800_000_000_000, 200_000_000_000, 1.5, 0.3, 1.0, 21.0),
    _kernel(1, "lenet-conv1/im2col-cusparse", "im2col_kernel", 20_000, 1_000_000_000_000, 30.0,
            400_000_000_000, 400_000_000_000, 2.0, 0.4, 1.0, 11.0),
    _kernel(2, "lenet-conv1/im2col-cusparse", "elementwise_kernel", 10_000, 2_000_000_000_000, 60.0,
            1_000_000_000_000, 1_000_000_000_000, 4.0, 0.2, 1.0, 5.0),
    _kernel(3, "lenet-conv1/im2col-cusparse", "csrmm_kernel", 70_000, 100_000_000_000, 3.0,
            300_000_000_000, 0, 6.0, 1.2, 1.0, 21.0),
    _kernel(4, "lenet-conv1/dense", "cudnn_conv_kernel", 40_000, 200_000_000_000, 6.0,
            600_000_000_000, 100_000_000_000, 5.0, 0.9, 1.0, 19.0),
]


def _raw_csv(kernels=KERNELS, units=METRIC_UNITS, preamble=""):
    buffer = io.StringIO()
    writer = csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(ATTRIBUTES + list(units))
    writer.writerow([""] * len(ATTRIBUTES) + list(units.values()))
    writer.writerows(kernels)
    return preamble + buffer.getvalue()


def _manifest():
    def entry(backend, status="profiled", reason=None, config=None, source="default"):
        return {"layer": "lenet-conv1", "backend": backend, "range": f"lenet-conv1/{backend}", "status": status,
                "reason": reason, "config": config, "config_source": source if status == "profiled" else None,
                "pattern": "random"}

    return {"run": "20261127T000000Z-abcdef", "suite": "dong", "batch": 64, "dtype": "fp32", "sparsity": 0.9,
            "pattern": "random", "seed": 0, "warmup_calls": 3, "profiled_range": "ncu_dong", "not_started": [],
            "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cudnn": 91000,
                            "triton": "3.6.0", "driver": "580.159.04", "commit": "abc1234",
                            "date": "2026-11-27T00:00:00+00:00"},
            "entries": [entry("codegen", config={"bh": 2}, source="auto"),
                        entry("unrolled", status="skipped", reason="ValueError: refused"),
                        entry("im2col-cusparse"), entry("dense")]}


# --- the raw CSV -----------------------------------------------------------------------------------
def test_raw_csv_reads_names_units_and_one_row_per_kernel_after_ncu_messages():
    fig10 = _fig10()
    rows, units = fig10.read_raw_csv(_raw_csv(preamble="==PROF== Connected to process 4688\n"))
    assert len(rows) == 5 and rows[3]["Kernel Name"] == "csrmm_kernel"
    assert units["gpu__time_duration.sum"] == "nsecond" and units["Kernel Name"] == ""
    assert rows[0]["gpu__time_duration.sum"] == "10,000"
    with pytest.raises(ValueError, match="header"):
        fig10.read_raw_csv("==PROF== nothing profiled\n")


def test_push_pop_ranges_outermost_first_default_domain_only():
    fig10 = _fig10()
    cell = _nvtx_cell("ncu_dong", "vgg-conv2/dense") + '  "cuDNN:cudnnConvolutionForward:none:none:none:none:none:none"'
    assert fig10.push_pop_ranges(cell, NVTX) == ["ncu_dong", "vgg-conv2/dense"]
    # a column naming no fields after the range (other ncu versions): the whole rest is the name
    assert fig10.push_pop_ranges('1  "<default domain>:ncu_dong"  "<default domain>:a/b"',
                                 "thread Domain:Push/Pop_Range") == ["ncu_dong", "a/b"]
    assert fig10.call_range(["ncu_dong", "vgg-conv2/dense", "inner"], "k") == "vgg-conv2/dense"
    with pytest.raises(ValueError, match="outside"):
        fig10.call_range(["warmup"], "k")
    with pytest.raises(ValueError, match="no range inside"):
        fig10.call_range(["ncu_dong"], "k")
    with pytest.raises(ValueError, match="fewer fields"):
        fig10.push_pop_ranges('1  "<default domain>:ncu_dong"', NVTX)


def test_kernel_record_converts_units_and_drops_thousands_separators():
    fig10 = _fig10()
    rows, units = fig10.read_raw_csv(_raw_csv())
    record = fig10.kernel_record(rows[0], units, NVTX)
    assert record["range"] == "lenet-conv1/codegen" and record["id"] == 0 and record["grid"] == "(196, 4, 1)"
    assert record["duration_us"] == pytest.approx(10.0)
    assert record["dram_gbps"] == pytest.approx(500.0)
    assert record["global_gbps"] == pytest.approx(1000.0)  # load 800 + store 200
    assert record["no_instruction_pct_of_warp_cycles"] == pytest.approx(1.5)
    assert record["no_instruction_pct_of_stall_cycles"] == pytest.approx(1.5)  # 0.3 / (21 - 1)
    # the same kernel printed in scaled units (ncu's default --print-units auto) reads the same
    scaled_units = {**METRIC_UNITS, "gpu__time_duration.sum": "usecond", "dram__bytes.sum.per_second": "Gbyte/second"}
    row = _kernel(0, "lenet-conv1/codegen", "k", 10, 500, 15.0, 800_000_000_000, 200_000_000_000, 1.5, 0.3, 1.0, 21.0)
    rows, units = fig10.read_raw_csv(_raw_csv([row], scaled_units))
    again = fig10.kernel_record(rows[0], units, NVTX)
    assert again["duration_us"] == pytest.approx(10.0) and again["dram_gbps"] == pytest.approx(500.0)


def test_unexpected_units_and_missing_metrics_are_named():
    fig10 = _fig10()
    rows, units = fig10.read_raw_csv(_raw_csv(units={**METRIC_UNITS, "gpu__time_duration.sum": "cycle"}))
    with pytest.raises(ValueError, match="gpu__time_duration.sum: unexpected unit 'cycle'"):
        fig10.kernel_record(rows[0], units, NVTX)
    short = {name: unit for name, unit in METRIC_UNITS.items() if not name.startswith("dram__bytes")}
    kernel = KERNELS[0][:len(ATTRIBUTES) + 1] + KERNELS[0][len(ATTRIBUTES) + 2:]
    rows, units = fig10.read_raw_csv(_raw_csv([kernel], short))
    with pytest.raises(ValueError, match="dram__bytes.sum.per_second missing"):
        fig10.kernel_record(rows[0], units, NVTX)
    assert fig10.number("n/a", "x") is None and fig10.number("1,234.5", "x") == 1234.5
    with pytest.raises(ValueError, match="column x: expected a number"):
        fig10.number("twelve", "x")


# --- arithmetic ------------------------------------------------------------------------------------
def test_no_instruction_share_of_stalled_cycles():
    fig10 = _fig10()
    # 21 warp cycles per issued instruction, one of them issuing: 2 of the 20 stalled ones wait for a fetch
    assert fig10.no_instruction_share_of_stalls(2.0, 1.0, 21.0) == pytest.approx(10.0)
    assert fig10.no_instruction_share_of_stalls(0.5, 0.5, 3.0) == pytest.approx(20.0)
    assert fig10.no_instruction_share_of_stalls(None, 1.0, 21.0) is None
    assert fig10.no_instruction_share_of_stalls(0.0, 1.0, 1.0) is None  # no stalled cycle


def test_multi_kernel_calls_are_weighted_by_duration():
    fig10 = _fig10()
    grouped = fig10.kernels_by_range(_raw_csv())
    assert list(grouped) == ["lenet-conv1/codegen", "lenet-conv1/im2col-cusparse", "lenet-conv1/dense"]
    call = fig10.aggregate(grouped["lenet-conv1/im2col-cusparse"])
    assert call["kernel_count"] == 3 and call["duration_us"] == pytest.approx(100.0)
    # bytes over time: (1000 * 20 + 2000 * 10 + 100 * 70) / 100 GB/s
    assert call["dram_gbps"] == pytest.approx(470.0)
    assert call["dram_pct_of_peak"] == pytest.approx((30 * 20 + 60 * 10 + 3 * 70) / 100)
    assert call["global_gbps"] == pytest.approx((800 * 20 + 2000 * 10 + 300 * 70) / 100)
    assert call["no_instruction_pct_of_warp_cycles"] == pytest.approx((2 * 20 + 4 * 10 + 6 * 70) / 100)
    stall_shares = (100 * 0.4 / 10, 100 * 0.2 / 4, 100 * 1.2 / 20)
    assert call["no_instruction_pct_of_stall_cycles"] == pytest.approx(
        (stall_shares[0] * 20 + stall_shares[1] * 10 + stall_shares[2] * 70) / 100)
    assert fig10.weighted_mean([None, 3.0], [5.0, 1.0]) == 3.0 and fig10.weighted_mean([None], [1.0]) is None


# --- parse: rows, tables, plot ---------------------------------------------------------------------
def _write_run(tmp_path, kernels=KERNELS):
    fig10 = _fig10()
    paths = fig10.Paths.in_dir(tmp_path)
    paths.csv.write_text(_raw_csv(kernels))
    paths.manifest.write_text(json.dumps(_manifest()))
    paths.meta.write_text(json.dumps({"ncu_version": "2025.3.1.0"}))
    return fig10, paths


def test_parse_writes_one_row_per_layer_and_backend(tmp_path, capsys):
    fig10, paths = _write_run(tmp_path)
    fig10.main(["parse", str(tmp_path), "--no-plot"])
    rows = [json.loads(line) for line in paths.rows.read_text().splitlines()]
    assert [(row["backend"], row["status"]) for row in rows] == [
        ("codegen", "profiled"), ("unrolled", "skipped"), ("im2col-cusparse", "profiled"), ("dense", "profiled")]
    codegen, unrolled, cusparse, _ = rows
    assert codegen["kind"] == "dong-fig10" and codegen["ncu_version"] == "2025.3.1.0"
    assert (codegen["N"], codegen["C"], codegen["K"], codegen["H"], codegen["R"]) == (64, 1, 20, 28, 5)
    assert codegen["config"] == {"bh": 2} and codegen["config_source"] == "auto"
    assert codegen["device"] == "NVIDIA H100 80GB HBM3" and codegen["commit"] == "abc1234"
    assert codegen["metrics"]["dram_gbps"] == "dram__bytes.sum.per_second"
    assert codegen["dram_gbps"] == pytest.approx(500.0) and codegen["kernel_count"] == 1
    assert unrolled["reason"] == "ValueError: refused" and unrolled["dram_gbps"] is None and unrolled["kernels"] == []
    assert cusparse["kernel_count"] == 3 and [k["name"] for k in cusparse["kernels"]][-1] == "csrmm_kernel"
    text = capsys.readouterr().out
    assert paths.table.read_text().strip() in text
    # Fig. 10: codegen over cuSPARSE, 500 / 470 GB/s DRAM and 1000 / 570 global, beside the paper's ranges
    assert "dram throughput codegen / cuSPARSE: 1.06-1.06x over 1 layer " in text
    assert "global throughput codegen / cuSPARSE: 1.75-1.75x over 1 layer " in text
    assert "(paper, generated code / cuSPARSE: 1.4-14x)" in text
    assert "(paper, generated code / cuSPARSE: 1.1-3.2x)" in text
    # Table 5: ours (1.50 codegen, 5.00 cuSPARSE: (2 * 20 + 4 * 10 + 6 * 70) / 100, 5.00 cuDNN) beside the
    # paper's lenet-conv1 column
    table5 = next(line for line in text.splitlines() if line.startswith("lenet-conv1") and "6.41" in line)
    assert table5.split() == ["lenet-conv1", "1.50", "skipped", "5.00", "5.00", "2.67", "6.41", "6.30"]
    assert "lenet-conv1/unrolled: skipped: ValueError: refused" in text


def test_parse_refuses_kernels_the_manifest_does_not_list(tmp_path):
    stray = _kernel(9, "alexnet-conv1/codegen", "k", 1000, 1, 1.0, 1, 1, 1.0, 0.1, 1.0, 5.0)
    fig10, _ = _write_run(tmp_path, KERNELS + [stray])
    with pytest.raises(ValueError, match="alexnet-conv1/codegen"):
        fig10.main(["parse", str(tmp_path), "--no-plot"])


def test_a_profiled_call_without_kernels_is_marked(tmp_path):
    fig10, paths = _write_run(tmp_path, [k for k in KERNELS if "dense" not in k[4]])
    rows = fig10.parse_outputs(paths, None)
    assert rows[-1]["status"] == "no kernels" and rows[-1]["kernel_count"] == 0


def test_parse_plots_an_svg(tmp_path):
    pytest.importorskip("matplotlib")
    fig10, paths = _write_run(tmp_path)
    fig10.main(["parse", str(tmp_path)])
    assert paths.svg.read_text().lstrip().startswith("<?xml") and "<svg" in paths.svg.read_text()


# --- run: command lines ----------------------------------------------------------------------------
def test_ncu_command_profiles_the_marked_call_with_the_short_metric_list(tmp_path):
    fig10 = _fig10()
    args = fig10._parse_args(["run", str(tmp_path), "--layers", "lenet-conv1", "--timeout-s", "300"])
    paths = fig10.Paths.in_dir(tmp_path)
    target = fig10.driver_argv(args, paths.manifest, 210.0, prefetch=False)
    command = fig10.ncu_command("ncu", paths.report, target)
    assert command[:2] == ["ncu", "--metrics"]
    assert command[2].split(",") == [metric.name for metric in fig10.METRICS] and len(fig10.METRICS) == 9
    options = dict(zip(command[3:command.index(sys.executable)], command[4:command.index(sys.executable)]))
    assert options["--nvtx-include"] == "ncu_dong/" and "--nvtx" in command
    assert options["--clock-control"] == "none" and options["--target-processes"] == "all"
    assert options["--export"] == str(tmp_path / "dong_fig10.ncu-rep") and "--force-overwrite" in command
    assert target[:2] == [sys.executable, str(ROOT / "scripts" / "ncu_dong.py")]
    driver = dict(zip(target[2::2], target[3::2]))
    assert driver["--batch"] == "64" and driver["--sparsity"] == "0.9" and driver["--layers"] == "lenet-conv1"
    assert driver["--backends"] == "codegen,unrolled,im2col-cusparse,dense" and driver["--budget-s"] == "210"
    assert driver["--manifest"] == str(paths.manifest) and target[-1] == "--no-prefetch"
    assert "--no-prefetch" not in fig10.driver_argv(args, paths.manifest, None, prefetch=True)
    assert fig10.export_command("ncu", paths.report) == [
        "ncu", "--import", str(paths.report), "--csv", "--page", "raw", "--print-units", "base"]
    with pytest.raises(SystemExit):
        fig10._parse_args(["run", str(tmp_path), "--timeout-s", "60"])


def test_ncu_version_and_a_step_past_its_timeout(tmp_path):
    fig10 = _fig10()
    text = ("NVIDIA (R) Nsight Compute Command Line Profiler\nCopyright (c) 2018-2025 NVIDIA Corporation\n"
            "Version 2025.3.1.0 (build 36398880) (public-release)\n")
    assert fig10.ncu_version(text) == "2025.3.1.0"
    step = fig10.run_logged([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"],
                            tmp_path / "step.log", timeout_s=2.0)
    assert step["timed_out"] and step["rc"] != 0 and step["wall_s"] < 15
    assert "started" in (tmp_path / "step.log").read_text()


# --- the driver ------------------------------------------------------------------------------------
def test_driver_ranges_and_config_choice_on_the_dong_suite():
    driver = _driver()
    assert not set("@,[]/*+") & set(driver.PROFILED_RANGE)  # free of ncu's NVTX filter quantifiers
    name = driver.range_name("vgg-conv2", "im2col-cusparse")
    assert name == "vgg-conv2/im2col-cusparse" and driver.split_range_name(name) == ("vgg-conv2", "im2col-cusparse")
    with pytest.raises(ValueError, match="not '<layer>/<backend>'"):
        driver.split_range_name("vgg-conv2")
    specs = {spec.name: spec for spec in get_suite("dong", batch=64)}
    codegen, unrolled = get_backend("codegen"), get_backend("unrolled")
    # codegen: auto tries its default on one-slice layers only; alexnet-conv3's plan has two slices
    assert driver.chosen_config(codegen, specs["lenet-conv1"], torch.float32) == (
        codegen.auto_configs(specs["lenet-conv1"], torch.float32)[0], "auto")
    assert driver.chosen_config(codegen, specs["alexnet-conv3"], torch.float32) == (
        codegen.default_config(specs["alexnet-conv3"], torch.float32), "default")
    # unrolled: auto only on outputs of at most 28x28 (lenet-conv1: 24x24; vgg-conv2: 224x224)
    assert driver.chosen_config(unrolled, specs["lenet-conv1"], torch.float32)[1] == "auto"
    assert driver.chosen_config(unrolled, specs["vgg-conv2"], torch.float32)[1] == "default"
    assert driver.chosen_config(get_backend("dense"), specs["vgg-conv2"], torch.float32) == (None, "default")
    assert driver.BACKENDS == ("codegen", "unrolled", "im2col-cusparse", "dense")


def _record_profiled_calls(monkeypatch, events, fail_on_call=None):
    """NVTX ranges and F.conv2d calls appended to `events` (CPU: no NVTX, no CUDA); the `fail_on_call`-th
    convolution raises."""
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: events.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(("pop",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    conv2d = torch.nn.functional.conv2d

    def counted(*args, **kwargs):
        events.append(("conv",))
        if sum(event == ("conv",) for event in events) == fail_on_call:
            raise RuntimeError("kernel failed")
        return conv2d(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv2d", counted)


def test_driver_profiles_exactly_one_call_after_the_warm_up(monkeypatch):
    driver, events = _driver(), []
    _record_profiled_calls(monkeypatch, events)
    spec = get_suite("dong", batch=2)[0]
    weight, x = torch.randn(spec.weight_shape), torch.randn(spec.input_shape)
    entry = driver.profile_backend("dense", spec, weight, x, warmup=2)
    assert entry == {"layer": "lenet-conv1", "backend": "dense", "range": "lenet-conv1/dense", "status": "profiled",
                     "reason": None, "config": None, "config_source": "default"}
    assert events == [("conv",), ("conv",), ("push", "ncu_dong"), ("push", "lenet-conv1/dense"), ("conv",),
                      ("pop",), ("pop",)]


def test_driver_pops_its_ranges_and_skips_a_backend_that_fails(monkeypatch):
    driver, events = _driver(), []
    _record_profiled_calls(monkeypatch, events, fail_on_call=3)  # the profiled call
    spec = get_suite("dong", batch=2)[0]
    entry = driver.profile_backend("dense", spec, torch.randn(spec.weight_shape), torch.randn(spec.input_shape), 2)
    assert entry["status"] == "skipped" and entry["reason"] == "RuntimeError: kernel failed"
    assert events[-2:] == [("pop",), ("pop",)]
    # a backend that refuses the layer is never bound or called
    events.clear()
    dilated = dataclasses.replace(spec, dilation=(2, 2))
    refused = driver.profile_backend("codegen", dilated, torch.randn(spec.weight_shape), torch.randn(spec.input_shape),
                                     2)
    assert refused["status"] == "skipped" and "dilation" in refused["reason"] and events == []
