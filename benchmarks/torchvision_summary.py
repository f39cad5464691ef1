"""RESULTS.md's torchvision table and headline.json's "torchvision ..." entries from the rows of
`torchvision_table.py`: per (model, dtype, N) the newest run's cell.

Usage: python benchmarks/torchvision_summary.py [--max-autotune] RESULTS_FILE.jsonl ...
Prints the markdown table; rewrites every "torchvision <model> <eager|graph> <dtype> N=<batch>"
entry of benchmarks/results/headline.json whose cell is in the files (other entries unchanged; an
entry's "readme" flag is kept, new entries get False). With --max-autotune: the cells that also timed
the model as given under torch.compile max-autotune (backend "inductor"), against it, entries
"torchvision <model> <eager|graph> <dtype> N=<batch> vs max-autotune".
"""
import json
import sys
from pathlib import Path

HEADLINE = Path(__file__).parent / "results" / "headline.json"
MODE_NAMES = {"eager": "eager", "cudagraph": "graph"}
DTYPE_TEXT = {"tf32": "fp32 at PyTorch's defaults (TF32 convs)", "fp16": "fp16 (channels_last)"}
CALL_TEXT = {"eager": "plain calls (ours replays its CUDA graphs)", "cudagraph": "captured by the caller in a CUDA graph"}


def cells(paths):
    """{(model, dtype, N): {(backend, mode): row}} of the newest run per cell, and its file."""
    newest = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            key = (row["model"], row["dtype"], row["N"])
            if key not in newest or row["date"] > newest[key][0]["date"]:
                newest[key] = (row, path, {})
            if newest[key][0]["run"] == row["run"]:
                newest[key][2][(row["backend"], row["mode"])] = row
    return {key: (rows, path) for key, (_, path, rows) in newest.items()}


INDUCTOR_TEXT = "the dense model as given under torch.compile(mode=\"max-autotune\"), its own CUDA graphs"


def ours_text(config):
    """How ours was made: sparsify_ (rows before issue 46) or sparsecnn.compile (config "compile_mode")."""
    counts = f"{config['sparse_layers']}/{config['layers']} convs sparse"
    if "compile_mode" not in config:
        return f"prepare_for_inference + sparsify_ defaults (policy {config['policy']}, kept {config['kept']}, {counts})"
    kept = "sparsified" if config["compiled_kept"] == "sparse" else "dense as given"
    return (f"sparsecnn.compile mode {config['compile_mode']}, called compiled (its own CUDA graphs; policy "
            f"{config['policy']}, tuned model kept {config['kept']}, compiled model kept: {kept}, "
            f"{config['to_inductor']} convs left to inductor, {counts})")


def entry(model, dtype, batch, mode, rows, path, readme, baseline="cudnn"):
    ours, dense = rows[("auto", mode)], rows[(baseline, mode)]
    config = ours["config"]
    text_dtype = "fp32" if dtype == "tf32" else dtype
    return {
        "name": f"torchvision {model} {MODE_NAMES[mode]} {text_dtype} N={batch}"
                + (" vs max-autotune" if baseline == "inductor" else ""),
        "what": f"torchvision {model}, random weights, groups=1 convs pruned to 0.9, BatchNorm calibrated on "
                f"random inputs, whole model, {DTYPE_TEXT[dtype]}, N={batch}, {CALL_TEXT[mode]}; ours: "
                f"{ours_text(config)}",
        "ours_ms": round(ours["median_ms"], 4),
        "baseline": (f"the dense model as given, {DTYPE_TEXT[dtype]}, {CALL_TEXT[mode]}" if baseline == "cudnn"
                     else f"{INDUCTOR_TEXT}, {DTYPE_TEXT[dtype]}, plain calls (compiled in "
                          f"{dense['config']['compile_s']} s)"),
        "baseline_ms": round(dense["median_ms"], 4),
        "ratio": round(dense["median_ms"] / ours["median_ms"], 3),
        "device": ours["device"], "commit": ours["commit"], "date": ours["date"][:10],
        "file": str(Path(path)),
        "versions": {name: ours[name] for name in ("torch", "cudnn", "triton", "driver")},
        "rows": {"run": ours["run"],
                 "ours": {"backend": "auto", "mode": mode, "model": model, "dtype": dtype, "N": batch},
                 "baseline": {"backend": baseline, "mode": mode, "model": model, "dtype": dtype, "N": batch}},
        "readme": readme,
    }


def as_given_table(found, made, flags):
    print("| model | dtype | N | eager | graph | ours ms (graph) | sparse convs | rel. error ours / dense | file |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for (model, dtype, batch), (rows, path) in sorted(found.items(), key=lambda item: (-item[0][2], item[0])):
        for mode in MODE_NAMES:
            item = entry(model, dtype, batch, mode, rows, path, False)
            made[item["name"]] = {**item, "readme": flags.get(item["name"], False)}
        ours, dense = rows[("auto", "cudagraph")], rows[("cudnn", "cudagraph")]
        ratios = [rows[("cudnn", mode)]["median_ms"] / rows[("auto", mode)]["median_ms"] for mode in MODE_NAMES]
        print(f"| {model} | {'fp32 (TF32 convs)' if dtype == 'tf32' else dtype} | {batch} | {ratios[0]:.2f}x | "
              f"{ratios[1]:.2f}x | {ours['median_ms']:.3f} | {ours['config']['sparse_layers']}/"
              f"{ours['config']['layers']} | {ours['rel_err']:.1e} / {dense['rel_err']:.1e} | `{Path(path).name}` |")


def max_autotune_table(found, made, flags):
    print("| model | dtype | N | GPU | vs max-autotune, plain calls | same, GPU time | ours ms | max-autotune ms "
          "| compile s | sparse convs | file |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for (model, dtype, batch), (rows, path) in sorted(found.items(), key=lambda item: (-item[0][2], item[0])):
        if ("inductor", "cudagraph") not in rows:
            continue
        for mode in MODE_NAMES:
            item = entry(model, dtype, batch, mode, rows, path, False, baseline="inductor")
            made[item["name"]] = {**item, "readme": flags.get(item["name"], False)}
        ours, dense = rows[("auto", "cudagraph")], rows[("inductor", "cudagraph")]
        ratios = [rows[("inductor", mode)]["median_ms"] / rows[("auto", mode)]["median_ms"] for mode in MODE_NAMES]
        gpu = ours["device"].replace("NVIDIA ", "")
        print(f"| {model} | {'fp32 (TF32 convs)' if dtype == 'tf32' else dtype} | {batch} | {gpu} | "
              f"{ratios[0]:.2f}x | {ratios[1]:.2f}x | {ours['median_ms']:.3f} | "
              f"{dense['median_ms']:.3f} | {dense['config']['compile_s']} | {ours['config']['sparse_layers']}/"
              f"{ours['config']['layers']} | `{Path(path).name}` |")


arguments = sys.argv[1:]
against_max_autotune = "--max-autotune" in arguments
found = cells([path for path in arguments if path != "--max-autotune"])
headline = json.loads(HEADLINE.read_text())
flags = {item["name"]: item.get("readme", False) for item in headline["entries"]}
made = {}
(max_autotune_table if against_max_autotune else as_given_table)(found, made, flags)
kept = [made.pop(item["name"], item) for item in headline["entries"]]
headline["entries"] = kept + list(made.values())
HEADLINE.write_text(json.dumps(headline, indent=1) + "\n")
