"""Top-1 accuracy of every registered pruning method on the digits data, as a markdown table and JSON lines.

For each model a dense network is trained once with a fixed seed; every (method, sparsity) pair
then prunes and fine-tunes its own copy of it. Methods come from the registry
(`sparsecnn.prune.method_names()`) and every pruned model is also evaluated after each quantisation
scheme of `sparsecnn.prune.quantize.QUANTIZERS`, so methods and schemes added later appear without
changes here.

    PYTHONPATH=src python scripts/accuracy_table.py            # all methods, 0.8 / 0.9 / 0.95
    PYTHONPATH=src python scripts/accuracy_table.py --methods magnitude --sparsities 0.9 --md /tmp/a.md
    PYTHONPATH=src python scripts/accuracy_table.py --methods reprune-tiles --options '{"reprune-tiles": {"tile": 16}}'

Writes `docs/accuracy.md` and `benchmarks/results/<UTC date>-cpu-accuracy.jsonl` (one row per
model x method x sparsity x quantisation, plus one "dense" row per model). Row fields: run, the
environment fields of ARCHITECTURE.md's schema, threads, kind "accuracy", model, method,
target_sparsity, sparsity (measured over the pruned layers), quantize ("none" or a scheme), data,
train_samples, test_samples, seed, dense_top1, top1 and delta (percent), seconds (wall time of
pruning + fine-tuning, of quantising for quantised rows, of dense training for the dense row).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.data import load_digits_split
from sparsecnn.models import build_model, default_input_shape
from sparsecnn.prune import method_names, prune_with, sparsity_report
from sparsecnn.prune.methods import top1_accuracy, train_dense_
from sparsecnn.prune.quantize import QUANTIZERS

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("lenet5", "alexnet-cifar")
# Dense training per model (epochs, learning rate): where test accuracy stops improving on digits,
# so a pruned model's extra fine-tuning epochs cannot make it look better than dense.
DENSE_TRAINING = {"lenet5": (8, 0.02), "alexnet-cifar": (16, 0.02), "resnet18-cifar": (16, 0.02)}


def dense_model(name: str, split, seed: int) -> torch.nn.Module:
    epochs, lr = DENSE_TRAINING[name]
    torch.manual_seed(seed)
    model = build_model(name)
    train_dense_(model, split, epochs, lr=lr, seed=seed)
    return model


def measure(name: str, methods: List[str], sparsities: List[float], seed: int, run: dict,
            options: Optional[Dict[str, dict]] = None) -> List[dict]:
    """Rows for one model: the dense row, then one per method and sparsity (`options[method]`: that
    method's options, recorded in its rows as "options")."""
    options = options or {}
    split = load_digits_split(default_input_shape(name), seed=seed)
    started = time.perf_counter()
    dense = dense_model(name, split, seed)
    dense_top1 = top1_accuracy(dense, split)
    common = dict(run, model=name, data="digits", train_samples=len(split.train_y),
                  test_samples=len(split.test_y), seed=seed, dense_top1=dense_top1)
    rows = [dict(common, kind="accuracy", method="dense", target_sparsity=0.0, sparsity=0.0, quantize="none",
                 top1=dense_top1, delta=0.0, seconds=time.perf_counter() - started)]
    for method in methods:
        for target in sparsities:
            model, started = copy.deepcopy(dense), time.perf_counter()
            masks = prune_with(method, model, split, target, seed=seed, **options.get(method, {}))
            pruned = dict(common, kind="accuracy", method=method, target_sparsity=target,
                          **({"options": options[method]} if method in options else {}),
                          sparsity=sparsity_report(model, masks)[-1]["sparsity"])
            top1 = top1_accuracy(model, split)
            rows.append(dict(pruned, quantize="none", top1=top1, delta=top1 - dense_top1,
                             seconds=time.perf_counter() - started))
            print(f"{name:14s} {method:12s} {target:.2f}  top-1 {top1:6.2f}%  (dense {dense_top1:.2f}%)  "
                  f"{rows[-1]['seconds']:.0f} s", flush=True)
            rows += quantized_rows(model, split, pruned)
    return rows


def quantized_rows(model: torch.nn.Module, split, pruned: dict) -> List[dict]:
    """One row per `QUANTIZERS` scheme applied to the pruned `model` (calibrated on 256 training images)."""
    rows = []
    for scheme, quantize in QUANTIZERS.items():
        started = time.perf_counter()
        quantized, _ = quantize(model, split.train_x[:256])
        top1 = top1_accuracy(quantized, split)
        rows.append(dict(pruned, quantize=scheme, top1=top1, delta=top1 - pruned["dense_top1"],
                         seconds=time.perf_counter() - started))
    return rows


def markdown(rows: List[dict], models: List[str]) -> str:
    """Unquantised rows: method x sparsity, a top-1 and a delta-vs-dense column per model."""
    rows = [r for r in rows if r["quantize"] == "none"]
    by_key: Dict[tuple, dict] = {(r["method"], r["target_sparsity"], r["model"]): r for r in rows}
    keys = list(dict.fromkeys((r["method"], r["target_sparsity"]) for r in rows))
    header = "| method | sparsity | " + " | ".join(f"{m} top-1 % | {m} Δ vs dense" for m in models) + " |"
    lines = [header, "|---|---:|" + "---:|---:|" * len(models)]
    for method, target in keys:
        cells = []
        for model in models:
            row = by_key.get((method, target, model))
            cells += ["", ""] if row is None else [f"{row['top1']:.2f}", f"{row['delta']:+.2f}"]
        lines.append(f"| {method} | {target:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quantized_markdown(rows: List[dict], model: str) -> str:
    """`model`'s pruned rows: method x sparsity, a top-1 column per quantisation scheme ("none" first)."""
    rows = [r for r in rows if r["model"] == model and r["method"] != "dense"]
    schemes = list(dict.fromkeys(r["quantize"] for r in rows))
    by_key = {(r["method"], r["target_sparsity"], r["quantize"]): r for r in rows}
    keys = list(dict.fromkeys((r["method"], r["target_sparsity"]) for r in rows))
    lines = ["| method | sparsity | " + " | ".join(schemes) + " |", "|---|---:|" + "---:|" * len(schemes)]
    for method, target in keys:
        cells = [f"{by_key[(method, target, scheme)]['top1']:.2f}" for scheme in schemes]
        lines.append(f"| {method} | {target:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page(rows: List[dict], models: List[str], env: dict, threads: int) -> str:
    first = rows[0]
    dense = ", ".join(f"{m} {DENSE_TRAINING[m][0]} epochs at lr {DENSE_TRAINING[m][1]}" for m in models)
    return "\n".join([
        "# Accuracy after pruning",
        "",
        f"Top-1 accuracy on the held-out digits test split ({first['test_samples']} images; one image is "
        f"{100 / first['test_samples']:.2f} points) after each registered pruning method and masked "
        f"fine-tuning, against the dense model it started from. scikit-learn's 8x8 digits, resized to each "
        f"model's input, {first['train_samples']} training images, seed {first['seed']}. Dense training: "
        f"{dense} (SGD, momentum 0.9, cosine decay). Pruned layers: every conv and every linear layer but "
        f"the classifier (`sparsecnn.prune.pruned_layers`), each to exactly the target sparsity; method "
        f"options are the registry defaults.",
        "",
        markdown(rows, models),
        "",
        "## After quantisation",
        "",
        "Top-1 % of each pruned model above after every `sparsecnn.prune.quantize.QUANTIZERS` scheme "
        "(no re-training; fixed point calibrated on 256 training images; `none` repeats the table above).",
        "",
        *[f"### {model}\n\n{quantized_markdown(rows, model)}\n" for model in models],
        f"Produced by `scripts/accuracy_table.py` on CPU (threads: {threads}, torch {env['torch']}, commit "
        f"{env['commit']}, {env['date']}); raw rows in `benchmarks/results/{env['date'][:10]}-cpu-accuracy.jsonl`.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=None, help="comma-separated (default: every registered method)")
    parser.add_argument("--sparsities", default="0.8,0.9,0.95")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", type=json.loads, default={},
                        help='JSON {method: {option: value}}, e.g. \'{"reprune-tiles": {"tile": 16}}\' '
                             "(default: the registry defaults)")
    # One thread: these models are too small to gain from more, and it runs beside other jobs.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--md", type=Path, default=ROOT / "docs" / "accuracy.md")
    parser.add_argument("--jsonl", type=Path, default=None, help="default: benchmarks/results/<date>-cpu-accuracy.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(DENSE_TRAINING))
    if unknown:
        raise SystemExit(f"--models: no dense training settings for {', '.join(unknown)}; known: {', '.join(MODELS)}")
    methods = method_names() if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    sparsities = [float(s) for s in args.sparsities.split(",")]
    env = environment("cpu")
    run = dict(run=new_run_id(), **env, threads=args.threads)
    rows = [row for name in models for row in measure(name, methods, sparsities, args.seed, run, args.options)]
    jsonl = args.jsonl or ROOT / "benchmarks" / "results" / f"{env['date'][:10]}-cpu-accuracy.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with jsonl.open("a") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(page(rows, models, env, args.threads))
    print(f"\n{markdown(rows, models)}\n\n{len(rows)} rows appended to {jsonl}; table written to {args.md}")


if __name__ == "__main__":
    main()
