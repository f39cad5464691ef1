"""The cells of `torchvision_table.py`: which models, dtypes and batch sizes, how each is built,
run and timed, and its result rows. Imports neither torchvision nor CUDA at import time, so the
logic runs in CPU tests (`Setup`: the device, compiler and model loader).

Per cell (model, dtype, N), three models on the same input, each against the dense masked model
in fp64 (`rel_err`):
- backend "cudnn": the model as given (random weights, every groups=1 conv magnitude-pruned to
  0.9, BatchNorm calibrated: `pruned`), fp32 at PyTorch's defaults (TF32 convs) or fp16
  channels_last; modes "eager" (plain calls) and "cudagraph" (captured by the caller);
- backend "inductor": the same under `torch.compile(mode="max-autotune")`;
- backend "auto" (ours): `sparsecnn.compile(model, x, mode="max-autotune")`, which tunes a copy,
  compiles it, and keeps it only where it beats the model as given compiled the same way.
The compiled ones (their own CUDA graphs) in modes "eager" (plain calls) and "cudagraph" (the same
calls, GPU time alone). `tuning_rows`: cold tuning times (`tuning_time.py`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

import sparsecnn
from sparsecnn.core.reference import relative_error
from sparsecnn.nn import SparseConv2d
from sparsecnn.prune import TileParams, prune_magnitude_, reprune_tiles_
from sparsecnn.tuning.timing import benchmark, eager_benchmark

MODELS = ("resnet50", "googlenet", "mobilenet_v2", "efficientnet_b0", "vgg16", "regnet_y_400mf")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
BATCHES = (32, 1)
COMPILE_MODE = "max-autotune"
CALIBRATION_BATCHES = 4
SPARSITY = 0.9
# How the groups=1 convs are pruned to SPARSITY: "random": the random weights by magnitude;
# "tiles64x32i": into tiles of 64 output channels in index order x units of 32 input channels, chosen
# by magnitude (the masks `sparsecnn prune --method reprune-tiles --tile 64 --chunk 32` makes; backend
# tensorcore runs their kept units).
PATTERNS = {"random": None, "tiles64x32i": TileParams(tile=64, sparsity=SPARSITY, order="none", chunk=32)}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of the table: a torchvision model name, "fp32" or "fp16", the batch size N, and the
    pruning (a key of PATTERNS)."""

    model: str
    dtype: str
    batch: int
    pattern: str = "random"

    @classmethod
    def parse(cls, spec: str) -> "Cell":
        """"MODEL:DTYPE:BATCH[:PATTERN]", e.g. "resnet50:fp16:32" or "resnet50:fp16:32:tiles64x32i"."""
        parts = spec.split(":")
        if (len(parts) not in (3, 4) or parts[1] not in DTYPES or not parts[2].isdigit() or int(parts[2]) < 1
                or (len(parts) == 4 and parts[3] not in PATTERNS)):
            raise ValueError(f"cell {spec!r}: expected MODEL:DTYPE:BATCH[:PATTERN] with DTYPE one of "
                             f"{', '.join(DTYPES)}, BATCH >= 1 and PATTERN one of {', '.join(PATTERNS)}")
        return cls(parts[0], parts[1], int(parts[2]), *parts[3:])

    def __str__(self) -> str:
        return f"{self.model}:{self.dtype}:{self.batch}" + (f":{self.pattern}" if self.pattern != "random" else "")


def default_cells() -> List[Cell]:
    """Every model in fp16 and fp32 at N=32, then at N=1: 24 cells, the issue-46 table."""
    return [Cell(model, dtype, batch) for batch in BATCHES for dtype in ("fp16", "fp32") for model in MODELS]


def parse_cells(specs: Sequence[str]) -> List[Cell]:
    """The cells named (none: `default_cells()`)."""
    return [Cell.parse(spec) for spec in specs] if specs else default_cells()


