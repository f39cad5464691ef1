"""Cold tuning time of torchvision models as a user tunes them: `prepare_for_inference` + `sparsify_`
with `dtype=None` (an fp32 model at PyTorch's defaults tunes under "fp32-default"), each run from an
empty decision cache, the model pruned as in `torchvision_cells.pruned` (random weights, groups=1
convs magnitude-pruned to 0.9, BatchNorm calibrated).

Usage (GPU machine, a script without a `__main__` guard on purpose):
    python benchmarks/tuning_time.py OUT.jsonl BATCH RUNS MODEL... [--stacks DIR]
Run 1 is fully cold (the process's first tuning: Triton compiles its kernels, or loads them from
TRITON_CACHE_DIR when warm); then "reload" tunes the model again from run 1's decision cache (a user's
cached reload); later runs find Triton's kernels compiled and time every candidate again.
One JSON line per (model, run): `torchvision_cells.tuning_rows` (kind "tuning", median_ms null,
config with the seconds of tuning and of each phase). --stacks DIR: run 1 under
`stack_sampler.StackSampler`, its report in DIR/stacks-MODEL.txt (where each thread's wall time went).
"""
import argparse
import contextlib
import json
from pathlib import Path

import torch
from stack_sampler import StackSampler
from torchvision_cells import Setup, tuning_rows

from sparsecnn.bench.env import environment, new_run_id

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out")
parser.add_argument("batch", type=int)
parser.add_argument("runs", type=int)
parser.add_argument("models", nargs="+")
parser.add_argument("--stacks", type=Path, help="directory for the stack sampler's report of each cold run")
ARGS = parser.parse_args()
OUT, BATCH, RUNS, MODELS, STACKS = ARGS.out, ARGS.batch, ARGS.runs, ARGS.models, ARGS.stacks
DEVICE = torch.device("cuda")
ENV, RUN_ID = environment(DEVICE), new_run_id()

for name in MODELS:
    sampler = StackSampler()
    rows = tuning_rows(name, Setup(DEVICE), BATCH, RUNS, ENV, RUN_ID,
                       around_cold=(lambda: sampler) if STACKS else contextlib.nullcontext)
    if STACKS:
        STACKS.mkdir(parents=True, exist_ok=True)
        (STACKS / f"stacks-{name}.txt").write_text(sampler.report() + "\n")
    for row in rows:
        with open(OUT, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{name} N={BATCH} run {row['config']['run']}: {row['config']}", flush=True)
