"""What tuning chose, per layer and for the model, with a text table."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.phases import format_phases


@dataclasses.dataclass
class LayerResult:
    """One layer's decision.

    choice: the chosen candidate's label; time_ms / dense_ms: median ms of the choice and of the
    `dense` baseline at the same precision; times_ms: median ms of every fully benchmarked
    candidate; dropped: label -> why it was not benchmarked (empty on a cache hit); cache: "hit",
    "tuned", or "retuned" with `cache_note` saying why the entry on disk could not be used;
    deferred: candidates still to time (`tuner.finish_deferred`); key: the digest of the layer's
    cache key (`cache.key_digest`; empty where no key was made), which the model's decision names.
    """

    name: str
    spec: ConvSpec
    backend: str
    config: Any
    choice: str
    time_ms: float
    dense_ms: float
    times_ms: Dict[str, float]
    dropped: Dict[str, str]
    cache: str
    cache_note: Optional[str] = None
    deferred: Tuple[Any, ...] = ()
    key: str = ""

    @property
    def speedup(self) -> float:
        return self.dense_ms / self.time_ms

    def fastest_per_backend(self) -> Dict[str, float]:
        """{backend: the least median ms of its fully benchmarked candidates} (`times_ms`, whose
        labels are "backend" or "backend[config]")."""
        fastest: Dict[str, float] = {}
        for label, ms in self.times_ms.items():
            backend = label.split("[", 1)[0]
            fastest[backend] = min(ms, fastest.get(backend, ms))
        return fastest


def _shape(spec: ConvSpec) -> str:
    return (f"{spec.N}x{spec.C}x{spec.H}x{spec.W} -> {spec.K}, {spec.R}x{spec.S}/{spec.stride[0]}"
            + (f" g{spec.groups}" if spec.groups != 1 else ""))


def format_worker_jobs(worker_jobs: Dict[str, Dict[str, float]]) -> List[str]:
    """One line per pool of `TuneReport.worker_jobs`."""
    return [f"worker jobs, {pool}: {times['jobs']} jobs, queued {times['queued_s']:.1f} s, ran "
            f"{times['ran_s']:.1f} s (longest {times['max_ran_s']:.1f} s), waited for {times['waited_s']:.1f} s"
            for pool, times in worker_jobs.items()]


@dataclasses.dataclass
class ModelCheck:
    """The whole model timed twice after tuning (median ms, GPU work only on CUDA): with the tuned
    layers and with every tuned layer on `dense_backend`; `kept`: "tuned" or "dense", the faster, or
    "given" when the model as given to tuning (`given_ms`, timed first) beat both and was put back.
    Then `switched`: the layers moved, one at a time, from the kept form to their other one (dense
    for a kept tuned model, the tuned choice for a kept dense one) because the whole model got
    faster, to `final_ms` (`tuning.model_check`). On CUDA also in eager mode (`tuned_eager_ms`,
    `dense_eager_ms`: wall ms per call of back-to-back calls, the CPU's launch costs included, which
    CUDA graphs hide; None elsewhere). `shortcuts`: the (conv, shortcut conv) pairs folded into one
    layer last (`passes.shortcut`), each because the whole model got faster, to `final_ms`.
    `channels_last_outputs`: after those, the layers whose NCHW output is handed on in channels_last
    (`layout.keep_channels_last_outputs`), each because the whole model got faster, to `final_ms`.
    `cached`: decided by an earlier tuning of the same model and layers, put back from the cache
    without timing (`model_decision`)."""

    tuned_ms: float
    dense_ms: float
    dense_backend: str
    kept: str
    tuned_eager_ms: Optional[float] = None
    dense_eager_ms: Optional[float] = None
    switched: List[str] = dataclasses.field(default_factory=list)
    final_ms: Optional[float] = None
    given_ms: Optional[float] = None
    shortcuts: List[List[str]] = dataclasses.field(default_factory=list)
    channels_last_outputs: List[str] = dataclasses.field(default_factory=list)
    cached: bool = False

    @property
    def best_ms(self) -> float:
        """The model's time as kept after the tuned / dense comparison and the switches."""
        return self.final_ms if self.final_ms is not None else min(self.tuned_ms, self.dense_ms)

    @property
    def speedup_over_given(self) -> Optional[float]:
        """The model as given / as kept: >= 1 (slower results put the model back as given)."""
        if self.given_ms is None:
            return None
        return self.given_ms / (self.given_ms if self.kept == "given" else self.best_ms)

    @property
    def slower_in_eager(self) -> bool:
        """Whether the kept tuned layers make eager calls slower than dense ones (launch-bound)."""
        return (self.kept == "tuned" and self.tuned_eager_ms is not None and self.dense_eager_ms is not None
                and self.tuned_eager_ms > self.dense_eager_ms)

    def format(self) -> str:
        verdict = ("kept the tuned layers" if self.kept == "tuned"
                   else f"every tuned layer now runs {self.dense_backend}")
        text = (f"whole model: {self.tuned_ms:.4f} ms tuned, {self.dense_ms:.4f} ms with every layer on "
                f"{self.dense_backend}: {verdict}")
        if self.switched:
            other = "dense" if self.kept == "tuned" else "their tuned choice"
            text += f"; {len(self.switched)} layers switched to {other} in context: {self.final_ms:.4f} ms"
        if self.tuned_eager_ms is not None and self.dense_eager_ms is not None:
            text += f"; eager calls {self.tuned_eager_ms:.4f} ms tuned, {self.dense_eager_ms:.4f} ms dense"
        if self.slower_in_eager:
            text += " (slower in eager mode: run the model under CUDA graphs or torch.compile)"
        if self.kept == "given":
            text += f"; the model as given took {self.given_ms:.4f} ms, faster: it is kept as given"
        elif self.given_ms is not None:
            text += f"; {self.speedup_over_given:.2f}x faster than the model as given ({self.given_ms:.4f} ms)"
        if self.shortcuts:
            text += f"; {len(self.shortcuts)} projection shortcuts folded into their convs: {self.final_ms:.4f} ms"
        if self.channels_last_outputs:
            text += (f"; {len(self.channels_last_outputs)} NCHW outputs handed on in channels_last "
                     f"({', '.join(self.channels_last_outputs)}): {self.final_ms:.4f} ms")
        if self.cached:
            text += " (decided by an earlier tuning of this model, from the cache: nothing timed now)"
        return text


