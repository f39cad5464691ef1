"""Measured choice among backends: per-layer tuning with early exit, precision policies, and
decisions cached on disk per environment (`nn.autotune_model` applies it to a whole model)."""
from .cache import CACHE_ENV_VAR, TuneCache, default_cache_dir, layer_key, pattern_hash
from .fingerprint import environment_fingerprint
from .phases import PhaseClock
from .precision import POLICIES, PrecisionPolicy, resolve_policy, tf32_flags
from .report import LayerResult, ModelCheck, TuneReport
from .select import DEFAULT_DROP_RATIO, Candidate, EagerTimer, MeasuringTimer, Selection, Timer, candidates_for, pick_fastest
from .timing import benchmark, time_one_call
from .tuner import tune_layer

__all__ = ["CACHE_ENV_VAR", "DEFAULT_DROP_RATIO", "Candidate", "EagerTimer", "LayerResult", "MeasuringTimer", "ModelCheck", "POLICIES", "PhaseClock", "PrecisionPolicy",
           "Selection", "Timer", "TuneCache", "TuneReport", "benchmark", "candidates_for", "default_cache_dir",
           "environment_fingerprint", "layer_key", "pattern_hash", "pick_fastest", "resolve_policy",
           "tf32_flags", "time_one_call", "tune_layer"]
