"""Cold tuning time of torchvision models as a user tunes them: `prepare_for_inference` + `sparsify_`
with `dtype=None` (an fp32 model at PyTorch's defaults tunes under "fp32-default"), each run from an
empty decision cache, the model pruned as in `torchvision_cells.pruned` (random weights, groups=1
convs magnitude-pruned to 0.9, BatchNorm calibrated).

Usage (GPU machine, a script without a `__main__` guard on purpose):
    python benchmarks/tuning_time.py OUT.jsonl BATCH RUNS MODEL...
Run 1 is fully cold (the process's first tuning: Triton compiles its kernels, or loads them from
TRITON_CACHE_DIR when warm); then "reload" tunes the model again from run 1's decision cache (a user's
cached reload); later runs find Triton's kernels compiled and time every candidate again.
One JSON line per (model, run): `torchvision_cells.tuning_rows` (kind "tuning", median_ms null,
config with the seconds of tuning and of each phase).
"""
import json
import sys

import torch
from torchvision_cells import Setup, tuning_rows

from sparsecnn.bench.env import environment, new_run_id

if len(sys.argv) < 5:
    raise SystemExit(__doc__)
OUT, BATCH, RUNS, MODELS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
DEVICE = torch.device("cuda")
ENV, RUN_ID = environment(DEVICE), new_run_id()

for name in MODELS:
    for row in tuning_rows(name, Setup(DEVICE), BATCH, RUNS, ENV, RUN_ID):
        with open(OUT, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{name} N={BATCH} run {row['config']['run']}: {row['config']}", flush=True)
