"""Experiment (session 15): sibling convs merged (`nn/merge.py`) against the same model unmerged.

GoogLeNet's inception blocks run three 1x1 convs on one input; `prepare_for_inference` now merges
them into one conv per block. This runs `bench_model` twice per model in one process and one run
id: first with the merge pass replaced by a no-op, then as shipped. Each call measures its own
dense cuDNN rows, so every ratio is within the call. fp32, N=32, 0.9, modes eager and cudagraph.
Rows carry `"experiment": {"merge_siblings": bool}`.
Usage: python benchmarks/experiments/2026-11-23-s15-merge-siblings.py --out FILE [--models googlenet]
"""
from __future__ import annotations

import argparse
import contextlib
import json
from unittest import mock

from sparsecnn.bench.env import new_run_id
from sparsecnn.bench.models import bench_model
from sparsecnn.nn import fuse


def _table(rows) -> str:
    eager = next(r["median_ms"] for r in rows if r["backend"] == "cudnn" and r["mode"] == "eager")
    return "\n".join(f"  {r['backend']:6s} {r['mode']:9s} {r['median_ms']:8.4f} ms  {eager / r['median_ms']:.3f}x "
                     f"over dense eager  rel_err {r['rel_err']:.1e}" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="googlenet")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    run = new_run_id()
    with open(args.out, "a") as out:
        for name in args.models.split(","):
            for merged in (False, True):
                patch = (contextlib.nullcontext() if merged
                         else mock.patch.object(fuse, "merge_sibling_convs", lambda gm: {}))
                with patch:
                    rows = bench_model(name, batch=args.batch, dtype="fp32", sparsity=0.9, pattern="random",
                                       device="cuda", modes=("eager", "cudagraph"), run_id=run, progress=False)
                for row in rows:
                    row["experiment"] = {"merge_siblings": merged}
                    out.write(json.dumps(row) + "\n")
                print(f"{name} merge_siblings={merged}\n{_table(rows)}", flush=True)


if __name__ == "__main__":
    main()
