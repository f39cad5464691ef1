"""`sparsify_` and `autotune_model`: run a model's convolutions as `SparseConv2d`, in place.

Tuning runs the model once on the example inputs with a pre-hook on each selected layer: the hook
tunes the layer on the input it sees (`tuning.tune_layer`) and the layer then runs its choice, so
each activation lives only as long as the forward pass needs it and that pass's output is the
tuned model's output.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsecnn.backends import get_backend
from sparsecnn.core.reference import relative_error
from sparsecnn.core.workers import job_times, reset_job_times
from sparsecnn.nn.graphed import disable_cuda_graphs, enable_cuda_graphs
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning.cache import TuneCache, layer_key
from sparsecnn.tuning.fingerprint import environment_fingerprint
from sparsecnn.tuning.phases import PhaseClock
from sparsecnn.tuning.precision import PrecisionPolicy, resolve_policy, tf32_flags
from sparsecnn.tuning.report import TuneReport
from sparsecnn.tuning.select import (DEFAULT_DROP_RATIO, Candidate, EagerTimer, MeasuringTimer, Timer,
                                     candidates_for, pending_candidates, prefetch_candidates)
import sparsecnn.tuning.model_decision as model_decision
from sparsecnn.tuning.layout import is_batch_backend, is_batch_inner, set_tuning_layout
from sparsecnn.tuning.model_check import dense_backend, model_timer
from sparsecnn.tuning.tuner import cached_choice, finish_deferred, tune_layer
from sparsecnn.tuning.whole_model import GivenModel, WholeModel, replace_module

FilterFn = Callable[[str, nn.Module], bool]
_LOG = logging.getLogger("sparsecnn.tuning")
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, SparseConv2d)
RUN_MODES = ("graph", "eager")


def _selected(model: nn.Module, filter_fn: Optional[FilterFn]) -> List[Tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, _CONV_TYPES) and (filter_fn is None or filter_fn(name, module))]


def as_tuple(example_inputs) -> tuple:
    """A model's positional inputs as a tuple: `example_inputs` itself (tuple or list) or (it,)."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _checked_mask(layer: SparseConv2d, name: str, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`mask` (None: the layer's own) after checking it fits the layer."""
    if mask is None:
        return layer.mask
    if mask.shape != layer.mask.shape or mask.dtype != torch.bool:
        raise ValueError(f"masks[{name!r}] must be bool with shape {tuple(layer.mask.shape)}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    return mask


def _apply_mask_(layer: SparseConv2d, name: str, mask: Optional[torch.Tensor]) -> None:
    if mask is not None:
        layer.mask.copy_(_checked_mask(layer, name, mask))


def _sparse_layer(name: str, module: nn.Module, backend: str, mask: Optional[torch.Tensor]) -> SparseConv2d:
    """A plain conv wrapped (masked by `mask`); an existing SparseConv2d as it is (mask updated)."""
    if not isinstance(module, SparseConv2d):
        return SparseConv2d.from_dense(module, backend, mask)
    with torch.no_grad():
        _apply_mask_(module, name, mask)
    return module


def parameter_dtype(model: nn.Module, inputs: tuple) -> torch.dtype:
    """The dtype of the model's first floating-point parameter or buffer, else of its inputs (fp32: none)."""
    tensors = [*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """`inputs` with every floating-point tensor converted to `dtype`."""
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def _tensors(output) -> List[torch.Tensor]:
    """The tensors of a model output: a tensor, or nested tuples / lists / dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in _tensors(item)]
    return []


def _max_rel_error(output, reference) -> Optional[float]:
    pairs = [(out, ref) for out, ref in zip(_tensors(output), _tensors(reference))
             if out.is_floating_point() and ref.is_floating_point()]
    return max((relative_error(out, ref) for out, ref in pairs), default=None)


def sparsify_(model: nn.Module, example_inputs=None, backend: str = "auto",
              filter_fn: Optional[FilterFn] = None, masks: Optional[Dict[str, torch.Tensor]] = None,
              backends: Optional[List[str]] = None, dtype: Optional[str] = None, cache_dir=None,
              retune: bool = False, progress: Optional[bool] = None, run_mode: str = "graph",
              cuda_graphs: bool = True) -> nn.Module:
    """Run every Conv1d/Conv2d of `model` (selected by `filter_fn(name, module)`) as `SparseConv2d`.

    backend: a registered backend name for every layer, or "auto" to tune each layer on its real
    input from `model(*example_inputs)` (see `autotune_model`, whose `TuneReport` is kept as
    `model.sparsecnn_report`). Layers that already are `SparseConv2d` (e.g. from
    `prepare_for_inference`) keep their weight, bias, mask and activation and get a new backend.
    masks: module name -> bool mask (default: a `weight_mask` from torch.nn.utils.prune, else the
    weight's non-zeros; an existing SparseConv2d keeps its mask). dtype: None (the model's own
    precision, exact) or "fp32" (exact, no TF32), "tf32", "fp16", "bf16", "fp64"; the model is
    converted to that dtype. cache_dir, retune, progress, run_mode: see `autotune_model`.
    cuda_graphs: on CUDA, plain calls `model(x)` replay a CUDA graph captured once per input
    signature (`nn.graphed.enable_cuda_graphs`; eager under torch.compile, autograd, training, or
    where capture fails), and the model's parameters stop requiring grad (an inference model);
    False leaves both as they were. Returns `model`, modified in place.
    """
    disable_cuda_graphs(model)  # tuning must run the forward itself, not replay graphs of an earlier call
    if backend == "auto":
        if example_inputs is None:
            raise ValueError("backend='auto' needs example_inputs to time the candidates on")
        model.sparsecnn_report = autotune_model(model, example_inputs, filter_fn=filter_fn, masks=masks,
                                                backends=backends, dtype=dtype, cache_dir=cache_dir,
                                                retune=retune, progress=progress, run_mode=run_mode)
        return _graphed(model, cuda_graphs)
    get_backend(backend)
    inputs = as_tuple(example_inputs) if example_inputs is not None else ()
    model.to(resolve_policy(dtype, parameter_dtype(model, inputs)).dtype)
    for name, module in _selected(model, filter_fn):
        layer = _sparse_layer(name, module, backend, (masks or {}).get(name))
        if layer is module:
            layer.set_backend(backend, None)
        else:
            replace_module(model, name, layer)
    return _graphed(model, cuda_graphs)


def _graphed(model: nn.Module, cuda_graphs: bool) -> nn.Module:
    """`model` replaying CUDA graphs for plain calls, its parameters frozen, if `cuda_graphs` and on CUDA."""
    if cuda_graphs and any(tensor.is_cuda for tensor in [*model.parameters(), *model.buffers()]):
        model.requires_grad_(False)
        enable_cuda_graphs(model)
    return model


def autotune_model(model: nn.Module, example_inputs, *, filter_fn: Optional[FilterFn] = None,
                   masks: Optional[Dict[str, torch.Tensor]] = None, backends: Optional[List[str]] = None,
                   dtype: Optional[str] = None, cache_dir=None, retune: bool = False,
                   progress: Optional[bool] = None, timer: Optional[Timer] = None,
                   drop_ratio: float = DEFAULT_DROP_RATIO, run_mode: str = "graph") -> TuneReport:
    """Make each selected conv of `model` a `SparseConv2d` running its fastest candidate; in place.

    example_inputs: a tensor or a tuple of `model`'s positional inputs, on the model's device (put
    the model in eval mode first: it runs twice). Each layer is tuned at the shape it sees
    (`tuning.tune_layer`): every backend x config supporting it (only `backends`, plus the dense
    ones, when given) at the precision policy `dtype` (see `sparsify_`), decisions cached in
    `cache_dir` (default `tuning.default_cache_dir()`) unless `retune`. progress: a tqdm bar
    per phase (reference pass, prefetch, layers, linears, layouts, model as given, model check),
    each ending with its wall seconds (default: when stderr is a terminal). run_mode: how the
    model will run, which decides what is timed: "graph" (default; CUDA graphs or torch.compile
    with them: GPU time, launches hidden) or "eager" (plain calls: wall time of back-to-back
    calls, CPU launch cost included, so layers whose kernels save less GPU time than their
    launches cost stay dense). timer: how candidates
    are timed (default: `MeasuringTimer`, or `EagerTimer` for run_mode "eager", on the inputs'
    device). Then each `SplitKLinear` (from `prepare_for_inference`) that sees a CUDA fp32 input
    gets the fastest of F.linear and its split-K GEMMs (`linear.tune_linears`, same timer), before the
    layout and whole-model checks time the model. Those whole-model decisions are cached too
    (`model_decision`): when every layer's decision came from the cache, the recorded ones are put
    back and nothing is timed. Layers the inputs never reach are left as they were. Returns the `TuneReport`,
    with the max relative error of the tuned model's outputs against the original model's
    (computed before conversion, TF32 off).
    """
    if run_mode not in RUN_MODES:
        raise ValueError(f"run_mode must be one of {RUN_MODES}, got {run_mode!r}")
    inputs = as_tuple(example_inputs)
    model_dtype = parameter_dtype(model, inputs)
    device = input_device(inputs)
    policy = resolve_policy(dtype, model_dtype, device.type)
    cache = TuneCache(cache_dir, environment_fingerprint(device))
    timer = timer or default_timer(device, run_mode)
    whole_model = model_timer(timer, model, device.type, run_mode)
    clock = PhaseClock(progress=show_progress(progress))
    reset_job_times()

    def run():
        return model(*cast_inputs(inputs, policy.dtype))

    with clock.phase("total"):
        originals = dict(_selected(model, filter_fn))
        with torch.no_grad(), tf32_flags(False), clock.bar("reference pass", total=1) as bar:
            reference, input_shapes = _run_recording_input_shapes(model, cast_inputs(inputs, model_dtype),
                                                                  originals)
            bar.update(1)
        model.to(policy.dtype)
        given = GivenModel(model, originals)
        with torch.no_grad(), tf32_flags(policy.dense_tf32):
            layers = {name: _sparse_layer(name, module, "dense", None) for name, module in originals.items()}
            for name, layer in layers.items():
                if layer is not originals[name]:
                    replace_module(model, name, layer)
            with clock.bar("prefetch", total=len(layers), unit="layer") as bar:
                _prefetch(layers, input_shapes, masks or {}, policy, device.type, backends,
                          None if retune else cache, run_mode, bar)
            tuning = _LayerTuning(layers, masks or {}, policy, backends, cache, timer, retune, drop_ratio, clock,
                                  run_mode)
            with clock.bar("layers", total=len(layers), unit="layer") as bar:
                output = tuning.run(model, cast_inputs(inputs, policy.dtype), bar)
                tuning.finish_deferred()
        unreached = [name for name in layers if name not in tuning.results]
        for name in unreached:
            if layers[name] is not originals[name]:
                replace_module(model, name, originals[name])
        _log_notes(tuning.results.values())
        tuned = {name: layers[name] for name in tuning.results}
        results = list(tuning.results.values())
        key = model_decision.model_key(results, model, tuned, cast_inputs(inputs, policy.dtype), given.describe(),
                                       dense_backend(device.type), run_mode)
        recorded = model_decision.lookup(cache, key) if model_decision.reusable(results, retune) else None
        with torch.no_grad(), tf32_flags(policy.dense_tf32):
            if recorded is not None:
                check = model_decision.apply(recorded, model, tuned, lambda: given.restore(model, layers))
                linears, batch_inner, layout_ms = recorded.linears, recorded.batch_inner, recorded.layout_ms
                output = run()
            else:
                whole = WholeModel(model, run, tuned, tuning.results, device.type, timer, whole_model, clock,
                                   lambda out: _max_rel_error(out, reference) or 0.0,
                                   lambda name: _fold_alternative(tuning.results[name], tuned[name], policy,
                                                                  device.type, backends))
                check, linears, batch_inner, layout_ms, linear_output = whole.decide(
                    cast_inputs(inputs, policy.dtype), given, layers)
                output = output if linear_output is None else linear_output
                model_decision.record(cache, key, check, tuned, tuning.results, linears, batch_inner, layout_ms)
    kept_batch_inner = [] if check.kept == "given" else [name for name in batch_inner if is_batch_inner(tuned[name])]
    return TuneReport(results, policy.name, _max_rel_error(output, reference), unreached,
                      str(cache.directory), check, clock.seconds,
                      {pool: dataclasses.asdict(times) for pool, times in job_times().items()},
                      kept_batch_inner, layout_ms, run_mode, linears, policy.describe)


def _fold_alternative(result, layer: SparseConv2d, policy: PrecisionPolicy, device_type: str,
                      backends: Optional[List[str]]) -> Optional[Candidate]:
    """The fastest candidate timed for the layer in tuning (`result.times_ms`) whose backend can fold
    a projection shortcut (`Backend.bind_shortcut`), or None: what `whole_model.fold_shortcuts`
    tries a fold on when the layer's choice cannot fold."""
    weight = layer.weight_4d().detach()
    timed = [candidate for candidate in candidates_for(result.spec, policy, device_type, backends, weight)
             if get_backend(candidate.backend).bind_shortcut is not None and candidate.label() in result.times_ms]
    return min(timed, key=lambda candidate: result.times_ms[candidate.label()], default=None)


def _run_recording_input_shapes(model: nn.Module, inputs: tuple, layers: Dict[str, nn.Module]):
    """(model(*inputs), name -> shape of the first input each of `layers` saw)."""
    shapes: Dict[str, torch.Size] = {}

    def recorder(name: str):
        def record(layer: nn.Module, args: tuple) -> None:
            shapes.setdefault(name, args[0].shape)

        return record

    hooks = [layer.register_forward_pre_hook(recorder(name)) for name, layer in layers.items()]
    try:
        return model(*inputs), shapes
    finally:
        for hook in hooks:
            hook.remove()


def _prefetch(layers: Dict[str, SparseConv2d], input_shapes: Dict[str, torch.Size], masks: Dict[str, torch.Tensor],
              policy: PrecisionPolicy, device_type: str, backends: Optional[List[str]], cache: Optional[TuneCache],
              run_mode: str, bar: tqdm) -> None:
    """Let the candidate backends start preparing each layer's weight at the input shape it will be
    tuned on, in model order, so that work for later layers overlaps the timing of earlier ones.
    The weight is the one `_LayerTuning._tune` will hand them, bit for bit; the layers themselves
    are left as they are until tuned. A layer whose decision `cache` holds (None: retuning) gets its
    choice prepared alone: the others will not run. Layers the inputs never reach are not
    prefetched. `bar` advances by one per layer."""
    for name, layer in layers.items():
        bar.update(1)
        if name not in input_shapes:
            continue
        weight = (layer.weight.detach() * _checked_mask(layer, name, masks.get(name))).to(policy.dtype)
        weight = (weight.unsqueeze(2) if layer.conv_dims == 1 else weight).contiguous()
        spec = layer.spec_for(torch.empty(input_shapes[name], device="meta"))
        candidates = candidates_for(spec, policy, device_type, backends, weight)
        if cache is not None:
            key = layer_key(spec, policy.name, weight, layer.bias is not None, layer.activation, layer.takes_residual,
                            [candidate.saved() for candidate in candidates], run_mode)
            chosen, _, _ = cached_choice(cache, key, candidates)
            candidates = candidates if chosen is None else [chosen]
        prefetch_candidates(spec, weight, policy, device_type, backends, has_bias=layer.bias is not None,
                            relu_only=layer.relu_only, candidates=candidates)


class _LayerTuning:
    """The forward pre-hooks that tune each layer the first time it runs.

    A candidate whose prefetched preparation is still running (a codegen compile in a worker) is
    not waited for: the layer is tuned without it, runs its choice, and keeps its input; after the
    pass, `finish_deferred` times such candidates against the choice on that input. Otherwise
    tuning waits at the first layers, reached long before their compiles finish.
    Meanwhile such a layer keeps writing NCHW (no batch-innermost tuning layout), the layout its
    deferred candidates write (codegen's): later layers are tuned on the input they get if one wins.
    When a deferred candidate is itself a "batch" one (`unrolled`), the tuning layout stays.
    (Deferring with the tuning layout kept fewer codegen layers: a
    "batch" stand-in's batch-innermost output made the next layers pick "batch" on that input.)
    """

    def __init__(self, layers: Dict[str, SparseConv2d], masks: Dict[str, torch.Tensor], policy: PrecisionPolicy,
                 backends: Optional[List[str]], cache: TuneCache, timer: Timer, retune: bool, drop_ratio: float,
                 clock: PhaseClock, run_mode: str):
        self.layers, self.masks, self.policy, self.backends = layers, masks, policy, backends
        self.cache, self.timer, self.retune, self.drop_ratio = cache, timer, retune, drop_ratio
        self.clock, self.run_mode = clock, run_mode
        self.bar: Optional[tqdm] = None
        self.results = {}
        self._deferred: Dict[str, tuple] = {}  # name -> the arguments tune_layer had

    def run(self, model: nn.Module, inputs: tuple, bar: tqdm):
        """`model(*inputs)` with every layer tuned just before its first call (`bar` advancing by one
        per layer); returns the output."""
        hooks = [layer.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                 for name, layer in self.layers.items()]
        if self.policy.dtype in (torch.float16, torch.bfloat16):
            hooks += [layer.register_forward_hook(_channels_last_output) for layer in self.layers.values()]
        self.bar = bar
        try:
            return model(*inputs)
        finally:
            for hook in hooks:
                hook.remove()

    def _hook(self, name: str):
        def tune_before_first_call(layer: SparseConv2d, args: tuple, kwargs: dict):
            if name not in self.results:
                residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
                self.bar.set_postfix_str(name)
                self.results[name] = self._tune(name, layer, args[0], residual)
                self.bar.update(1)

        return tune_before_first_call

    def _tune(self, name: str, layer: SparseConv2d, x: torch.Tensor, residual: Optional[torch.Tensor]):
        _apply_mask_(layer, name, self.masks.get(name))
        spec = layer.spec_for(x)
        as_2d = (lambda t: t.unsqueeze(2)) if layer.conv_dims == 1 else (lambda t: t)
        weight = layer.weight_4d().detach().contiguous()
        candidates = candidates_for(spec, self.policy, x.device.type, self.backends, weight)
        pending = pending_candidates(candidates, spec, weight, self.policy.dtype, has_bias=layer.bias is not None,
                                     relu_only=layer.relu_only)
        arguments = (as_2d(x), weight, layer.bias, spec, self.policy, candidates, self.timer, self.cache)
        epilogue = dict(drop_ratio=self.drop_ratio, activation=layer.activation,
                        residual=None if residual is None else as_2d(residual), clock=self.clock,
                        run_mode=self.run_mode)
        result = tune_layer(name, *arguments, retune=self.retune, deferred=pending, **epilogue)
        layer.set_backend(result.backend, result.config)
        if result.deferred:
            self._deferred[name] = (arguments, epilogue)
        if not result.deferred or any(is_batch_backend(c.backend, c.config) for c in result.deferred):
            set_tuning_layout(layer)
        _keep_timings(layer, result)
        return result

    def finish_deferred(self) -> None:
        """Time the candidates deferred while tuning (their work is done or waited for now)."""
        for name, (arguments, epilogue) in self._deferred.items():
            layer, first = self.layers[name], self.results[name]
            self.results[name] = final = finish_deferred(first, *arguments, **epilogue)
            if final.choice != first.choice:
                layer.set_backend(final.backend, final.config)
            _keep_timings(layer, final)
        self._deferred.clear()


def _channels_last_output(layer: nn.Module, args: tuple, output):
    """While a half-precision model is tuned, a layer's NCHW output goes on channels_last, the layout
    cuDNN's and tensorcore's half-precision kernels read and write: the layers after one that writes
    NCHW (codegen's conv1 on ResNet-50) are timed on the layout the rest of the model has, not pushed
    to NCHW kernels one after another (tensorcore then lost every ResNet-50 layer to blocks and codegen
    on NCHW inputs: 1.52 ms against 0.72). The run keeps each layer's own output layout; the
    whole-model check times the model as it runs. Batch-innermost outputs are left as they are."""
    if isinstance(output, torch.Tensor) and output.dim() == 4 and output.is_contiguous() and output.shape[1] > 1:
        return output.contiguous(memory_format=torch.channels_last)
    return None


def input_device(inputs: tuple) -> torch.device:
    """The device of the first tensor of `inputs` (CPU: none)."""
    return next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def default_timer(device: torch.device, run_mode: str) -> Timer:
    """How tuning times on `device` for `run_mode`: GPU time ("graph") or eager wall time ("eager")."""
    return EagerTimer(device) if run_mode == "eager" else MeasuringTimer(device)


def show_progress(progress: Optional[bool]) -> bool:
    """Whether to show progress bars: `progress`, or by default when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else progress


def _keep_timings(layer: SparseConv2d, result) -> None:
    layer.timings = {**{label: math.nan for label in result.dropped}, **result.times_ms}


def _log_notes(results: Sequence) -> None:
    """One warning per distinct reason a cached decision could not be used, naming its layers."""
    by_note: Dict[str, List[str]] = collections.defaultdict(list)
    for result in results:
        if result.cache_note is not None:
            by_note[result.cache_note].append(result.name)
    for note, names in by_note.items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        _LOG.warning("re-tuned %s: %s", shown, note)
