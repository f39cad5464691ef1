"""Experiment (session 15): one change A/B on whole models, both sides tuned and timed in one process.

`bench_model` runs twice per model with one run id: first with the change undone, then as shipped.
Each call measures its own dense cuDNN rows, so every ratio is within the call (fp32, N=32, 0.9,
modes eager and cudagraph). Rows carry `"experiment": {<change>: bool}` (True: as shipped).

Changes:
- merge-siblings: `prepare_for_inference` merges sibling convs (`nn/merge.py`); undone by replacing
  the pass with a no-op. GoogLeNet's inception blocks run three 1x1 convs on one input.
- tune-l2: the tuner times each candidate after an L2 flush (`autotune.benchmark`), so each layer
  reads its input from DRAM, while in a model it was just written and mostly sits in the 50 MB L2.
  "Undone" here means tuning with flush_l2=False; each side gets its own decision cache.

Usage: python benchmarks/experiments/2026-11-23-s15-model-ab.py --change {merge-siblings,tune-l2} --out FILE
       [--models googlenet,resnet50]
(Through 1f7838b the two were the scripts `2026-11-23-s15-merge-siblings.py` and `...-s15-tune-l2.py`,
which wrote `benchmarks/results/2026-11-23-h100-s15-merge-siblings-a132c5e.*` and `...-tune-l2-ddce370.*`
with "experiment" keys "merge_siblings" and "tune_flush_l2".)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from unittest import mock

from sparsecnn.autotune import select
from sparsecnn.bench.env import new_run_id
from sparsecnn.bench.models import bench_model
from sparsecnn.nn import fuse

PATTERNS = {"resnet50": "dlmc-magnitude_pruning"}


def _undone(change: str):
    """A context in which `change` is undone."""
    if change == "merge-siblings":
        return mock.patch.object(fuse, "merge_sibling_convs", lambda gm: {})
    return mock.patch.object(select, "benchmark", functools.partial(select.benchmark, flush_l2=False))


def _table(rows) -> str:
    eager = next(r["median_ms"] for r in rows if r["backend"] == "cudnn" and r["mode"] == "eager")
    return "\n".join(f"  {r['backend']:6s} {r['mode']:9s} {r['median_ms']:8.4f} ms  {eager / r['median_ms']:.3f}x "
                     f"over dense eager  tune {r['config'].get('tune_s') if r['config'] else '-'}" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--change", required=True, choices=("merge-siblings", "tune-l2"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="googlenet")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    run = new_run_id()
    with open(args.out, "a") as out:
        for name in args.models.split(","):
            for shipped in (False, True):
                os.environ["SPARSECNN_CACHE_DIR"] = f"/tmp/sc-{args.change}-{shipped}"
                with contextlib.nullcontext() if shipped else _undone(args.change):
                    rows = bench_model(name, batch=args.batch, dtype="fp32", sparsity=0.9,
                                       pattern=PATTERNS.get(name, "random"), device="cuda",
                                       modes=("eager", "cudagraph"), run_id=run, progress=False)
                for row in rows:
                    row["experiment"] = {args.change: shipped}
                    out.write(json.dumps(row) + "\n")
                print(f"{name} {args.change} {'as shipped' if shipped else 'undone'}\n{_table(rows)}", flush=True)


if __name__ == "__main__":
    main()
