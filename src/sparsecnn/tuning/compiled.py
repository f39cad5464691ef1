"""`compile`: tune a model's convs, compile the whole model with torch.compile, and keep that only
where it beats the model as given compiled the same way.

Steps, each a phase of `CompileCheck.phase_s` with a progress bar:
1. "tuning": a copy of the model, `prepare_for_inference`'d (when `CompileConfig.prepare` and
   fx traces it), tuned per layer by `autotune_model` (its own checks and phases included).
2. "inductor layers": each conv on an op of ours against the same conv as an aten convolution,
   both compiled alone (`inductor.leave_to_inductor`); the faster form stays.
3. "compile sparsified", "compile as given": each model's first compiled call (compiling and, in
   the max-autotune modes, autotuning); "timing compiled": both timed, the faster kept
   (`model_check.check_compiled`).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from sparsecnn.nn.graphed import disable_cuda_graphs, input_signature
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes import prepare_for_inference
from sparsecnn.tuning.inductor import leave_to_inductor
from sparsecnn.tuning.model_check import check_compiled
from sparsecnn.tuning.phases import PhaseClock, TickingTimer
from sparsecnn.tuning.precision import POLICIES, tf32_flags
from sparsecnn.tuning.report import CompileCheck, TuneReport
from sparsecnn.tuning.select import Timer
from sparsecnn.tuning.sparsify import (
    as_tuple,
    autotune_model,
    cast_inputs,
    default_timer,
    input_device,
    parameter_dtype,
    show_progress,
)

_LOG = logging.getLogger("sparsecnn.tuning")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The mode each conv is compiled in alone (step 2): without CUDA graphs, which would give every
# small graph a memory pool of its own; the timer measures GPU time with or without them.
_LAYER_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
TUNING_OPTIONS = ("filter_fn", "masks", "backends", "dtype", "cache_dir", "retune", "drop_ratio", "run_mode")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How `compile` tunes and compiles.

    tuning: options of `autotune_model` (those of `sparsify_`: filter_fn, masks, backends, dtype,
    cache_dir, retune, run_mode; and drop_ratio). compiler: torch.compile's backend, "inductor"
    (the point) or a cheaper one for tests and CPU CI ("aot_eager", "eager": they take no mode).
    prepare: run `prepare_for_inference` on the copy first (skipped for a model that already has
    SparseConv2d layers; a model fx cannot trace is tuned without it, with a warning).
    inductor_layers: measure per conv whether inductor runs it better (step 2 of the module doc).
    progress: progress bars (None: when stderr is a terminal). timer: how candidates and models
    are timed (None: `MeasuringTimer`, or `EagerTimer` for run_mode "eager")."""

    tuning: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compiler: Union[str, Callable] = "inductor"
    prepare: bool = True
    inductor_layers: bool = True
    progress: Optional[bool] = None
    timer: Optional[Timer] = None

    def __post_init__(self):
        unknown = sorted(set(self.tuning) - set(TUNING_OPTIONS))
        if unknown:
            raise ValueError(f"CompileConfig tuning: unknown options {unknown}; expected some of "
                             f"{', '.join(TUNING_OPTIONS)}")
        if not (isinstance(self.compiler, str) or callable(self.compiler)):
            raise TypeError(f"CompileConfig compiler must be a torch.compile backend name or callable, "
                            f"got {type(self.compiler).__name__}")


class CompiledModel:
    """What `compile` returns: call it as the model (calls run without autograd: an inference model).

    module: the eager module that was compiled, the sparsified copy (kept "sparse") or the model as
    given in the tuned dtype ("dense"); compiled: its torch.compile'd form; sparsecnn_report: the
    `TuneReport` of tuning, with `compiled` (a `CompileCheck`: which won and by how much). Each
    input signature the sparsified model has not seen is first run eagerly once, so that its
    SparseConv2d layers bind for it outside the graph (else the first compiled call would break
    the graph at each of them: see `SparseConv2d.forward`)."""

    def __init__(self, module: nn.Module, compiled: Callable, report: TuneReport, seen: tuple):
        self.module, self.compiled, self.sparsecnn_report = module, compiled, report
        self._bound = {input_signature(seen)}

    @property
    def kept(self) -> str:
        """"sparse" or "dense": which model was compiled (see `CompileCheck.kept`)."""
        return self.sparsecnn_report.compiled.kept

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            if self.kept == "sparse":
                signature = input_signature(args, kwargs)
                if signature is not None and signature not in self._bound:
                    self.module(*args, **kwargs)
                    self._bound.add(signature)
            return self.compiled(*args, **kwargs)


