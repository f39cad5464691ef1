"""Pick the fastest of several ways to run one layer, by measurement, dropping hopeless ones early."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from sparsecnn.backends import backend_names, config_to_dict, get_backend
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.phases import PhaseClock
from sparsecnn.tuning.precision import TF32_BACKENDS, PrecisionPolicy, tf32_variant, uses_tf32
from sparsecnn.tuning.timing import benchmark, eager_wall_ms, time_one_call

_LOG = logging.getLogger("sparsecnn.tuning.select")

# Dense cuDNN in every form the policy allows is always a candidate; "dense" is the baseline.
DENSE_BACKENDS = ("dense", "dense-tf32", "dense-channels-last", "dense-fused")
BASELINE = "dense"
DEFAULT_DROP_RATIO = 10.0
# Candidates beyond the dense ones that get a full benchmark: the fastest by their one timed run.
# A probe ranks configs well enough to keep the winner among the first few, and full benchmarks
# were most of a model's tuning time once kernels are compiled.
DEFAULT_MEASURE_TOP = 4
# A benchmarked candidate whose first repeats (`timing.CHECK_REPS`) take over this many times the
# fastest full benchmark so far is not repeated further: the choice only needs to know it is slower.
SLOWER_MARGIN = 1.25
# First calls run this many at a time on CUDA: they compile kernels, and Triton's compiler and
# ptxas release the GIL, so compiling a layer's configs in threads overlaps them.
_FIRST_CALL_THREADS = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a layer: a registered backend and one of its configs (None: no config)."""

    backend: str
    config: Any = None

    def label(self) -> str:
        return self.backend if self.config is None else f"{self.backend}[{self.config}]"

    def saved(self) -> Tuple[str, Optional[dict]]:
        """(backend, config as a dict): the JSON-able identity of this candidate."""
        return self.backend, config_to_dict(self.config)


def _configs(name: str, spec: ConvSpec, policy: PrecisionPolicy, auto_only: bool,
             weight: Optional[torch.Tensor]) -> List[Any]:
    backend = get_backend(name)
    configs = backend.configs(spec, policy.dtype)
    if policy.allow_tf32 and policy.dtype == torch.float32:
        configs = configs + [variant for variant in map(tf32_variant, configs) if variant is not None]
    if auto_only and backend.auto_configs is not None:  # an auto list may name TF32 variants
        auto = backend.auto_configs(spec, policy.dtype)
        configs = [config for config in configs if config in auto]
    configs = [config for config in dict.fromkeys(configs) if policy.allow_tf32 or not uses_tf32(name, config)]
    if auto_only and weight is not None and backend.weight_configs is not None and configs:
        configs = backend.weight_configs(weight, configs)
    return configs


def candidates_for(spec: ConvSpec, policy: PrecisionPolicy, device_type: str,
                   backends: Optional[List[str]] = None, weight: Optional[torch.Tensor] = None) -> List[Candidate]:
    """Every (backend, config) that runs `spec` at the policy's dtype on `device_type`.

    The dense backends are always included. Without an explicit `backends` list, a backend is
    skipped on devices outside its `autotune_devices` and, under a policy offering TF32, unless
    `auto_with_tf32`; it offers only its `auto_configs`, and of those, given the layer's masked
    `weight`, only the ones its `weight_configs` keeps. TF32 candidates (a `dense-tf32` backend, and
    for fp32 the "tf32" variant of every config with a `precision` field) appear only when the policy
    allows TF32; `dense-tf32` not where the policy runs dense convs in TF32 already (`dense_tf32`),
    whose `dense` is the same kernel. A backend whose `machine_check` fails (no compiler, no kernel
    loader) is left out, with one warning per process and reason.
    """
    names = backend_names() if backends is None else [*DENSE_BACKENDS, *backends]
    found: List[Candidate] = []
    unavailable: Dict[str, List[str]] = {}
    for name in dict.fromkeys(names):
        backend = get_backend(name)
        if backends is None and backend.autotune_devices is not None and device_type not in backend.autotune_devices:
            continue
        if backends is None and policy.allow_tf32 and not backend.auto_with_tf32:
            continue
        if policy.dense_tf32 and name in TF32_BACKENDS:  # `dense` runs the same TF32 kernel under this policy
            continue
        if backend.unsupported_reason(spec, policy.dtype, device_type) is not None:
            continue
        why = backend.machine_check() if backend.machine_check is not None else None
        if why is not None:
            unavailable.setdefault(why, []).append(name)
            continue
        configs = _configs(name, spec, policy, backends is None, weight)
        found.extend(Candidate(name, config) for config in configs)
    for why, left_out in unavailable.items():
        _say_once(f"{', '.join(left_out)} not tried: {why}")
    return found


_SAID: set = set()


