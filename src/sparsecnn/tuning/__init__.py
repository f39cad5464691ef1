"""Measured choice among backends: per-layer tuning with early exit, precision policies, and
decisions cached on disk per environment (`tuning.autotune_model` applies it to a whole model)."""
from sparsecnn.tuning.cache import TuneCache, default_cache_dir, layer_key, pattern_hash
from sparsecnn.tuning.compiled import CompileConfig, CompiledModel, compile
from sparsecnn.tuning.fingerprint import environment_fingerprint
from sparsecnn.tuning.gains import block_gains, tensorcore_gains
from sparsecnn.tuning.phases import PhaseClock
from sparsecnn.tuning.precision import POLICIES, PrecisionPolicy, resolve_policy, tf32_flags
from sparsecnn.tuning.report import CompileCheck, LayerResult, ModelCheck, TuneReport
from sparsecnn.tuning.select import (DEFAULT_DROP_RATIO, Candidate, EagerTimer, MeasuringTimer, Selection, Timer,
                                     candidates_for, pick_fastest)
from sparsecnn.tuning.sparsify import autotune_model, sparsify_
from sparsecnn.tuning.timing import benchmark, time_one_call
from sparsecnn.tuning.tuner import tune_layer

__all__ = ["DEFAULT_DROP_RATIO", "Candidate", "CompileCheck", "CompileConfig", "CompiledModel", "EagerTimer",
           "LayerResult", "MeasuringTimer", "ModelCheck", "POLICIES", "PhaseClock", "PrecisionPolicy", "Selection",
           "Timer", "TuneCache", "TuneReport", "autotune_model", "benchmark", "block_gains", "candidates_for",
           "compile", "default_cache_dir", "environment_fingerprint", "layer_key", "pattern_hash", "pick_fastest",
           "resolve_policy", "sparsify_", "tensorcore_gains", "tf32_flags", "time_one_call", "tune_layer"]