@dataclasses.dataclass
class CompileCheck:
    """The whole model under `torch.compile` after tuning (`tuning.compiled.compile`): the sparsified model
    (`sparse_ms`) against the model as given (`dense_ms`), both compiled by `compiler` in `mode`,
    median ms by the tuning timer; `kept`: "sparse" or "dense", the faster ("dense" on a tie).
    Before that, per conv run by an op of ours: `layers` (module path -> {"op_ms", "inductor_ms"}:
    the layer compiled alone as tuned, and as an aten convolution that inductor lowers and fuses
    itself), and `to_inductor`, the layers switched to the aten form because it was faster.
    phase_s: wall seconds of each phase of `compile` ("tuning" is `autotune_model`'s total)."""

    mode: str
    compiler: str
    sparse_ms: float
    dense_ms: float
    kept: str
    layers: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    to_inductor: List[str] = dataclasses.field(default_factory=list)
    phase_s: Dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """How much faster the kept model is than the other one (>= 1)."""
        return max(self.sparse_ms, self.dense_ms) / min(self.sparse_ms, self.dense_ms)

    def format(self) -> str:
        where = f"under torch.compile ({self.compiler}, mode {self.mode})"
        text = (f"{where}: sparsified {self.sparse_ms:.4f} ms, the model as given {self.dense_ms:.4f} ms: kept "
                + ("the sparsified model" if self.kept == "sparse" else "the model as given, compiled")
                + f", {self.speedup:.2f}x faster than the other")
        if self.layers:
            text += (f"\nconvs left to inductor (faster as aten convolutions in its graph): {len(self.to_inductor)} "
                     f"of {len(self.layers)} timed" + (f" ({', '.join(self.to_inductor)})" if self.to_inductor else ""))
        if self.phase_s:
            text += "\ncompile time: " + format_phases(self.phase_s)
        return text


