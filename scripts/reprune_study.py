"""Re-pruning study (paper 000, Sec. 5 and 6.3): lenet5 accuracy on digits against B3, and with
--gpu the speed of backend `blocks` on pruned against re-pruned layers.

Accuracy, per seed (on --device): train lenet5 dense (--dense-epochs); prune conv1, conv2, fc1 by
magnitude to --sparsity and fine-tune (the registry's "magnitude" method, --finetune-epochs). From
that pruned model: "pruned+retrain" trains --retrain-epochs more with its own masks (the control:
the same extra training, no re-pruning); for each B3 in --b3, "reprune" re-prunes the convs
(Algorithm 1 with t2 = --t2, t1 = B1 = B2 = 8, then `reprune_`) and re-trains --retrain-epochs
with the re-training masks (zeros inside dense blocks trainable). Prints a markdown table (means
over seeds) and writes one JSON line per model and seed to --out (own fields plus the environment:
device, torch, triton, driver, commit, date).

--gpu adds layer timings (CUDA events, L2 flushed: `sparsecnn.tuning.timing.benchmark`; replays
of a CUDA graph unless --mode eager) in one --dtype: cuDNN dense, and backend `blocks` (its candidate tiles at the layer's t2, the fastest
kept) on the pruned weight and, per B3, on the re-pruned weight two ways: "kept" packs the
re-pruned blocks and remainder as they are (the paper's flow), "re-extracted" passes the re-pruned
weight through the backend's `prepare`, which runs Algorithm 1 again. Layer sets: lenet5's convs
(seed 0's pruned model, batch --lenet-batch; timings do not depend on the values, so the
re-pruned weights are timed before re-training) and the DLMC ResNet-50 masks (--dlmc-set,
N(0, 2 / fan_in) values, batch --dlmc-batch, t2 = --dlmc-t2 or the backend's default for the
dtype), re-pruned without re-training. One `bench.schema` row per timing to --gpu-out; the
pattern names the variant ("<base>+reprune-b3=0.2-kept"). A markdown table per layer set.

    PYTHONPATH=src python scripts/reprune_study.py                  # accuracy only (CPU)
    PYTHONPATH=src python scripts/reprune_study.py --gpu [--quick]  # + timings; SPARSECNN_DLMC: masks
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

try:
    import sparsecnn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.data import Batches, load_digits_split
from sparsecnn.data.digits import DigitsSplit
from sparsecnn.backends.blocks.format import BlockParams, extract_blocks
from sparsecnn.models import build_model
from sparsecnn.prune.methods import get_method, training_batches
from sparsecnn.prune.reprune import reprune_, reprune_layer
from sparsecnn.prune.training import TrainConfig, accuracy, train_epochs

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CONVS = ("conv1", "conv2")
DLMC_QUICK = ("layer1.0.conv3", "layer2.1.conv3", "layer3.0.conv1", "layer3.1.conv3", "layer4.0.conv1",
              "layer4.1.conv3")


# --- accuracy -------------------------------------------------------------------------------------

def digits(args) -> DigitsSplit:
    split = load_digits_split((1, 28, 28), seed=0)
    if args.train_subset:
        split = DigitsSplit(split.train_x[:args.train_subset], split.train_y[:args.train_subset],
                            split.test_x, split.test_y)
    return split.to(args.device)


def conv_structure(model, masks, params: BlockParams) -> Dict[str, dict]:
    """Algorithm 1's view of each pruned conv: non-zeros, remainder non-zeros, share in blocks."""
    modules = dict(model.named_modules())
    out = {}
    for name in CONVS:
        weight = modules[name].weight.detach().cpu() * masks[name].cpu()
        report = extract_blocks(weight, params).report
        out[name] = {"nnz": report.nnz, "remainder_nnz": report.nnz - report.nnz_in_blocks,
                     "share_in_blocks": report.share_in_blocks, "num_blocks": report.num_blocks}
    return out