def compile(model: nn.Module, example_inputs, mode: str = "max-autotune",
            config: Optional[CompileConfig] = None) -> CompiledModel:
    """`model` sparsified and compiled, or the model as given compiled, whichever runs faster.

    model: in eval mode, on its device (it is copied; the copy is tuned, the model itself left as
    it is). example_inputs: a tensor or a tuple of its positional inputs (in the model's dtype or
    the tuned one). mode: torch.compile's mode for both models, one of `MODES`. config: a
    `CompileConfig` (None: the defaults). Returns a `CompiledModel`; its `sparsecnn_report`
    says what each phase took and which model won (see the module doc for the steps).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    config = CompileConfig() if config is None else config
    if not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
    inputs = as_tuple(example_inputs)
    clock = PhaseClock(progress=show_progress(config.progress))
    with clock.phase("total"):
        with clock.phase("tuning"):
            sparse, report = _tuned_copy(model, inputs, config)
        policy = POLICIES[report.policy]
        run_inputs = cast_inputs(inputs, policy.dtype)
        timer = config.timer or default_timer(input_device(inputs), config.tuning.get("run_mode", "graph"))
        with torch.no_grad(), tf32_flags(policy.dense_tf32):
            layers, to_inductor = _inductor_layers(sparse, run_inputs, mode, config, timer, clock)
            sparse(*run_inputs)  # binds every layer at this shape before tracing
            sparse_compiled = _first_compiled_call(sparse, run_inputs, mode, config, clock, "compile sparsified")
            given = model if parameter_dtype(model, ()) == policy.dtype else copy.deepcopy(model).to(policy.dtype)
            given_compiled = _first_compiled_call(given, run_inputs, mode, config, clock, "compile as given")
            with clock.bar("timing compiled", total=2, unit="timing") as bar:
                kept, sparse_ms, dense_ms = check_compiled(
                    lambda: sparse_compiled(*run_inputs), lambda: given_compiled(*run_inputs), TickingTimer(timer, bar))
    report.compiled = CompileCheck(mode, _name(config.compiler), sparse_ms, dense_ms, kept, layers, to_inductor,
                                   dict(clock.seconds))
    if kept == "sparse":
        return CompiledModel(sparse, sparse_compiled, report, run_inputs)
    return CompiledModel(given, given_compiled, report, run_inputs)


def _tuned_copy(model: nn.Module, inputs: tuple, config: CompileConfig):
    """(a copy of `model` prepared and tuned, with its parameters frozen; its `TuneReport`)."""
    sparse = copy.deepcopy(model)
    if config.prepare and not any(isinstance(module, SparseConv2d) for module in sparse.modules()):
        try:
            sparse = prepare_for_inference(sparse)
        except Exception as error:  # noqa: BLE001 - any fx failure: tune without the fusions, as sparsify_ can
            _LOG.warning("prepare_for_inference failed (%s: %s): tuning the model without its fusions",
                         type(error).__name__, error)
    disable_cuda_graphs(sparse)  # under torch.compile the compiled graph replaces them
    with torch.no_grad():
        report = autotune_model(sparse, inputs, progress=config.progress, timer=config.timer, **config.tuning)
    sparse.sparsecnn_report = report
    return sparse.requires_grad_(False), report


def _torch_compile(fn: Callable, mode: str, compiler) -> Callable:
    """torch.compile of `fn` in `mode` by `compiler`, with static shapes (each SparseConv2d binding is
    per input shape); only inductor takes a mode."""
    return torch.compile(fn, backend=compiler, mode=mode if compiler == "inductor" else None, dynamic=False)


def _inductor_layers(sparse: nn.Module, inputs: tuple, mode: str, config: CompileConfig, timer: Timer,
                     clock: PhaseClock):
    """Step 2 of the module doc when `config.inductor_layers`, else ({}, [])."""
    if not config.inductor_layers:
        return {}, []
    convs = sum(isinstance(module, SparseConv2d) for module in sparse.modules())
    layer_mode = _LAYER_MODES.get(mode, mode)
    with clock.bar("inductor layers", total=convs, unit="conv") as bar:
        return leave_to_inductor(sparse, inputs, lambda fn: _torch_compile(fn, layer_mode, config.compiler), timer,
                                 bar)


def _first_compiled_call(module: nn.Module, inputs: tuple, mode: str, config: CompileConfig, clock: PhaseClock,
                         phase: str) -> Callable:
    """`module` compiled, after its first call (which compiles it) in phase `phase`."""
    compiled = _torch_compile(module, mode, config.compiler)
    with clock.bar(phase, total=1) as bar:
        compiled(*inputs)
        bar.update(1)
    return compiled


def _name(compiler) -> str:
    return compiler if isinstance(compiler, str) else getattr(compiler, "__name__", type(compiler).__name__)
