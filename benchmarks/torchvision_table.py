"""torchvision models as a user runs them, pruned, against the model as given and against dense
`torch.compile(mode="max-autotune")` of it; ours through `sparsecnn.compile` in the same mode
(cells, models and rows: `torchvision_cells.py`).

Usage (GPU machine, a script without a `__main__` guard on purpose):
    python benchmarks/torchvision_table.py OUT.jsonl BUDGET_S [MODEL:DTYPE:BATCH[:PATTERN] ...]
Without cells, every one: resnet50, googlenet, mobilenet_v2, efficientnet_b0, vgg16 and
regnet_y_400mf in fp16 and fp32 at N=32 and N=1, pruned at random (PATTERN "tiles64x32i": into the
tiles backend tensorcore runs, `torchvision_cells.PATTERNS`). A cell is started only while BUDGET_S seconds have
not passed since the script began. One JSON line per (cell, backend, mode): the results schema of
ARCHITECTURE.md, backend "cudnn" (the model as given), "inductor" (it under max-autotune; config
{"compile_mode", "compile_s"}) or "auto" (ours; config: `torchvision_cells.ours_config`), mode
"eager" or "cudagraph", rel_err against the dense masked model in fp64. fp32 cells run at PyTorch's
defaults (TF32 convs): schema dtype "tf32". `scripts/warm_dense_compile.py --torchvision` fills
inductor's caches ahead; `torchvision_summary.py --max-autotune` makes the table and headline entries.
"""
import functools
import json
import sys
import time

import torch
from torchvision_cells import Setup, parse_cells, result_row, run_cells

from sparsecnn.bench.env import environment, new_run_id

START = time.time()
if len(sys.argv) < 3:
    raise SystemExit(__doc__)
OUT, BUDGET_S, CELLS = sys.argv[1], float(sys.argv[2]), parse_cells(sys.argv[3:])
DEVICE = torch.device("cuda")


def write(rows):
    with open(OUT, "a") as out:
        out.writelines(json.dumps(result) + "\n" for result in rows)


run_cells(CELLS, Setup(DEVICE), functools.partial(result_row, environment(DEVICE), new_run_id()), write, BUDGET_S,
          START)
