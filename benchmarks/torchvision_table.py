"""torchvision models as a user runs them: random weights, every groups=1 conv magnitude-pruned to 0.9,
BatchNorm statistics calibrated on random inputs (`pruned`),
`prepare_for_inference` + `sparsify_` with the defaults, against the dense model as given at PyTorch's
defaults (TF32 convs for fp32; fp16 channels_last), called eagerly and under a CUDA graph.

Usage (GPU machine, a script without a `__main__` guard on purpose):
    python benchmarks/torchvision_table.py OUT.jsonl BUDGET_S MODEL:DTYPE:BATCH[:max-autotune] ...
One JSON line per (model, dtype, batch, variant, mode): the results schema of ARCHITECTURE.md with
backend "cudnn" (the dense model as given) or "auto" (ours), mode "eager" or "cudagraph", rel_err
against the dense masked model in fp64, and config {"policy", "tune_s", "kept", "sparse_layers"}.
A cell ending in ":max-autotune" also times the model as given under `torch.compile(mode=
"max-autotune")` (which replays CUDA graphs itself): backend "inductor", mode "eager" (plain calls)
and "cudagraph" (the same calls, GPU time alone), config {"compile_mode", "compile_s"} (the first
call's seconds; `scripts/warm_dense_compile.py --torchvision` fills inductor's caches ahead).
A model is started only while BUDGET_S seconds have not passed since the script began.
"""
import copy
import json
import sys
import time

import torch
import torchvision

import sparsecnn
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.models import capture_cuda_graph
from sparsecnn.core.reference import relative_error
from sparsecnn.nn import SparseConv2d
from sparsecnn.prune import prune_magnitude_
from sparsecnn.tuning.timing import benchmark, eager_benchmark

START = time.time()
OUT, BUDGET_S, CELLS = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
DEVICE = torch.device("cuda")
RUN = new_run_id()
ENV = environment(DEVICE)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
CALIBRATION_BATCHES = 4


def pruned(name):
    """The model with random weights, every groups=1 conv magnitude-pruned to 0.9, and BatchNorm
    statistics calibrated on random inputs (CALIBRATION_BATCHES in train mode, on the CPU's copy
    moved to the GPU and back), as a trained model's would be: with the initial statistics (mean 0,
    variance 1) activations grow layer by layer and overflow fp16 (mobilenet_v2 and efficientnet_b0
    gave rel_err 1.0, the dense model's too)."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    prune_magnitude_(model, 0.9, filter_fn=lambda _, module: module.groups == 1)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None   # a plain average over the calibration batches
    model.to(DEVICE).train()
    with torch.no_grad():
        for _ in range(CALIBRATION_BATCHES):
            model(torch.randn(16, 3, 224, 224, device=DEVICE))
    return model.eval().cpu()


def timed(model, x, ref):
    """{mode: (stats, rel_err)} for plain calls and for our own graph capture."""
    with torch.no_grad():
        eager_out = model(x)
        results = {"eager": (eager_benchmark(lambda: model(x), DEVICE), relative_error(eager_out, ref))}
        replay, output = capture_cuda_graph(model, x)  # as a user capturing the model would
        results["cudagraph"] = (benchmark(replay, DEVICE), relative_error(output(), ref))
    return results


def row(name, dtype, batch, backend, mode, stats, err, config):
    """A results row; fp32 cells run at PyTorch's defaults (TF32 convs): schema dtype "tf32"."""
    dtype = "tf32" if dtype == "fp32" else dtype
    return {**ENV, "run": RUN, "kind": "model", "suite": "torchvision", "layer": None, "model": name, "N": batch,
            "C": None, "K": None, "H": None, "W": None, "R": None, "S": None, "stride": None, "padding": None,
            "dtype": dtype, "sparsity": 0.9, "pattern": "random", "backend": backend, "config": config, "mode": mode,
            "median_ms": stats["median_ms"], "p20_ms": stats.get("p20_ms"), "p80_ms": stats.get("p80_ms"),
            "rel_err": err, "floor_ms": None}