def _say_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it (not once per layer)."""
    if message not in _SAID:
        _SAID.add(message)
        _LOG.warning(message)


class Timer(Protocol):
    """How candidates are timed (tests inject fake timings).

    probe: milliseconds of one call of `fn` after one untimed call; measure: the median of a full
    benchmark. Either may raise, which drops the candidate."""

    def probe(self, candidate: Candidate, fn: Callable[[], object]) -> float: ...

    def measure(self, candidate: Candidate, fn: Callable[[], object]) -> float: ...


@dataclasses.dataclass(frozen=True)
class MeasuringTimer:
    """Real timings on `device`: `time_one_call` to probe, `benchmark` (L2 flushed on CUDA) to measure.

    On CUDA the times are GPU work alone (`hide_launch`): what a CUDA-graph or compiled run pays.
    Eager runs add each call's CPU launch cost, which for a small layer can exceed its GPU time.
    The budget is small (a model has ~20 candidates x 50 layers; each full benchmark costs about
    warmup_ms + rep_ms plus the L2 flushes): 50 repeats give a median stable to a few percent,
    enough to rank candidates. The warm-up is short: a candidate is benchmarked after its first call
    and probe, among other layers' work that keeps the GPU's clocks up. `measure` stops after
    `timing.CHECK_REPS` repeats whose median is over `slower_than_ms`."""

    device: torch.device
    warmup_ms: float = 1.0
    rep_ms: float = 25.0
    max_rep: int = 50

    def probe(self, candidate: Candidate, fn: Callable[[], object]) -> float:
        return time_one_call(fn, self.device, hide_launch=True)

    def measure(self, candidate: Candidate, fn: Callable[[], object], slower_than_ms: float = math.inf) -> float:
        return benchmark(fn, self.device, self.warmup_ms, self.rep_ms, max_rep=self.max_rep, hide_launch=True,
                         stop_above_ms=None if math.isinf(slower_than_ms) else slower_than_ms)["median_ms"]


@dataclasses.dataclass(frozen=True)
class EagerTimer:
    """Wall time per call of back-to-back eager calls (`eager_wall_ms`): what a model run without
    CUDA graphs or torch.compile pays, the CPU's launch cost included. A small layer's Triton launch
    costs more CPU than its GPU work at small batches, so under this timer dense cuDNN wins the
    layers whose sparse kernel saves less than that."""

    device: torch.device
    calls: int = 10
    repeats: int = 3

    def probe(self, candidate: Candidate, fn: Callable[[], object]) -> float:
        return eager_wall_ms(fn, self.device, calls=3)

    def measure(self, candidate: Candidate, fn: Callable[[], object]) -> float:
        return eager_wall_ms(fn, self.device, self.calls, self.repeats)


@dataclasses.dataclass
class Selection:
    """best: the fastest candidate; times_ms: median ms of each benchmarked candidate (of its first
    repeats alone where those were over SLOWER_MARGIN x the fastest); dropped: why each other
    candidate was left out (label -> reason)."""

    best: Candidate
    times_ms: Dict[str, float]
    dropped: Dict[str, str]

    @property
    def best_ms(self) -> float:
        return self.times_ms[self.best.label()]


def _runner(candidate: Candidate, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            spec: ConvSpec, relu: bool, residual: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The candidate's kernel bound once to its packed weight, as `SparseConv2d` runs it."""
    backend = get_backend(candidate.backend)
    call = backend.bind_for(backend.prepare(weight, candidate.config), spec, candidate.config, x.dtype,
                            bias is not None, relu and residual is None)
    return lambda: call(x, bias, residual, relu)


def _error_text(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first_line[:200]}"


def _first_calls(runners: Dict[Candidate, Callable[[], torch.Tensor]], device: torch.device,
                 dropped: Dict[str, str], exact: torch.Tensor, clock: PhaseClock) -> Dict[Candidate, float]:
    """Call each runner once (compiling its kernels), dropping those that raise; returns each
    one's relative error against `exact` (the fp64 output of the batch's first image). On CUDA, one candidate per backend
    first (lazy initialisations stay single-threaded), then the rest several at a time; elsewhere
    one by one (Triton's CPU interpreter is not thread-safe). clock gets each call's seconds as
    phase "first calls <backend>" (calls on threads overlap: these can sum to more than the wall)."""
    errors: Dict[Candidate, Exception] = {}
    accuracy: Dict[Candidate, float] = {}

    def call(candidate: Candidate) -> None:
        start = time.perf_counter()
        try:  # any failure (a config the hardware refuses, a compile error) drops the candidate
            accuracy[candidate] = relative_error(runners[candidate]()[:1], exact)
        except Exception as error:  # noqa: BLE001
            errors[candidate] = error
        clock.add(f"first calls {candidate.backend}", time.perf_counter() - start)

    first_per_backend: Dict[str, Candidate] = {}
    for candidate in runners:
        first_per_backend.setdefault(candidate.backend, candidate)
    for candidate in (first_per_backend.values() if device.type == "cuda" else runners):
        call(candidate)
    if device.type == "cuda":
        rest = [candidate for candidate in runners if candidate not in first_per_backend.values()]
        with concurrent.futures.ThreadPoolExecutor(_FIRST_CALL_THREADS) as pool:
            list(pool.map(call, rest))
        torch.cuda.synchronize(device)
    for candidate, error in errors.items():
        dropped[candidate.label()] = _error_text(error)
        runners.pop(candidate)
    return accuracy