def torchvision_model(name: str) -> torch.nn.Module:
    import torchvision  # here: this module imports on machines without torchvision

    return torchvision.models.get_model(name, weights=None)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and how cells run: `device`, torch.compile's `compiler` ("inductor"; tests: "aot_eager"),
    `load` (name -> model with random weights), input size `hw` (torchvision: 224)."""

    device: torch.device
    compiler: str = "inductor"
    load: Callable[[str], torch.nn.Module] = torchvision_model
    hw: int = 224


def pruned(name: str, setup: Setup, pattern: str = "random") -> torch.nn.Module:
    """The model with random weights, every groups=1 conv pruned to 0.9 as PATTERNS[pattern] says,
    and BatchNorm statistics calibrated on random inputs (CALIBRATION_BATCHES in train mode, on the device), as a
    trained model's would be: with the initial statistics (mean 0, variance 1) activations grow layer
    by layer and overflow fp16 (mobilenet_v2 and efficientnet_b0 gave rel_err 1.0, the dense model's
    too). Returned on the CPU in eval mode."""
    torch.manual_seed(0)
    model = setup.load(name)
    if PATTERNS[pattern] is None:
        prune_magnitude_(model, SPARSITY, filter_fn=lambda _, module: module.groups == 1)
    else:
        convs = {name: torch.ones_like(module.weight, dtype=torch.bool) for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Conv2d) and module.groups == 1}
        reprune_tiles_(model, convs, PATTERNS[pattern])
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None  # a plain average over the calibration batches
    model.to(setup.device).train()
    with torch.no_grad():
        for _ in range(CALIBRATION_BATCHES):
            model(torch.randn(16, 3, setup.hw, setup.hw, device=setup.device))
    return model.eval().cpu()


def _capture(model, x: torch.Tensor) -> Tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    from sparsecnn.bench.models import capture_cuda_graph

    return capture_cuda_graph(model, x)


def timed(model, x: torch.Tensor, ref: torch.Tensor, compiled: bool) -> Dict[str, Tuple[dict, float]]:
    """{mode: (stats, rel_err)}: "eager" (plain calls, `eager_benchmark`) and "cudagraph": for a
    compiled model the same calls timed by `benchmark` (it replays its own CUDA graphs), else
    `model(x)` captured in a CUDA graph by the caller (CUDA only)."""
    with torch.no_grad():
        results = {"eager": (eager_benchmark(lambda: model(x), x.device), relative_error(model(x), ref))}
        if compiled:
            results["cudagraph"] = (benchmark(lambda: model(x), x.device), results["eager"][1])
        elif x.is_cuda:
            replay, output = _capture(model, x)
            results["cudagraph"] = (benchmark(replay, x.device), relative_error(output(), ref))
    return results


def ours_config(report, module: torch.nn.Module, tune_s: float) -> dict:
    """The "auto" rows' config: the precision policy, the whole-model check's verdict (`kept`:
    tuned / dense / given), which compiled model `sparsecnn.compile` kept ("sparse" or "dense") and
    by how much, the convs left to inductor, the sparse convs of the model kept, and the seconds of
    `sparsecnn.compile` (`tune_s`) and of each of its phases."""
    check = report.compiled
    return {"policy": report.policy, "tune_s": round(tune_s, 1),
            "kept": report.model_check.kept if report.model_check else None,
            "compile_mode": check.mode, "compiled_kept": check.kept, "compiled_speedup": round(check.speedup, 3),
            "to_inductor": len(check.to_inductor), "phases_s": {k: round(v, 1) for k, v in check.phase_s.items()},
            **conv_counts(module)}


def conv_counts(module: torch.nn.Module) -> Dict[str, int]:
    """{"sparse_layers": convs on a sparse backend, "layers": every conv}."""
    return {"sparse_layers": sum(isinstance(m, SparseConv2d) and not m.backend.startswith("dense")
                                 for m in module.modules()),
            "layers": sum(isinstance(m, (SparseConv2d, torch.nn.Conv2d)) for m in module.modules())}


def cell_rows(cell: Cell, setup: Setup, row: Callable[..., dict]) -> List[dict]:
    """The rows of one cell (see the module doc); `row(cell, backend, mode, stats, rel_err, config)`
    makes each (`result_row` with the run's environment and id)."""
    stored = DTYPES[cell.dtype]
    layout = torch.channels_last if cell.dtype == "fp16" else torch.contiguous_format
    model = pruned(cell.model, setup, cell.pattern)
    x = torch.randn(cell.batch, 3, setup.hw, setup.hw, device=setup.device)
    with torch.no_grad():
        ref = copy.deepcopy(model).to(setup.device).double()(x.double())
    x = x.to(stored).contiguous(memory_format=layout)
    given = copy.deepcopy(model).to(setup.device, stored).to(memory_format=layout)
    rows = [row(cell, "cudnn", mode, stats, err, None) for mode, (stats, err) in timed(given, x, ref, False).items()]
    rows += _compiled_rows(cell, setup, given, x, ref, row)
    start = time.perf_counter()
    config = sparsecnn.CompileConfig(tuning={"dtype": None if cell.dtype == "fp32" else cell.dtype},
                                     compiler=setup.compiler, progress=False)
    ours = sparsecnn.compile(given, x, mode=COMPILE_MODE, config=config)
    config = ours_config(ours.sparsecnn_report, ours.module, time.perf_counter() - start)
    rows += [row(cell, "auto", mode, stats, err, config) for mode, (stats, err) in timed(ours, x, ref, True).items()]
    del ours
    torch._dynamo.reset()  # the next cell starts without this one's compiled graphs and their memory
    return rows


def _compiled_rows(cell: Cell, setup: Setup, given, x, ref, row) -> List[dict]:
    """The model as given under torch.compile max-autotune (backend "inductor" rows; config: the mode and
    the first call's seconds, compiling and autotuning)."""
    compiled = torch.compile(given, backend=setup.compiler, dynamic=False,
                             mode=COMPILE_MODE if setup.compiler == "inductor" else None)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(x)
        if x.is_cuda:
            torch.cuda.synchronize()
    config = {"compile_mode": COMPILE_MODE, "compile_s": round(time.perf_counter() - start, 1)}
    rows = [row(cell, "inductor", mode, stats, err, config)
            for mode, (stats, err) in timed(compiled, x, ref, True).items()]
    torch._dynamo.reset()  # its CUDA graphs and their memory pool go before ours are made
    return rows


def result_row(env: dict, run: str, cell: Cell, backend: str, mode: str, stats: dict, err: float,
               config: Optional[dict]) -> dict:
    """A results row of `cell` (ARCHITECTURE.md's schema; `env`: `bench.env.environment`, `run`: the
    run id). fp32 cells run at PyTorch's defaults (TF32 convs): schema dtype "tf32"."""
    dtype = "tf32" if cell.dtype == "fp32" else cell.dtype
    return {**env, "run": run, "kind": "model", "suite": "torchvision", "layer": None, "model": cell.model,
            "N": cell.batch, "C": None, "K": None, "H": None, "W": None, "R": None, "S": None, "stride": None,
            "padding": None, "dtype": dtype, "sparsity": SPARSITY, "pattern": cell.pattern, "backend": backend,
            "config": config, "mode": mode, "median_ms": stats["median_ms"], "p20_ms": stats.get("p20_ms"),
            "p80_ms": stats.get("p80_ms"), "rel_err": err, "floor_ms": None}


def summary_lines(cell: Cell, rows: List[dict]) -> List[str]:
    """One line per baseline: the baseline's ms over ours per mode ("1.23x (0.812 ms vs 1.000)")."""
    ours = {r["mode"]: r["median_ms"] for r in rows if r["backend"] == "auto"}
    lines = []
    for baseline in ("cudnn", "inductor"):
        dense = {r["mode"]: r["median_ms"] for r in rows if r["backend"] == baseline}
        lines.append(f"{cell} vs {baseline}: " + ", ".join(
            f"{mode} {dense[mode] / ours[mode]:.2f}x ({ours[mode]:.3f} ms vs {dense[mode]:.3f})"
            for mode in dense if mode in ours))
    return lines


def run_cells(cells: Sequence[Cell], setup: Setup, row, write: Callable[[List[dict]], None],
              budget_s: float, start: Optional[float] = None) -> List[str]:
    """Run each cell whose start falls within `budget_s` seconds of `start` (default: now), writing
    its rows; a failing cell is reported and skipped. Returns what was printed."""
    start = time.time() if start is None else start
    said = []

    def say(text: str) -> None:
        said.append(text)
        print(text, flush=True)

    for cell in cells:
        if time.time() - start > budget_s:
            say(f"budget spent: {cell} not started")
            continue
        try:
            rows = cell_rows(cell, setup, row)
        except Exception as error:  # noqa: BLE001  (one model failing must not lose the others' rows)
            say(f"{cell}: FAILED {type(error).__name__}: {error}")
            continue
        write(rows)
        for line in summary_lines(cell, rows):
            say(line)
        say(f"{cell}: {rows[-1]['config']} [{time.time() - start:.0f} s]")
    return said


def tuning_rows(name: str, setup: Setup, batch: int, runs: int, env: dict, run: str,
                around_cold: Callable[[], ContextManager] = contextlib.nullcontext) -> List[dict]:
    """`runs` tunings of `name` (`pruned`) as a user tunes it, `prepare_for_inference` + `sparsify_`
    with dtype=None (an fp32 model at PyTorch's defaults on CUDA: "fp32-default"), each from an
    empty decision cache on input N(0, 1) of (batch, 3, hw, hw); after run 1, a cached reload (the
    model tuned again from run 1's decision cache, run "reload"). One row per tuning: the results
    schema, kind "tuning", dtype "tf32", median_ms null, config {"run", "tune_s", "phases_s", "policy",
    "kept", "model_cached" (the whole-model decisions put back from the cache), "sparse_layers",
    "layers", "cache_hits" (layers decided from the cache), "worker_jobs" (seconds per worker pool:
    `core.workers.JobTimes`), "choices" (layer -> [chosen candidate, its ms, dense ms, candidates
    timed]), "backend_ms" (layer -> {backend: its fastest fully timed config's ms}: where a backend
    lost, and by how much)}. around_cold: a context manager run 1's tuning runs in (e.g. a
    `stack_sampler.StackSampler`)."""
    given = pruned(name, setup).to(setup.device)
    x = torch.randn(batch, 3, setup.hw, setup.hw, device=setup.device)
    rows = []
    for index in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as cache_dir:
            with (around_cold() if index == 1 else contextlib.nullcontext()):
                rows.append(_tuning_row(given, x, cache_dir, index, name, env, run))
            if index == 1:
                rows.append(_tuning_row(given, x, cache_dir, "reload", name, env, run))
    return rows


def _rounded(times_ms: Dict[str, float]) -> Dict[str, float]:
    return {name: round(ms, 4) for name, ms in times_ms.items()}


def _tuning_row(given: torch.nn.Module, x: torch.Tensor, cache_dir: str, label, name: str, env: dict,
                run: str) -> dict:
    """One tuning of a copy of `given` with decisions cached in `cache_dir`, as a `tuning_rows` row."""
    model = sparsecnn.prepare_for_inference(copy.deepcopy(given))
    start = time.perf_counter()
    sparsecnn.sparsify_(model, x, cache_dir=cache_dir, progress=False)
    if x.is_cuda:
        torch.cuda.synchronize()
    tune_s = time.perf_counter() - start
    report = model.sparsecnn_report
    check = report.model_check
    config = {"run": label, "tune_s": round(tune_s, 3), "phases_s": {k: round(v, 3) for k, v in report.phase_s.items()},
              "policy": report.policy, "kept": check.kept if check else None,
              "model_cached": bool(check and check.cached),
              **conv_counts(model), "cache_hits": sum(layer.cache == "hit" for layer in report.layers),
              "worker_jobs": report.worker_jobs,
              "choices": {layer.name: [layer.choice, round(layer.time_ms, 4), round(layer.dense_ms, 4),
                                       len(layer.times_ms)] for layer in report.layers},
              "backend_ms": {layer.name: _rounded(layer.fastest_per_backend()) for layer in report.layers}}
    return {**result_row(env, run, Cell(name, "fp32", x.shape[0]), "auto", "cudagraph", {"median_ms": None}, None,
                         config), "kind": "tuning"}