@dataclasses.dataclass
class TuneReport:
    """The decisions for a model: one `LayerResult` per tuned conv (in call order), the precision
    policy name, the max relative error of the tuned model's outputs against the original model's
    (None when not checked), the conv layers the example input never reached, the cache dir, and
    the whole-model check against dense (None when not run), and the wall seconds of each phase of
    tuning (`PhaseClock.seconds`; "total" is the whole call) and of the jobs run ahead in worker
    processes (`worker_jobs`: pool -> `core.workers.JobTimes` as a dict), and the `direct` "batch"
    layers that write batch-innermost outputs (`tuning.layout`) with the whole-model times that decided
    it (`layout_ms`: "nchw", "batch_inner"), and the run mode the times stand for ("graph": GPU
    time, as CUDA graphs and torch.compile run it; "eager": eager wall time), and the split of each
    `nn.SplitKLinear` that was timed (`linears`: module path -> {"splits", "ms", "dense_ms"}, ms of
    the choice and of F.linear; `tuning.linears.tune_linears`), and the check under torch.compile
    (`compiled`: a `CompileCheck`, set by `tuning.compiled.compile`; None after plain tuning). The layer results are
    the per-layer decisions; when the check kept dense, the layers run `model_check.dense_backend`
    instead, but for its `switched` layers (and when it kept the tuned ones, the `switched` layers
    run dense)."""

    layers: List[LayerResult]
    policy: str
    max_rel_error: Optional[float] = None
    unreached: List[str] = dataclasses.field(default_factory=list)
    cache_dir: Optional[str] = None
    model_check: Optional[ModelCheck] = None
    phase_s: Dict[str, float] = dataclasses.field(default_factory=dict)
    worker_jobs: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    batch_inner_outputs: List[str] = dataclasses.field(default_factory=list)
    layout_ms: Dict[str, float] = dataclasses.field(default_factory=dict)
    run_mode: str = "graph"
    linears: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    policy_describe: str = ""
    compiled: Optional[CompileCheck] = None

    @property
    def total_ms(self) -> float:
        """Sum of the chosen layers' median ms (convolutions only)."""
        return sum(layer.time_ms for layer in self.layers)

    @property
    def dense_total_ms(self) -> float:
        return sum(layer.dense_ms for layer in self.layers)

    def share(self, layer: LayerResult) -> float:
        """The layer's fraction of the tuned model's conv time."""
        return layer.time_ms / self.total_ms if self.total_ms > 0 else 0.0

    def format(self) -> str:
        """A markdown table (layer, shape, choice, ms, dense ms, speedup, share, cache) and totals."""
        lines = ["| layer | shape (NxCxHxW -> K, RxS/stride) | choice | ms | dense ms | speedup | share | cache |",
                 "|---|---|---|---:|---:|---:|---:|---|"]
        lines += [f"| {layer.name} | {_shape(layer.spec)} | {layer.choice} | {layer.time_ms:.4f} | "
                  f"{layer.dense_ms:.4f} | {layer.speedup:.2f}x | {self.share(layer):.1%} | {layer.cache} |"
                  for layer in self.layers]
        speedup = self.dense_total_ms / self.total_ms if self.total_ms > 0 else float("nan")
        lines.append(f"\nconvolutions ({self.policy}, {self.run_mode} times): {self.total_ms:.4f} ms tuned, "
                     f"{self.dense_total_ms:.4f} ms dense, {speedup:.2f}x")
        if self.policy_describe:
            lines.append(f"precision policy {self.policy}: {self.policy_describe}")
        if self.linears:
            lines.append("linears (split-K GEMMs, speedup over F.linear): " + ", ".join(
                f"{name} splits={entry['splits']} {entry['dense_ms'] / entry['ms']:.2f}x"
                for name, entry in self.linears.items()))
        if self.max_rel_error is not None:
            lines.append(f"max relative error of the outputs vs the original model: {self.max_rel_error:.2e}")
        if self.model_check is not None:
            lines.append(self.model_check.format())
        if self.phase_s:
            lines.append("tuning time: " + format_phases(self.phase_s))
        if self.compiled is not None:
            lines.append(self.compiled.format())
        lines += format_worker_jobs(self.worker_jobs)
        if self.unreached:
            lines.append(f"not reached by the example inputs (left as they were): {', '.join(self.unreached)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