def study_seed(seed: int, split: DigitsSplit, args, record) -> tuple:
    """All variants of one seed; returns (pruned model, its masks) for the timings."""
    torch.manual_seed(seed)
    test = Batches(split.test_x, split.test_y, 512)
    model = build_model("lenet5").to(args.device)
    train = Batches(split.train_x, split.train_y, 64, shuffle=True, seed=seed)
    train_epochs(model, train, TrainConfig(args.dense_epochs, args.lr, seed=seed), description="dense")
    record(seed, "dense", None, accuracy(model, test), {})
    masks = get_method("magnitude")(model, split, args.sparsity, seed=seed, epochs=args.finetune_epochs,
                                    lr=args.finetune_lr)
    params = BlockParams(t2=args.t2)
    record(seed, "pruned", None, accuracy(model, test), conv_structure(model, masks, params))
    control = copy.deepcopy(model)
    train_epochs(control, training_batches(control, split, seed=seed), TrainConfig(args.retrain_epochs, args.retrain_lr,
                 seed=seed), masks=masks, description="retrain")
    record(seed, "pruned+retrain", None, accuracy(control, test), conv_structure(control, masks, params))
    for b3 in args.b3:
        repruned = copy.deepcopy(model)
        _, retrain_masks, layers = reprune_(repruned, masks, b3, params)
        before_retrain = accuracy(repruned, test)
        train_epochs(repruned, training_batches(repruned, split, seed=seed),
                     TrainConfig(args.retrain_epochs, args.retrain_lr, seed=seed), masks=retrain_masks,
                     description="retrain")
        for name, stats in layers.items():
            stats["nnz_retrained"] = int(torch.count_nonzero(dict(repruned.named_modules())[name].weight))
        record(seed, "reprune", b3, accuracy(repruned, test), layers, accuracy_before_retrain=before_retrain)
    return model, masks


def accuracy_study(args, run: str, out: Path):
    split = digits(args)
    env = environment(args.device)
    rows = []

    def record(seed, variant, b3, acc, layers, **extra):
        row = dict(run=run, record="reprune-accuracy", **env, model="lenet5", data="digits", seed=seed,
                   variant=variant, b3=b3, sparsity=args.sparsity, t2=args.t2, accuracy=acc,
                   epochs={"dense": args.dense_epochs, "finetune": args.finetune_epochs,
                           "retrain": args.retrain_epochs}, layers=layers, **extra)
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"seed {seed} {variant:<15} b3={b3} accuracy={acc:.2f}", flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    pruned = [study_seed(seed, split, args, record) for seed in args.seeds]
    print(accuracy_table(rows))
    return pruned[0]


def _totals(layers: dict, when: str) -> tuple:
    """(non-zeros, remainder non-zeros) summed over the convs, `when` = "_before", "_after" or ""."""
    return (sum(s[f"nnz{when}"] for s in layers.values()), sum(s[f"remainder_nnz{when}"] for s in layers.values()))