# A candidate's output may be off the exact (fp64) result by at most this many times the error of
# the least exact dense candidate (cuDNN in the policy's dtype, or with TF32 where it is allowed),
# plus ERROR_FLOOR (fp32 kernels summing in another order than cuDNN).
ERROR_RATIO = 2.0
ERROR_FLOOR = 1e-5


def _exact_output(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec, relu: bool,
                  residual: Optional[torch.Tensor]) -> torch.Tensor:
    """act(conv(x, weight) + bias + residual) in float64 for the first image of the batch (what each
    candidate's output is held to: one image keeps the fp64 conv cheap beside the candidates')."""
    exact = reference_conv(x[:1], weight, bias, stride=spec.stride, padding=spec.padding, dilation=spec.dilation,
                           groups=spec.groups, fp64=True)
    if residual is not None:
        exact = exact + residual[:1].double()
    return exact.clamp(min=0) if relu else exact


def _drop_inaccurate(errors: Dict[Candidate, float], runners: Dict[Candidate, Callable[[], torch.Tensor]],
                     dropped: Dict[str, str]) -> None:
    """Drop every sparse candidate whose relative error against the fp64 output is over ERROR_RATIO x
    the largest dense candidate's + ERROR_FLOOR (e.g. a TF32 kernel whose reduction order loses more
    than cuDNN's TF32 does)."""
    dense = max((error for candidate, error in errors.items() if candidate.backend in DENSE_BACKENDS), default=0.0)
    limit = ERROR_RATIO * dense + ERROR_FLOOR
    for candidate, error in errors.items():
        if candidate.backend not in DENSE_BACKENDS and not error <= limit:
            dropped[candidate.label()] = (f"relative error {error:.2e} against fp64, over {ERROR_RATIO:g}x the "
                                          f"dense candidates' {dense:.2e} + {ERROR_FLOOR:g}")
            runners.pop(candidate)


def _to_measure(probes: Dict[Candidate, float], drop_ratio: float, measure_top: int,
                dropped: Dict[str, str]) -> List[Candidate]:
    """The probed candidates worth a full benchmark: every dense one (the baseline always) and the
    `measure_top` fastest others, none over `drop_ratio` x the fastest probe."""
    fastest = min((ms for ms in probes.values() if not math.isnan(ms)), default=math.inf)
    kept: List[Candidate] = []
    for candidate, probe_ms in probes.items():
        if candidate.backend != BASELINE and not probe_ms <= drop_ratio * fastest:
            dropped[candidate.label()] = (f"one run took {probe_ms:.4g} ms, over {drop_ratio:g}x the fastest "
                                          f"({fastest:.4g} ms)")
        else:
            kept.append(candidate)
    others = sorted((c for c in kept if c.backend not in DENSE_BACKENDS), key=probes.__getitem__)
    for candidate in others[measure_top:]:
        dropped[candidate.label()] = (f"one run took {probes[candidate]:.4g} ms, not among the "
                                      f"{measure_top} fastest sparse candidates")
    return [c for c in kept if c.backend in DENSE_BACKENDS or c in others[:measure_top]]


