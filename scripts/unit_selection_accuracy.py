"""Accuracy of the unit shapes `reprune-select` chooses (issue 45, item 6), on the digits data, CPU.

Per model and seed: the dense model of `accuracy_table.dense_model`; "magnitude" given every epoch
(--epochs + --retrain-epochs); "reprune-select" over --shapes with --steps rounds (and, with
--one-shot, also one round), --epochs of magnitude pruning and --retrain-epochs per trial, the
accuracy budget 0.5 points on its held-out part of the training data. The test split scores both.

The tensor-core speed of a shape cannot be measured on a CPU, so the shapes are ranked by
ASSUMED_GAINS: the order measured on ResNet-50's layers (64 x 32 the fastest packing on most of
them, RESULTS.md), not on these models. What this measures is the search's accuracy side: which
shape it backs off to, and what that costs on the test split.

    PYTHONPATH=src python scripts/unit_selection_accuracy.py OUT.jsonl --models lenet5 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_table import dense_model  # noqa: E402

from sparsecnn.bench.env import environment, new_run_id  # noqa: E402
from sparsecnn.data import load_digits_split  # noqa: E402
from sparsecnn.models import default_input_shape  # noqa: E402
from sparsecnn.prune import UnitSelectionConfig, prune_with  # noqa: E402
from sparsecnn.prune.methods import top1_accuracy  # noqa: E402

ASSUMED_GAINS = {(64, 32): 3.0, (32, 32): 2.0, (32, 16): 1.8, (16, 16): 1.5}


def ranked_speed(shapes):
    """A `MeasureGains` for `measure_unit_gains`, which calls it once per shape, in the order of
    `shapes`: every conv gets that shape's ASSUMED_GAINS."""
    answers = iter(ASSUMED_GAINS[shape] for shape in shapes)
    return lambda copy_, inputs, convs: dict.fromkeys(convs, next(answers))


def rows_for(name: str, seed: int, args, run: dict):
    split = load_digits_split(default_input_shape(name), seed=seed)
    dense = dense_model(name, split, seed)
    dense_top1 = top1_accuracy(dense, split)
    common = dict(run, model=name, data="digits", seed=seed, dense_top1=dense_top1, target_sparsity=args.sparsity,
                  kind="accuracy", quantize="none")
    started = time.perf_counter()
    model = copy.deepcopy(dense)
    prune_with("magnitude", model, split, args.sparsity, seed=seed, epochs=args.epochs + args.retrain_epochs)
    top1 = top1_accuracy(model, split)
    yield dict(common, method="magnitude", options={"epochs": args.epochs + args.retrain_epochs}, top1=top1,
               delta=top1 - dense_top1, seconds=time.perf_counter() - started)
    for steps in ([1] if args.one_shot else []) + [args.steps]:
        started = time.perf_counter()
        model = copy.deepcopy(dense)
        units = UnitSelectionConfig(shapes=args.shapes, accuracy_budget=args.budget, steps=steps)
        prune_with("reprune-select", model, split, args.sparsity, seed=seed, epochs=args.epochs,
                   retrain_epochs=args.retrain_epochs, units=units, measure_unit_speed=ranked_speed(units.shapes))
        report = model.sparsecnn_selection
        top1 = top1_accuracy(model, split)
        plan = None if report.plan is None else {conv: f"{t}x{c}" for conv, (t, c) in report.plan.items()}
        yield dict(common, method="reprune-select",
                   options={"shapes": [f"{t}x{c}" for t, c in units.shapes], "steps": steps, "budget": args.budget,
                            "epochs": args.epochs, "retrain_epochs": args.retrain_epochs, "gains": "assumed"},
                   plan=plan, holdout_top1=report.baseline_top1,
                   trials=[[{c: f"{t}x{k}" for c, (t, k) in p.items()}, t1] for p, t1 in report.trials],
                   top1=top1, delta=top1 - dense_top1, seconds=time.perf_counter() - started)


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", type=Path)
parser.add_argument("--models", nargs="+", default=["lenet5", "alexnet-cifar"])
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
parser.add_argument("--sparsity", type=float, default=0.9)
parser.add_argument("--shapes", type=lambda text: tuple(tuple(int(p) for p in s.split("x")) for s in text.split(",")),
                    default=((64, 32), (32, 32), (16, 16)))
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--one-shot", action="store_true", help="also reprune-select in one round")
parser.add_argument("--budget", type=float, default=0.5)
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--retrain-epochs", type=int, default=8)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)
run = dict(run=new_run_id(), **environment("cpu"), threads=args.threads)
for name in args.models:
    for seed in args.seeds:
        for row in rows_for(name, seed, args, run):
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(f"{name} seed {seed} {row['method']} {row['options'].get('steps', '')}: top-1 {row['top1']:.2f} "
                  f"(dense {row['dense_top1']:.2f}) plan {row.get('plan')}", flush=True)
