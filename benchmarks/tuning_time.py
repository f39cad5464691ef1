"""Cold tuning time of torchvision models as a user tunes them: `prepare_for_inference` + `sparsify_`
with `dtype=None` (an fp32 model at PyTorch's defaults tunes under "fp32-default"), each run from an
empty decision cache, the model pruned as in `torchvision_cells.pruned` (random weights, groups=1
convs magnitude-pruned to 0.9, BatchNorm calibrated).

Usage (GPU machine, a script without a `__main__` guard on purpose):
    python benchmarks/tuning_time.py OUT.jsonl BATCH RUNS MODEL...
Run 1 is fully cold (the process's first tuning: Triton compiles its kernels, or loads them from
TRITON_CACHE_DIR when warm); later runs find Triton's kernels compiled and time every candidate again.
One JSON line per (model, run): the results schema of ARCHITECTURE.md, kind "tuning", backend
"auto", median_ms null, config {"run", "tune_s", "phases_s", "policy", "sparse_layers", "layers",
"kept"}.
"""
import copy
import json
import sys
import tempfile
import time

import torch
from torchvision_cells import Setup, pruned

from sparsecnn import prepare_for_inference, sparsify_
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.nn import SparseConv2d

if len(sys.argv) < 5:
    raise SystemExit(__doc__)
OUT, BATCH, RUNS, MODELS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
DEVICE = torch.device("cuda")
ENV, RUN_ID = environment(DEVICE), new_run_id()


def tuned_row(name: str, run: int, model: torch.nn.Module, tune_s: float) -> dict:
    report = model.sparsecnn_report
    convs = [module for module in model.modules() if isinstance(module, (SparseConv2d, torch.nn.Conv2d))]
    config = {"run": run, "tune_s": round(tune_s, 2), "phases_s": {k: round(v, 2) for k, v in report.phase_s.items()},
              "policy": report.policy, "kept": report.model_check.kept if report.model_check else None,
              "sparse_layers": sum(isinstance(m, SparseConv2d) and not m.backend.startswith("dense") for m in convs),
              "layers": len(convs)}
    return {**ENV, "run": RUN_ID, "kind": "tuning", "suite": "torchvision", "layer": None, "model": name, "N": BATCH,
            "C": None, "K": None, "H": None, "W": None, "R": None, "S": None, "stride": None, "padding": None,
            "dtype": "tf32", "sparsity": 0.9, "pattern": "random", "backend": "auto", "config": config,
            "mode": "cudagraph", "median_ms": None, "p20_ms": None, "p80_ms": None, "rel_err": None, "floor_ms": None}


for name in MODELS:
    given = pruned(name, Setup(DEVICE))
    x = torch.randn(BATCH, 3, 224, 224, device=DEVICE)
    for run in range(1, RUNS + 1):
        model = prepare_for_inference(copy.deepcopy(given).to(DEVICE))
        with tempfile.TemporaryDirectory() as cache_dir:
            start = time.perf_counter()
            sparsify_(model, x, cache_dir=cache_dir, progress=False)
            torch.cuda.synchronize()
            row = tuned_row(name, run, model, time.perf_counter() - start)
        with open(OUT, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{name} N={BATCH} run {run}: {row['config']}", flush=True)
        del model