def pick_fastest(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
                 candidates: List[Candidate], timer: Timer, drop_ratio: float = DEFAULT_DROP_RATIO,
                 relu: bool = False, residual: Optional[torch.Tensor] = None,
                 measure_top: int = DEFAULT_MEASURE_TOP, clock: Optional[PhaseClock] = None) -> Selection:
    """Time each candidate on input `x` (N, C, H, W) and weight (K, C // groups, R, S).

    Each is first run once untimed (all first calls before any timing, several at a time on CUDA,
    as they compile, each output checked against the fp64 one), then once timed (`timer.probe`); one
    that raises, errs by more than `_drop_inaccurate` allows, or whose one run is over `drop_ratio`
    x the fastest one run, is dropped. Benchmarked (`timer.measure`), fastest probe first: the dense
    candidates (always the `dense` baseline, in full) and the `measure_top` fastest others by their
    probe; each may stop early once clearly slower than the fastest so far (`SLOWER_MARGIN`).
    relu / residual (None or the output's shape): the fused epilogue every candidate computes.
    clock: gets the wall seconds of each stage ("bind <backend>": packing the weight and binding,
    which includes waiting for prefetched work; "first calls": the compiles; "probes";
    "benchmarks"). Raises RuntimeError when no candidate runs.
    """
    if measure_top < 1:
        raise ValueError(f"measure_top must be >= 1, got {measure_top}")
    if not candidates:
        reasons = [get_backend(name).unsupported_reason(spec, x.dtype, x.device.type) for name in DENSE_BACKENDS]
        raise RuntimeError(f"no backend runs {spec} in {x.dtype} on {x.device.type}: "
                           + "; ".join(reason for reason in reasons if reason))
    clock = clock or PhaseClock()
    runners: Dict[Candidate, Callable[[], torch.Tensor]] = {}
    dropped: Dict[str, str] = {}
    for candidate in candidates:
        try:  # packing can refuse a weight (e.g. a format's size limit)
            with clock.phase(f"bind {candidate.backend}"):
                runners[candidate] = _runner(candidate, x, weight, bias, spec, relu, residual)
        except Exception as error:  # noqa: BLE001
            dropped[candidate.label()] = _error_text(error)
    with clock.phase("first calls"):
        errors = _first_calls(runners, x.device, dropped, _exact_output(x, weight, bias, spec, relu, residual), clock)
        _drop_inaccurate(errors, runners, dropped)
    probes: Dict[Candidate, float] = {}
    with clock.phase("probes"):
        for candidate, runner in runners.items():
            try:
                probes[candidate] = timer.probe(candidate, runner)
            except Exception as error:  # noqa: BLE001
                dropped[candidate.label()] = _error_text(error)
    times: Dict[str, float] = {}
    with clock.phase("benchmarks"):  # fastest probe first, so that the others can stop early
        for candidate in sorted(_to_measure(probes, drop_ratio, measure_top, dropped), key=probes.__getitem__):
            bound = math.inf if candidate.backend == BASELINE or not times else SLOWER_MARGIN * min(times.values())
            try:
                times[candidate.label()] = _measure(timer, candidate, runners[candidate], bound)
            except Exception as error:  # noqa: BLE001
                dropped[candidate.label()] = _error_text(error)
    by_label = {candidate.label(): candidate for candidate in candidates}
    if not times:
        raise RuntimeError(f"no candidate ran for {spec}: " + "; ".join(f"{k}: {v}" for k, v in dropped.items()))
    best = min(times, key=times.get)
    return Selection(by_label[best], times, dropped)


def _measure(timer: Timer, candidate: Candidate, fn: Callable[[], object], slower_than_ms: float) -> float:
    """timer.measure, told when it may stop early (`slower_than_ms`; the baseline never) where its
    `measure` takes that argument (`MeasuringTimer`)."""
    if math.isinf(slower_than_ms) or "slower_than_ms" not in inspect.signature(timer.measure).parameters:
        return timer.measure(candidate, fn)
    return timer.measure(candidate, fn, slower_than_ms=slower_than_ms)


def prefetch_candidates(spec: ConvSpec, weight: torch.Tensor, policy: PrecisionPolicy, device_type: str,
                        backends: Optional[List[str]] = None, *, has_bias: bool, relu_only: bool = False,
                        candidates: Optional[List[Candidate]] = None) -> None:
    """Call `Backend.prefetch(spec, weight, policy.dtype, has_bias, configs, relu_only)` of each
    backend among `candidates` (None: those `candidates_for` offers), with their configs.

    spec: the layer at the input shape it will be tuned on; weight: the masked (K, C // groups, R, S)
    weight, bit-identical to the one tuning will prepare, so backends can recognise it by content;
    relu_only: the layer computes relu(conv + bias), no residual (see `Backend.bind_for`).
    """
    if candidates is None:
        candidates = candidates_for(spec, policy, device_type, backends, weight)
    configs: Dict[str, List[Any]] = {}
    for candidate in candidates:
        configs.setdefault(candidate.backend, []).append(candidate.config)
    for name, offered in configs.items():
        prefetch = get_backend(name).prefetch
        if prefetch is not None:
            prefetch(spec, weight, policy.dtype, has_bias, offered, relu_only)


def pending_candidates(candidates: List[Candidate], spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, *,
                       has_bias: bool, relu_only: bool = False) -> List[Candidate]:
    """Those of `candidates` whose backend's prefetched work for this layer is still running
    (`Backend.pending`): binding them now would wait. weight, relu_only: see `prefetch_candidates`."""
    pending = []
    for candidate in candidates:
        check = get_backend(candidate.backend).pending
        if check is not None and check(spec, weight, dtype, has_bias, candidate.config, relu_only):
            pending.append(candidate)
    return pending