def accuracy_table(rows: List[dict]) -> str:
    """Markdown: one line per variant (and B3), accuracies averaged over seeds; structure of the convs."""
    lines = ["| variant | B3 | accuracy % (mean; per seed) | conv remainder nnz before -> after | share of nnz "
             "in blocks (after re-prune -> after re-train) | emptied remainder rows / block rows / block cols "
             "| conv nnz after re-train |", "|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((row["variant"], row["b3"]) for row in rows))
    for variant, b3 in keys:
        group = [row for row in rows if (row["variant"], row["b3"]) == (variant, b3)]
        accs = [row["accuracy"] for row in group]
        acc = f"{statistics.mean(accs):.2f}; " + ", ".join(f"{a:.2f}" for a in accs)
        layers = group[0]["layers"]
        if variant == "reprune":
            nnz_before, rem_before = _totals(layers, "_before")
            nnz_after, rem_after = _totals(layers, "_after")
            retrained = sum(s["nnz_retrained"] for s in layers.values())
            share = (f"{(nnz_after - rem_after) / nnz_after:.2f} -> "
                     f"{(retrained - rem_after) / retrained:.2f}")
            emptied = "/".join(str(sum(s[key] for s in layers.values()))
                               for key in ("remainder_rows_emptied", "block_rows_removed", "block_cols_removed"))
            lines.append(f"| {variant} | {b3} | {acc} | {rem_before} -> {rem_after} | {share} | {emptied} "
                         f"| {retrained} |")
        elif layers:
            nnz, rem = _totals(layers, "")
            lines.append(f"| {variant} | - | {acc} | {rem} | {(nnz - rem) / nnz:.2f} | - | {nnz} |")
        else:
            lines.append(f"| {variant} | - | {acc} | - | - | - | - |")
    if len(rows) > len(keys):
        lines.append(f"\n(first seed's structure; {len(rows) // len(keys)} seeds)")
    return "\n".join(lines)


# --- GPU timings ----------------------------------------------------------------------------------

def gpu_study(args, run: str, pruned_model, pruned_masks) -> None:
    from sparsecnn.bench.schema import write_jsonl
    from sparsecnn.layers import get_suite
    from sparsecnn.layers.suites import specs_from_model

    if not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True  # cuDNN's fastest algorithm, as in the other benchmarks
    env = environment("cuda")
    out = args.gpu_out or RESULTS / f"{datetime.date.today()}-{_slug(env['device'])}-reprune.jsonl"
    specs = {s.name: s for s in specs_from_model(build_model("lenet5"), (args.lenet_batch, 1, 28, 28))}
    modules = dict(pruned_model.named_modules())
    lenet = [(specs[name], (modules[name].weight.detach() * pruned_masks[name]).float().cpu()) for name in CONVS]
    pattern = f"magnitude-{args.sparsity}"
    layer_sets = [("lenet5-digits", pattern, args.t2, lenet)]
    dlmc = dlmc_layers(args, get_suite)
    if dlmc:
        layer_sets.append(("resnet50", f"dlmc-{args.dlmc_set}", args.dlmc_t2 or _default_t2(args), dlmc))
    for suite, base, t2, layers in layer_sets:
        rows = []
        for spec, weight in layers:
            start = time.perf_counter()
            layer_rows = time_layer(spec, weight, t2, args)
            rows += [dict(run=run, kind="layer", **env, suite=suite, model=None, **spec.as_dict(), dtype=args.dtype,
                          pattern=base + tag, floor_ms=None, **fields) for tag, fields in layer_rows]
            print(f"{suite} {spec.name}: {len(layer_rows)} timings in {time.perf_counter() - start:.1f} s", flush=True)
        write_jsonl(rows, out)
        print(timing_table(suite, base, rows, args.b3))
    print(f"timings -> {out}")


def _slug(device: str) -> str:
    return "".join(ch for ch in device.lower().replace("nvidia", "").split()[0] if ch.isalnum()) or "gpu"


def _default_t2(args) -> int:
    """t2 of backend `blocks`' default config for --dtype (it depends on the dtype only)."""
    from sparsecnn.backends import get_backend
    from sparsecnn.core.spec import ConvSpec

    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    return get_backend("blocks").default_config(ConvSpec(1, 64, 64, 1, 1, 1, 1), dtype).t2


def dlmc_layers(args, get_suite) -> list:
    """(spec, float32 weight) of the DLMC ResNet-50 layers, or [] (with a note) if no masks."""
    from sparsecnn.prune import dlmc_layer_mask, dlmc_root

    try:
        dlmc_root()
    except FileNotFoundError as error:
        print(f"skipping DLMC ResNet-50: {error}")
        return []
    layers = []
    for index, spec in enumerate(get_suite("resnet50", args.dlmc_batch)):
        if (args.quick and spec.name not in DLMC_QUICK) or (args.dlmc_layers and spec.name not in args.dlmc_layers):
            continue
        generator = torch.Generator().manual_seed(1000 * args.seeds[0] + index)
        values = torch.randn(spec.weight_shape, generator=generator) * math.sqrt(2.0 / (spec.C * spec.R * spec.S))
        layers.append((spec, values * dlmc_layer_mask(args.dlmc_set, spec.name)))
    return layers


def time_layer(spec, weight: torch.Tensor, t2: int, args) -> List[tuple]:
    """(pattern suffix, row fields) of cuDNN and of `blocks` on the pruned and re-pruned weight."""
    from sparsecnn.tuning.timing import benchmark
    from sparsecnn.backends import get_backend
    from sparsecnn.core.reference import relative_error
    from sparsecnn.backends.blocks.kernel import BlocksWeight

    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(spec.input_shape, device="cuda", generator=generator).to(dtype)
    bias = (torch.randn(spec.K, device="cuda", generator=generator) * 0.1).to(dtype)
    backend = get_backend("blocks")
    configs = list(dict.fromkeys(dataclasses.replace(c, t2=t2) for c in backend.configs(spec, dtype)))
    decomposition = extract_blocks(weight, BlockParams(t2=t2))

    def timed(w: torch.Tensor, fn) -> dict:
        reference = F.conv2d(x[:2].double(), w.cuda().double(), bias.double(), spec.stride, spec.padding)
        rel_err = relative_error(fn()[:2], reference)
        replay, mode = fn, "eager"
        if args.mode == "cudagraph":
            try:
                replay, mode = _graphed(fn), "cudagraph"
            except RuntimeError as failure:  # a kernel that cannot be captured is timed eagerly; its row says so
                print(f"  {spec.name}: CUDA graph capture failed ({str(failure)[:120]}); timing eagerly")
        times = benchmark(replay, "cuda", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        return dict(times, rel_err=rel_err, mode=mode, sparsity=1.0 - int(torch.count_nonzero(w)) / w.numel())

    def blocks(w: torch.Tensor, pack) -> dict:
        """Fastest of `configs`, each packed by pack(config)."""
        best = None
        for config in configs:
            call = backend.bind(pack(config), spec, config, dtype, True)
            row = dict(timed(w, lambda: call(x, bias)), backend="blocks", config=dataclasses.asdict(config))
            best = row if best is None or row["median_ms"] < best["median_ms"] else best
        return best

    dense_weight = weight.to("cuda", dtype)
    rows = [("", dict(timed(weight, lambda: F.conv2d(x, dense_weight, bias, spec.stride, spec.padding)),
                      backend="cudnn", config=None))]
    rows.append(("", blocks(weight, lambda c: BlocksWeight.from_decomposition(decomposition, c, "cuda"))))
    for b3 in args.b3:
        result = reprune_layer(weight, decomposition, b3)
        repruned = weight * result.mask
        tag = f"+reprune-b3={b3}"
        rows.append((f"{tag}-kept", blocks(repruned, lambda c: BlocksWeight.from_decomposition(
            result.decomposition, c, "cuda"))))
        rows.append((f"{tag}-reextracted", blocks(repruned, lambda c: backend.prepare(repruned.cuda(), c))))
    return rows


def _graphed(fn):
    """fn captured in a CUDA graph; returns its replay. Eager launches of these small layers cost
    more CPU time than the 256 MB L2 flush before each repeat hides, so eager timings would
    measure Python launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (cuDNN picks its algorithm here)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timing_table(suite: str, base: str, rows: List[dict], b3s: List[float]) -> str:
    """Markdown: per layer, cuDNN ms and `blocks` ms (speedup over cuDNN) per variant; totals last."""
    variants = [("pruned", base)] + [(f"B3={b3} {how}", f"{base}+reprune-b3={b3}-{how}")
                                     for b3 in b3s for how in ("kept", "reextracted")]
    lines = [f"\n{suite}: blocks ms (x vs cuDNN dense)",
             "| layer | cuDNN ms | " + " | ".join(name for name, _ in variants) + " |",
             "|---|---" + "|---" * len(variants) + "|"]
    totals = [0.0] * (len(variants) + 1)
    for layer in dict.fromkeys(row["layer"] for row in rows):
        mine = [row for row in rows if row["layer"] == layer]
        cudnn = next(r["median_ms"] for r in mine if r["backend"] == "cudnn")
        cells, totals[0] = [], totals[0] + cudnn
        for index, (_, pattern) in enumerate(variants, 1):
            ms = next(r["median_ms"] for r in mine if r["backend"] == "blocks" and r["pattern"] == pattern)
            totals[index] += ms
            cells.append(f"{ms:.4f} (x{cudnn / ms:.2f})")
        lines.append(f"| {layer} | {cudnn:.4f} | " + " | ".join(cells) + " |")
    lines.append(f"| total | {totals[0]:.4f} | " + " | ".join(f"{t:.4f} (x{totals[0] / t:.2f})" for t in totals[1:])
                 + " |")
    return "\n".join(lines)


# --- driver ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--b3", type=float, nargs="+", default=[0.3, 0.2, 0.1])
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--t2", type=int, default=4, help="Algorithm 1's t2 for lenet5 (50 kernels: 8 finds no block)")
    parser.add_argument("--dense-epochs", type=int, default=10)
    parser.add_argument("--finetune-epochs", type=int, default=8)
    parser.add_argument("--retrain-epochs", type=int, default=4, help="paper: < 10")
    parser.add_argument("--lr", type=float, default=0.02, help="dense training")
    parser.add_argument("--finetune-lr", type=float, default=0.01)
    parser.add_argument("--retrain-lr", type=float, default=0.01)
    parser.add_argument("--train-subset", type=int, default=None, help="use only this many training images")
    parser.add_argument("--device", default=None, help="training device (default: cuda with --gpu, else cpu)")
    parser.add_argument("--out", type=Path, default=None,
                        help="accuracy JSON lines (default benchmarks/results/<date>-cpu-reprune.jsonl)")
    parser.add_argument("--gpu", action="store_true", help="also time the layers on the GPU")
    parser.add_argument("--quick", action="store_true", help="GPU: only a few DLMC layers")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="fp32: exact, TF32 off")
    parser.add_argument("--lenet-batch", type=int, default=256)
    parser.add_argument("--dlmc-set", default="magnitude_pruning-0.9")
    parser.add_argument("--dlmc-batch", type=int, default=32)
    parser.add_argument("--dlmc-layers", nargs="*", default=None, help="only these DLMC layers (default: all 53)")
    parser.add_argument("--dlmc-t2", type=int, default=None, help="default: the backend's default t2 for --dtype")
    parser.add_argument("--mode", choices=("cudagraph", "eager"), default="cudagraph",
                        help="time CUDA-graph replays (default) or eager calls")
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=50.0)
    parser.add_argument("--gpu-out", type=Path, default=None,
                        help="timing JSON lines (default benchmarks/results/<date>-<gpu>-reprune.jsonl)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    run = new_run_id()
    where = "cpu" if args.device == "cpu" else f"{_slug(environment(args.device)['device'])}-accuracy"
    out = args.out or RESULTS / f"{datetime.date.today()}-{where}-reprune.jsonl"
    start = time.perf_counter()
    model, masks = accuracy_study(args, run, out)
    print(f"accuracy study: {time.perf_counter() - start:.0f} s -> {out}")
    if args.gpu:
        gpu_study(args, run, model, masks)


if __name__ == "__main__":
    main()