def max_autotune_rows(name, dtype, batch, given, x, ref):
    """The model as given under torch.compile max-autotune, timed as `timed` times ours."""
    compiled = torch.compile(given, mode="max-autotune")
    with torch.no_grad():
        start = time.perf_counter()
        output = compiled(x)
        torch.cuda.synchronize()
        config = {"compile_mode": "max-autotune", "compile_s": round(time.perf_counter() - start, 1)}
        err = relative_error(output, ref)
        stats = {"eager": eager_benchmark(lambda: compiled(x), DEVICE),
                 "cudagraph": benchmark(lambda: compiled(x), DEVICE)}
    torch._dynamo.reset()  # its CUDA graphs and their memory pool go before ours are captured
    return [row(name, dtype, batch, "inductor", mode, stats[mode], err, config) for mode in stats]


def cell(name, dtype, batch, max_autotune):
    stored = DTYPES[dtype]
    layout = torch.channels_last if dtype == "fp16" else torch.contiguous_format
    model = pruned(name)
    x = torch.randn(batch, 3, 224, 224, device=DEVICE)
    with torch.no_grad():
        ref = copy.deepcopy(model).to(DEVICE).double()(x.double())
    x = x.to(stored).contiguous(memory_format=layout)
    given = copy.deepcopy(model).to(DEVICE, stored).to(memory_format=layout)
    rows = [row(name, dtype, batch, "cudnn", mode, stats, err, None)
            for mode, (stats, err) in timed(given, x, ref).items()]
    if max_autotune:
        rows += max_autotune_rows(name, dtype, batch, given, x, ref)
    del given
    start = time.perf_counter()
    ours = copy.deepcopy(model).to(DEVICE, stored).to(memory_format=layout)
    try:
        ours = sparsecnn.prepare_for_inference(ours)
    except Exception as error:  # noqa: BLE001  (not fx-traceable: sparsify_ alone, as the README says)
        print(f"{name}: prepare_for_inference failed ({type(error).__name__}: {error}); sparsify_ alone")
    with torch.no_grad():
        sparsecnn.sparsify_(ours, x, dtype=None if dtype == "fp32" else dtype, progress=False)
    report = ours.sparsecnn_report
    config = {"policy": report.policy, "tune_s": round(time.perf_counter() - start, 1),
              "kept": report.model_check.kept if report.model_check else None,
              "sparse_layers": sum(isinstance(m, SparseConv2d) and not m.backend.startswith("dense")
                                   for m in ours.modules()),
              "layers": sum(isinstance(m, SparseConv2d) for m in ours.modules())}
    rows += [row(name, dtype, batch, "auto", mode, stats, err, config)
             for mode, (stats, err) in timed(ours, x, ref).items()]
    return rows


with open(OUT, "a") as out:
    for spec in CELLS:
        if time.time() - START > BUDGET_S:
            print(f"budget spent: {spec} not started")
            continue
        name, dtype, batch, *extra = spec.split(":")
        if extra not in ([], ["max-autotune"]):
            raise ValueError(f"cell {spec!r}: expected MODEL:DTYPE:BATCH[:max-autotune]")
        try:
            rows = cell(name, dtype, int(batch), extra == ["max-autotune"])
        except Exception as error:  # noqa: BLE001  (one model failing must not lose the others' rows)
            print(f"{spec}: FAILED {type(error).__name__}: {error}")
            continue
        for result in rows:
            out.write(json.dumps(result) + "\n")
        out.flush()
        ours_ms = {r["mode"]: r["median_ms"] for r in rows if r["backend"] == "auto"}
        for baseline in ("cudnn", "inductor"):
            dense = {r["mode"]: r["median_ms"] for r in rows if r["backend"] == baseline}
            print(f"{spec} vs {baseline}: " + ", ".join(
                f"{mode} {dense[mode] / ours_ms[mode]:.2f}x ({ours_ms[mode]:.3f} ms vs {dense[mode]:.3f})"
                for mode in dense), flush=True)
        print(f"{spec}: {rows[-1]['config']} [{time.time() - START:.0f} s]", flush=True)
