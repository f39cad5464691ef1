"""Experiment (session 15): per-layer tuning with and without the L2 flush before each timed call.

The tuner times every candidate after flushing the L2 (`autotune.benchmark`), so each layer reads its
input from DRAM. In a model the input was just written by the layer before and mostly sits in the
50 MB L2 (ResNet-50's 14x14 and 7x7 activations at N=32 are 1.6-6.4 MB). The merge experiment of
this session saw per-layer times (flushed) that the whole model did not: three sibling convs
0.67 ms flushed, 0.49 ms merged, and the same model time. This tunes each model twice in one
process and one run id, with separate decision caches: as shipped, then with the tuner's benchmark
called with flush_l2=False. Each `bench_model` call measures its own dense rows (fp32, N=32, 0.9).
Rows carry `"experiment": {"tune_flush_l2": bool}`.
Usage: python benchmarks/experiments/2026-11-23-s15-tune-l2.py --out FILE [--models resnet50,googlenet]
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

PATTERNS = {"resnet50": "dlmc-magnitude_pruning"}


def _table(rows) -> str:
    eager = next(r["median_ms"] for r in rows if r["backend"] == "cudnn" and r["mode"] == "eager")
    return "\n".join(f"  {r['backend']:6s} {r['mode']:9s} {r['median_ms']:8.4f} ms  {eager / r['median_ms']:.3f}x "
                     f"over dense eager  tune {r['config'].get('tune_s') if r['config'] else '-'}" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="resnet50,googlenet")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    run = new_run_id()
    with open(args.out, "a") as out:
        for name in args.models.split(","):
            for flush in (True, False):
                os.environ["SPARSECNN_CACHE_DIR"] = f"/tmp/sc-tune-l2-{flush}"
                patch = (contextlib.nullcontext() if flush else
                         mock.patch.object(select, "benchmark", functools.partial(select.benchmark, flush_l2=False)))
                with patch:
                    rows = bench_model(name, batch=args.batch, dtype="fp32", sparsity=0.9,
                                       pattern=PATTERNS.get(name, "random"), device="cuda",
                                       modes=("eager", "cudagraph"), run_id=run, progress=False)
                for row in rows:
                    row["experiment"] = {"tune_flush_l2": flush}
                    out.write(json.dumps(row) + "\n")
                print(f"{name} tune_flush_l2={flush}\n{_table(rows)}", flush=True)


if __name__ == "__main__":
    main()
