"""`sparsecnn` command line: layers, backends, bench layers/model, report, demo, prune, compile, load,
doctor."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

DTYPES = ("fp32", "tf32", "fp16", "bf16")
# In the ImportError of an optional dependency (extras plot, data): its message says what to install.
_MISSING_EXTRA = "pip install 'sparsecnn["
RUN_MODES = ("graph", "eager")  # tuning.sparsify.RUN_MODES, kept here so that --help imports no torch
RUN_MODE_HELP = ("what tuning times: 'graph' (GPU time: the model runs under CUDA graphs or torch.compile) or "
                 "'eager' (wall time of eager calls, launch cost included)")


def _cmd_layers(args) -> None:
    from sparsecnn.layers import get_suite

    print("| layer | N | C | K | H | W | R | S | stride | padding | P | Q | GFLOP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in get_suite(args.suite, args.batch):
        print(f"| {s.name} | {s.N} | {s.C} | {s.K} | {s.H} | {s.W} | {s.R} | {s.S} | {s.stride[0]} | "
              f"{s.padding[0]} | {s.P} | {s.Q} | {s.dense_flops / 1e9:.3f} |")


def _cmd_backends(args) -> None:
    from sparsecnn.backends import backend_names, get_backend

    for name in backend_names():
        backend = get_backend(name)
        support = "; ".join(f"{dev}: {', '.join(str(d).replace('torch.', '') for d in dts)}"
                            for dev, dts in backend.dtypes.items())
        print(f"{name:18s} {backend.description}  [{support}]")


def _cmd_doctor(args) -> int:
    from sparsecnn.doctor import DEFAULT_ARCHES, run

    arches = None
    if args.compile_check:
        arches = _split(args.arch) if args.arch else list(DEFAULT_ARCHES)
    elif args.arch:
        raise ValueError("--arch goes with --compile-check")
    return run(arches)


def _device(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _cmd_bench_layers(args) -> None:
    from sparsecnn.bench import bench_layers, markdown_table, write_jsonl
    from sparsecnn.layers import get_suite

    specs = get_suite(args.suite, args.batch)
    if args.layers:
        wanted = _split(args.layers)
        unknown = set(wanted) - {spec.name for spec in specs}
        if unknown:
            raise ValueError(f"--layers: {', '.join(sorted(unknown))} not in suite {args.suite}")
        specs = [spec for spec in specs if spec.name in wanted]
    peers = _peers(args.peers)  # before any timing: a missing library fails at once
    rows = bench_layers(specs, suite=args.suite, sparsity=args.sparsity,
                        pattern=args.pattern, dtype=args.dtype, backends=_split(args.backends),
                        device=_device(args), seed=args.seed, configs=args.configs,
                        timing=dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms), mode=args.mode,
                        on_rows=lambda layer_rows: write_jsonl(layer_rows, args.out), peers=peers)
    print(markdown_table(rows))
    print(f"\n{len(rows)} rows appended to {args.out}")


def _peers(text: Optional[str]) -> list:
    """The peers named by --peers (none without it), loaded from the checkout's benchmarks/peers
    only then; FileNotFoundError naming the option and what is missing (adapter, library)."""
    if not text:
        return []
    from sparsecnn.bench.peers import load_peer

    loaded = []
    for name in _split(text):
        try:
            loaded.append(load_peer(name))
        except FileNotFoundError as error:
            raise FileNotFoundError(f"--peers {name}: {error}") from None
    return loaded


def _cmd_bench_model(args) -> None:
    from sparsecnn.bench import bench_model, markdown_table, write_jsonl
    from sparsecnn.tuning.phases import format_phases
    from sparsecnn.tuning.report import format_worker_jobs

    rows = bench_model(args.name, batch=args.batch, dtype=args.dtype, sparsity=args.sparsity,
                       pattern=args.pattern, backend=args.backend, device=_device(args),
                       modes=tuple(_split(args.modes)), seed=args.seed, checkpoint=args.checkpoint,
                       compile_mode=None if args.compile_mode == "default" else args.compile_mode,
                       backends=_split(args.backends) if args.backends else None, run_mode=args.run_mode,
                       cudnn_benchmark=args.cudnn_benchmark,
                       sparse_modes=tuple(_split(args.sparse_modes)) if args.sparse_modes else None,
                       on_rows=lambda measured: write_jsonl(measured, args.out))
    print(markdown_table(rows))
    tuned = next((row["config"] for row in rows if row["backend"] != "cudnn"), None)
    if tuned and tuned["tune_phases_s"]:
        print("tuning time: " + format_phases(tuned["tune_phases_s"]))
        for line in format_worker_jobs(tuned["tune_workers"]):
            print(line)
    print(f"\n{len(rows)} rows appended to {args.out}")


def _cmd_report(args) -> None:
    from sparsecnn.bench import markdown_table, plot_results, read_jsonl, render_report

    rows = read_jsonl(args.results)
    if args.md:
        render_report(rows, args.md, args.plot_dir)
        print(f"report written to {args.md}")
    else:
        print(markdown_table(rows))
    if args.plot:
        plot_results(rows, args.plot)
        print(f"plot written to {args.plot}")


def _cmd_demo(args) -> None:
    from sparsecnn.demo import run_demo

    run_demo(args.model, args.sparsity, args.batch, args.device)


def _cmd_prune(args) -> None:
    """Train (unless MODEL is a checkpoint), prune and fine-tune; under torchrun every rank runs this
    and rank 0 alone prints and writes."""
    import logging

    from sparsecnn.prune import TrainConfig, get_method, layer_sparsities
    from sparsecnn.prune.distributed import close, init_from_env, is_main, local_rank
    from sparsecnn.prune.resume import RunState
    from sparsecnn.prune.sources import model_spec, parse_data_source

    source = parse_data_source(args.data)
    name, checkpoint = model_spec(args.model)
    if checkpoint is not None and args.from_checkpoint:
        raise ValueError("MODEL is a checkpoint already; leave out --from")
    get_method(args.method)
    _tile_option(args)
    if args.unit_shapes is not None:
        if args.method != "reprune-select":
            raise ValueError(f"--unit-shapes applies to --method reprune-select only, got --method {args.method}")
        _unit_selection(args.unit_shapes, args.steps or 1)
    _quantizer(args.quantize)
    device = _device(args)
    if device == "cuda":
        device = f"cuda:{local_rank()}"
    init_from_env(device)
    if is_main():
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    base = TrainConfig(precision=args.precision, state=RunState(args.state) if args.state else None)
    try:
        run = _prune_digits if source.kind == "digits" else _prune_loaders
        run(args, source, name, str(checkpoint or args.from_checkpoint or "") or None, device, base,
            layer_sparsities)
    finally:
        close()


def _unit_selection(text: str, steps: int = 1):
    """`--unit-shapes` "16x16,32x32" and `--steps` -> UnitSelectionConfig(shapes=((16, 16), (32, 32)),
    steps=steps) (ValueError naming the flag for anything else)."""
    from sparsecnn.prune import UnitSelectionConfig

    try:
        shapes = tuple(tuple(int(part) for part in item.split("x")) for item in text.split(","))
        return UnitSelectionConfig(shapes=shapes, steps=steps)
    except ValueError as error:
        raise ValueError(f"--unit-shapes must be TILExCHUNK pairs such as 16x16,32x32,64x32 (tile 16, 32 or 64; "
                         f"chunk 8, 16 or 32), got {text!r}: {error}") from None


def _tile_option(args) -> dict:
    """The method options `--tile`, `--chunk`, `--order` and `--steps` give: {"tile": 16 | 32 | 64 |
    "auto", "chunk": 1 | 8 | 16 | 32, "order": "greedy" | "none", "steps": int >= 1} for
    reprune-tiles, else {} (ValueError for a bad value or for any of them with another method;
    reprune-select with --unit-shapes takes `--steps` through `_unit_selection`).
    Units of chunk > 1 are for backend tensorcore, which stores channel runs fast and permuted
    channels 1.5-14x slower (RESULTS.md), so their order defaults to "none" (tiles of consecutive
    output channels)."""
    _check_steps(args)
    given = {flag: value for flag, value in (("--tile", args.tile), ("--chunk", args.chunk), ("--order", args.order))
             if value is not None}
    if args.method != "reprune-tiles":
        if given:
            raise ValueError(f"{next(iter(given))} applies to --method reprune-tiles only, got --method {args.method}")
        return {}
    from sparsecnn.prune.tiles import CHUNK_SIZES, ORDERS, TILE_SIZES

    options = {}
    if args.tile is not None:
        if args.tile != "auto" and args.tile not in {str(size) for size in TILE_SIZES}:
            raise ValueError(f"--tile must be one of {', '.join(map(str, TILE_SIZES))} or auto, got {args.tile!r}")
        options["tile"] = args.tile if args.tile == "auto" else int(args.tile)
    if args.chunk is not None:
        if args.chunk not in CHUNK_SIZES:
            raise ValueError(f"--chunk must be one of {', '.join(map(str, CHUNK_SIZES))}, got {args.chunk!r}")
        options["chunk"] = args.chunk
    if args.order is not None and args.order not in ORDERS:
        raise ValueError(f"--order must be one of {', '.join(ORDERS)}, got {args.order!r}")
    order = args.order or ("none" if (args.chunk or 1) > 1 else None)
    if order is not None:
        options["order"] = order
    if args.steps is not None:
        options["steps"] = args.steps
    return options


def _check_steps(args) -> None:
    """`--steps` is an int >= 1 given with reprune-tiles, or with reprune-select and --unit-shapes."""
    if args.steps is None:
        return
    if args.method == "reprune-select" and args.unit_shapes is None:
        raise ValueError("--steps applies to --method reprune-select only with --unit-shapes")
    if args.method not in ("reprune-tiles", "reprune-select"):
        raise ValueError(f"--steps applies to --method reprune-tiles or reprune-select (with --unit-shapes), got "
                         f"--method {args.method}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")


def _start_model(name: str, num_classes: int, checkpoint, device: str):
    """(model on `device`, whether it starts from `checkpoint`), seeded by the caller."""
    from sparsecnn.prune import load_pruned
    from sparsecnn.prune.sources import build

    model = build(name, num_classes)
    if checkpoint:
        load_pruned(checkpoint, model)
    return model.to(device)


def _remembered(base, key: str, compute):
    """`compute()`, or on a resumed run (`base.state`) the value the first run saved: the phases
    before it are skipped, so the model does not hold their weights when it is asked again."""
    return base.state.remember(key, compute) if base.state is not None else compute()


def _prune_digits(args, source, name, checkpoint, device, base, layer_sparsities) -> None:
    import torch

    from sparsecnn.data import load_digits_split
    from sparsecnn.prune import prune_with
    from sparsecnn.prune.methods import top1_accuracy, train_dense_
    from sparsecnn.prune.sources import input_shape

    torch.manual_seed(args.seed)
    model = _start_model(name, 10, checkpoint, device)
    layer_sparsities(model, args.sparsity)
    split = load_digits_split(input_shape(name, source), seed=args.seed).to(device)
    if not checkpoint:
        train_dense_(model, split, args.epochs, seed=args.seed, batch_size=args.batch_size, progress=True, train=base)
    start_top1 = _remembered(base, "start_top1", lambda: top1_accuracy(model, split))
    options = {} if args.finetune_epochs is None else {"epochs": args.finetune_epochs}
    options.update(_tile_option(args))
    if args.method == "reprune-select":
        from sparsecnn.tuning import block_gains, tensorcore_gains

        options["measure_gains"] = block_gains
        if args.unit_shapes is not None:
            options.update(units=_unit_selection(args.unit_shapes, args.steps or 1),
                           measure_unit_speed=tensorcore_gains)
    masks = prune_with(args.method, model, split, args.sparsity, seed=args.seed, progress=True,
                       batch_size=args.batch_size, train=base, **options)
    _finish(args, name, model, masks, checkpoint, start_top1, lambda m: top1_accuracy(m, split), split.train_x[:256])


def _prune_loaders(args, source, name, checkpoint, device, base, layer_sparsities) -> None:
    import torch

    from sparsecnn.prune import admm_prune_, prune_and_finetune, top1_evaluator, train_epochs
    from sparsecnn.prune.sources import calibration_inputs, datasets, input_shape, loaders

    if args.method not in ("magnitude", "gradual", "admm"):
        raise ValueError(f"--method {args.method} needs --data digits; with {source.kind} use magnitude, "
                         f"gradual or admm")
    train_set, validation_set, classes = datasets(source, input_shape(name, source), args.seed)
    train, validation = loaders(train_set, validation_set, args.batch_size, args.seed, args.workers)
    torch.manual_seed(args.seed)
    model = _start_model(name, classes, checkpoint, device)
    layer_sparsities(model, args.sparsity)
    if not checkpoint:
        train_epochs(model, train, base.phase(args.epochs, 0.02, args.seed, True), description="dense")
    evaluate = top1_evaluator(validation)
    start_top1 = _remembered(base, "start_top1", lambda: evaluate(model))
    if args.method == "admm":
        epochs = {} if args.finetune_epochs is None else dict(admm_epochs=args.finetune_epochs,
                                                               finetune_epochs=args.finetune_epochs)
        masks = admm_prune_(model, train, args.sparsity, seed=args.seed, progress=True, train=base, **epochs)
    else:
        epochs = 8 if args.finetune_epochs is None else args.finetune_epochs
        masks, _ = prune_and_finetune(model, args.sparsity, train, method=args.method,
                                      train=base.phase(epochs, 0.01, args.seed, True))
    _finish(args, name, model, masks, checkpoint, start_top1, evaluate, calibration_inputs(train), classes)


def _finish(args, name, model, masks, checkpoint, start_top1, evaluate, calibration, num_classes=None) -> None:
    """Quantise if asked, write the checkpoint (rank 0) and print the summary (rank 0)."""
    from sparsecnn.prune import format_sparsity_report, save_pruned, sparsity_report
    from sparsecnn.prune.distributed import is_main

    quantizer = _quantizer(args.quantize)
    report = dict(model=name, method=args.method, sparsity=args.sparsity, data=args.data, seed=args.seed,
                  epochs=args.epochs, finetune_epochs=args.finetune_epochs, quantize=args.quantize,
                  precision=args.precision, start=checkpoint or "dense", start_top1=start_top1,
                  top1=evaluate(model))
    if quantizer is not None:
        model, quantization = quantizer(model, calibration)
        report.update(quantized_top1=evaluate(model), quantization=quantization.format())
    report["layers"] = sparsity_report(model, masks)
    save_pruned(args.output, name, model, masks, report, num_classes)
    if not is_main():
        return
    if quantizer is not None:
        print(report["quantization"])
    print(format_sparsity_report(report["layers"]))
    quantized = f", {report['quantized_top1']:.2f}% after {args.quantize}" if quantizer is not None else ""
    print(f"\ntop-1 on {args.data} {'test' if args.data == 'digits' else 'validation'}: "
          f"{report['start_top1']:.2f}% before ({report['start']}), {report['top1']:.2f}% after {args.method} "
          f"pruning{quantized}; checkpoint written to {args.output}")


def _input_shape(text: str) -> List[int]:
    try:
        shape = [int(part) for part in _split(text)]
    except ValueError:
        shape = []
    if len(shape) < 3 or min(shape) < 1:
        raise ValueError(f"--input-shape must be positive ints N,C,H,W (or N,C,L), got {text!r}")
    return shape


def _cmd_compile(args) -> None:
    from sparsecnn.artifact import compile_model

    model = compile_model(args.model, args.checkpoint, _input_shape(args.input_shape), args.dtype,
                          _split(args.backends) if args.backends else None, args.output,
                          num_classes=args.num_classes, device=args.device, cache_dir=args.cache_dir,
                          retune=args.retune, progress=True, run_mode=args.run_mode)
    print(model.sparsecnn_report.format())
    print(f"\nartefact written to {args.output}")


def _cmd_load(args) -> None:
    import time

    from sparsecnn.artifact import load
    from sparsecnn.tuning.phases import format_phases

    start = time.perf_counter()
    model = load(args.artifact, args.device, cache_dir=args.cache_dir, progress=True)
    seconds = time.perf_counter() - start
    print(model.sparsecnn_report.format())
    retuned = "" if model.sparsecnn_retuned is None else f", re-tuned: {model.sparsecnn_retuned}"
    print(f"\nloaded {args.artifact} in {seconds:.3f} s{retuned}")
    print("load time: " + format_phases(model.sparsecnn_load_phases))


def _quantizer(scheme: str):
    """None for "none", else the `sparsecnn.prune.quantize.QUANTIZERS` entry named `scheme`."""
    from sparsecnn.prune.quantize import QUANTIZERS

    if scheme == "none":
        return None
    if scheme not in QUANTIZERS:
        raise ValueError(f"--quantize: unknown scheme {scheme!r}; expected none, {', '.join(QUANTIZERS)}")
    return QUANTIZERS[scheme]


def _split(text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_common(parser, batch_default: Optional[int]) -> None:
    parser.add_argument("--batch", type=int, default=batch_default, help="batch size N")
    parser.add_argument("--sparsity", type=float, default=0.9, help="fraction of zero weights, 0..1")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32 means TF32 off")
    parser.add_argument("--pattern", default="random",
                        help="random, dlmc-<method> (e.g. dlmc-magnitude_pruning; resnet50 layers), or "
                             "tiles<16|32|64>-<pattern> (that pattern re-pruned into tiles for backend blocks)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results.jsonl", help="JSON-lines file to append rows to")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsecnn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    layers = commands.add_parser("layers", help="print a layer suite")
    layers.add_argument("--suite", required=True)
    layers.add_argument("--batch", type=int, default=None, help="batch size (default: the paper's)")
    layers.set_defaults(run=_cmd_layers)

    commands.add_parser("backends", help="list registered backends").set_defaults(run=_cmd_backends)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="target", required=True)
    bench_layers = bench.add_parser("layers", help="per-layer timings against cuDNN in the same run")
    bench_layers.add_argument("--suite", required=True)
    bench_layers.add_argument("--backends", default="im2col-cublas,im2col-cusparse",
                              help="comma-separated backend names (cuDNN baselines always run)")
    bench_layers.add_argument("--layers", default=None, help="comma-separated subset of the suite's layers")
    bench_layers.add_argument("--configs", choices=("default", "auto", "all"), default="default",
                              help="configs timed per backend: its default, those backend=auto tries, or all")
    bench_layers.add_argument("--mode", choices=("gpu", "eager"), default="gpu",
                              help="gpu: GPU time alone, launch overhead hidden (as under CUDA graphs); "
                                   "eager: launch overhead included")
    bench_layers.add_argument("--peers", default=None,
                              help="comma-separated peer systems timed beside (rows 'peer:<variant>'), from the "
                                   "checkout's benchmarks/peers: sputnik (needs SPARSECNN_SPUTNIK_LIB), sparsert "
                                   "(needs SPARSECNN_SPARSERT_COMPILE)")
    bench_layers.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up time per measurement")
    bench_layers.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms)")
    _add_common(bench_layers, None)
    bench_layers.set_defaults(run=_cmd_bench_layers)

    bench_model = bench.add_parser("model", help="end-to-end model timing (eager, CUDA graphs, torch.compile)")
    bench_model.add_argument("name")
    bench_model.add_argument("--backend", default="auto")
    bench_model.add_argument("--modes", default="eager,cudagraph", help="comma-separated: eager,cudagraph,compile")
    bench_model.add_argument("--sparse-modes", default=None,
                             help="the sparse model's modes (default: --modes), e.g. --modes cudagraph,compile "
                                  "--sparse-modes cudagraph")
    bench_model.add_argument("--compile-mode", default="max-autotune",
                             help="torch.compile mode of both models in mode 'compile' ('default' for none)")
    bench_model.add_argument("--checkpoint", default=None, help="state_dict with pruned weights")
    bench_model.add_argument("--backends", default=None,
                             help="with --backend auto: comma-separated sparse backends tuning may pick (default all)")
    bench_model.add_argument("--run-mode", choices=RUN_MODES, default="graph", help=RUN_MODE_HELP)
    bench_model.add_argument("--cudnn-benchmark", action="store_true",
                             help="torch.backends.cudnn.benchmark on for the whole run (dense and sparse alike)")
    _add_common(bench_model, 32)
    bench_model.set_defaults(run=_cmd_bench_model)

    report = commands.add_parser("report", help="tables and plots from a results file")
    report.add_argument("results")
    report.add_argument("--plot", default=None,
                        help="PNG path for the speedup plot: layers over cuDNN, models over the dense model "
                             "(needs the plot extra)")
    report.add_argument("--md", default=None, help="write a markdown page (with plots) here")
    report.add_argument("--plot-dir", default=".", help="where the markdown page's plots go")
    report.set_defaults(run=_cmd_report)

    demo = commands.add_parser("demo", help="prune, sparsify, verify and time a model")
    demo.add_argument("--model", default="resnet18-cifar")
    demo.add_argument("--sparsity", type=float, default=0.9)
    demo.add_argument("--batch", type=int, default=None)
    demo.add_argument("--device", default=None)
    demo.set_defaults(run=_cmd_demo)

    prune = commands.add_parser("prune", help="train, prune and fine-tune a model; write a checkpoint "
                                              "(under torchrun: on every rank, DistributedDataParallel)")
    prune.add_argument("model", help="zoo model name, a sparsecnn prune checkpoint to start from, or "
                                     "torchvision:NAME (needs torchvision)")
    prune.add_argument("--method", default="magnitude", help="registered pruning method (sparsecnn.prune.method_names)")
    prune.add_argument("--sparsity", type=float, default=0.9, help="fraction of zero weights in the pruned layers")
    prune.add_argument("--tile", default=None,
                       help="reprune-tiles: output channels per tile sharing their kept columns, 16, 32, 64 or "
                            "auto (per layer; default 32)")
    prune.add_argument("--chunk", type=int, default=None,
                       help="reprune-tiles: input channels per kept unit (one tap), 1, 8, 16 or 32 (default 1); "
                            "units of 8 or more are what backend tensorcore loads fast")
    prune.add_argument("--order", default=None,
                       help="reprune-tiles: how output channels are grouped into tiles, greedy (by mask "
                            "similarity) or none (consecutive channels; the default with --chunk > 1, the "
                            "order backend tensorcore stores fast)")
    prune.add_argument("--steps", type=int, default=None,
                       help="reprune-tiles, and reprune-select with --unit-shapes: rounds of rising sparsity, each "
                            "re-pruned into tiles and trained (default 1: magnitude pruning, one re-pruning, "
                            "re-training); 3 kept more accuracy")
    prune.add_argument("--unit-shapes", default=None,
                       help="reprune-select: search these tensor-core unit shapes TILExCHUNK (e.g. "
                            "16x16,32x32,64x32) per conv by backend tensorcore's measured speed, within the "
                            "accuracy budget, instead of OptPrune's blocks")
    prune.add_argument("--data", default="digits",
                       help="digits, imagefolder:PATH (PATH/<class>/<image>, or PATH/train + PATH/val) or "
                            "cifar10:PATH (torchvision's CIFAR-10 python format)")
    prune.add_argument("--batch-size", type=int, default=64, help="global batch, split over torchrun's processes")
    prune.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                       help="autocast precision of the training forward passes")
    prune.add_argument("--state", default=None,
                       help="run-state file written after every epoch; an existing one is resumed")
    prune.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (image data)")
    prune.add_argument("-o", "--output", required=True, help="checkpoint path (sparsecnn.prune.load_pruned reads it)")
    prune.add_argument("--epochs", type=int, default=8, help="dense training epochs (not used with --from)")
    prune.add_argument("--finetune-epochs", type=int, default=None,
                       help="epochs of each of the method's training phases (default: the method's own)")
    prune.add_argument("--from", dest="from_checkpoint", default=None, help="start from this checkpoint, not dense")
    prune.add_argument("--quantize", default="none",
                       help="none or a sparsecnn.prune.quantize scheme (fixed8, fp16, kmeans16-int8, ...) applied after "
                            "fine-tuning; the checkpoint holds the rounded weights, activation rounding is only "
                            "applied for the reported accuracy")
    prune.add_argument("--seed", type=int, default=0)
    prune.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    prune.set_defaults(run=_cmd_prune)

    compile_ = commands.add_parser("compile", help="tune a pruned checkpoint and write a loadable artefact")
    compile_.add_argument("checkpoint", help="sparsecnn prune checkpoint, or a state dict (torch.save or safetensors)")
    compile_.add_argument("--model", required=True, help="registered model name (sparsecnn.models.MODEL_NAMES)")
    compile_.add_argument("--input-shape", required=True, help="N,C,H,W the model is tuned for")
    compile_.add_argument("--dtype", choices=DTYPES, default="fp32", help="precision policy; fp32 means TF32 off")
    compile_.add_argument("--backends", default=None,
                          help="comma-separated backends to try besides dense (default: the autotuner's set)")
    compile_.add_argument("--num-classes", type=int, default=None, help="the model's outputs (default: its dataset's)")
    compile_.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    compile_.add_argument("--cache-dir", default=None, help="tuning cache (default: $SPARSECNN_CACHE_DIR or ~/.cache)")
    compile_.add_argument("--retune", action="store_true", help="time every candidate even when cached")
    compile_.add_argument("--run-mode", choices=RUN_MODES, default="graph", help=RUN_MODE_HELP)
    compile_.add_argument("-o", "--output", required=True, help="artefact directory to write (replaced atomically)")
    compile_.set_defaults(run=_cmd_compile)

    load = commands.add_parser("load", help="load an artefact; print its per-layer decisions and the load time")
    load.add_argument("artifact")
    load.add_argument("--device", default=None, help="default: where it was tuned, when present here")
    load.add_argument("--cache-dir", default=None, help="tuning cache used if it must re-tune")
    load.set_defaults(run=_cmd_load)

    doctor = commands.add_parser("doctor", help="GPUs, versions, toolchain, which backends can run here and why not")
    doctor.add_argument("--compile-check", action="store_true",
                        help="compile one small layer of every generated family per arch with ptxas (no GPU needed)")
    doctor.add_argument("--arch", default="", help="arches for --compile-check, e.g. 80,86,89,90 (default: those)")
    doctor.set_defaults(run=_cmd_doctor)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"sparsecnn: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        if _MISSING_EXTRA not in str(error):  # not a missing optional dependency: a bug, keep the traceback
            raise
        print(f"sparsecnn: error: {error}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
