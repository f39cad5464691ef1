"""Tuning decisions on disk: one JSON file per (layer key, environment), written atomically.

Directory: `cache_dir` argument, else $SPARSECNN_CACHE_DIR, else ~/.cache/sparsecnn/autotune.
File `<layer hash>-<environment hash>.json` holds {"format", "layer", "environment", "decision"};
`model-<model hash>-<environment hash>.json` holds a model's whole-model decisions the same way under
"model" (`tuning.model_decision`).
The layer key (`layer_key`) is what the choice depends on: the ConvSpec (batch included), the
precision policy, the weight's sparsity pattern, bias / ReLU / residual epilogue, the list of
candidates offered and the run mode the timings stood for. The environment is
`fingerprint.environment_fingerprint` (GPU name and capability, torch/CUDA/cuDNN/triton/driver
versions). Each environment has its own file, so
machines sharing a cache directory never overwrite each other's decisions, and a layer tuned only
elsewhere is re-tuned with a note naming what differs.

The pattern hash covers which weights are non-zero, never their values: every backend's speed
depends on the pattern only (codegen compiles values into its kernels, but keeps those in its own
cache keyed by content; its kernel's instruction count follows the pattern), so fine-tuning a
pruned model's surviving weights keeps its decisions.

Writes go to a temporary file in the same directory, then `os.replace`: readers see a whole old
or a whole new file, and two processes tuning the same layer at once leave one complete winner.
An unreadable, truncated or mismatched file is reported and re-tuned, never trusted or fatal.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import sparsecnn.settings as settings
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.fingerprint import Fingerprint, describe_difference

FORMAT_VERSION = 1
_SPEC_FIELDS = ("N", "C", "K", "H", "W", "R", "S", "stride", "padding", "dilation", "groups")


def default_cache_dir() -> Path:
    """$SPARSECNN_CACHE_DIR if set and non-empty, else ~/.cache/sparsecnn/autotune."""
    return settings.tuning_cache_dir()


def _digest(value: Any, size: int = 16) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def key_digest(key: Dict[str, Any]) -> str:
    """The hash that names a key's file (before the environment's)."""
    return _digest(key)


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def pattern_hash(weight: torch.Tensor) -> str:
    """Hash of the shape and non-zero positions of `weight` (any shape and float dtype)."""
    bits = np.packbits((weight.detach() != 0).cpu().numpy().ravel())
    digest = hashlib.blake2b(bits.tobytes(), digest_size=16)
    digest.update(repr(tuple(weight.shape)).encode())
    return digest.hexdigest()


def layer_key(spec: ConvSpec, policy: str, weight: torch.Tensor, has_bias: bool, activation: str,
              has_residual: bool, candidates: List[Tuple[str, Optional[dict]]],
              run_mode: str = "graph") -> Dict[str, Any]:
    """What a layer's decision depends on, as a JSON-able dict.

    weight: the masked (K, C // groups, R, S) weight (only its non-zero pattern enters, hashed);
    candidates: the (backend, config dict) pairs offered, hashed; run_mode: "graph" (GPU time
    decided) or "eager" (eager wall time decided). Tuples become lists, as they read back from JSON.
    """
    return _as_json({
        "spec": {field: getattr(spec, field) for field in _SPEC_FIELDS},
        "policy": policy,
        "pattern": pattern_hash(weight),
        "bias": has_bias,
        "activation": activation,
        "residual": has_residual,
        "candidates": _digest([list(candidate) for candidate in candidates]),
        "run_mode": run_mode,
    })


@dataclasses.dataclass(frozen=True)
class CachedDecision:
    """A stored choice: backend and config dict, its median ms, the dense baseline's median ms, and the
    median ms of every candidate benchmarked (label -> ms)."""

    backend: str
    config: Optional[dict]
    time_ms: float
    dense_ms: float
    times_ms: Dict[str, float]

    @classmethod
    def from_json(cls, saved: Any) -> "CachedDecision":
        """Rebuild from its JSON form; ValueError when anything is missing or of the wrong type."""
        if not isinstance(saved, dict) or set(saved) != {field.name for field in dataclasses.fields(cls)}:
            raise ValueError(f"decision fields {sorted(saved) if isinstance(saved, dict) else saved!r}")
        ok = (isinstance(saved["backend"], str) and (saved["config"] is None or isinstance(saved["config"], dict))
              and all(isinstance(saved[f], (int, float)) for f in ("time_ms", "dense_ms"))
              and isinstance(saved["times_ms"], dict))
        if not ok:
            raise ValueError("decision fields of the wrong type")
        return cls(**saved)


class TuneCache:
    """Decisions for one environment, in `directory` (created on first write): one per layer
    (`lookup`, `store`) and one per model (`lookup_model`, `store_model`)."""

    def __init__(self, directory: Optional[str | os.PathLike], environment: Fingerprint):
        self.directory = default_cache_dir() if directory is None else Path(directory).expanduser()
        self.environment = dict(environment)
        self._environment_hash = _digest(self.environment, 8)

    def path(self, key: Dict[str, Any], kind: str = "layer") -> Path:
        prefix = "" if kind == "layer" else f"{kind}-"
        return self.directory / f"{prefix}{key_digest(key)}-{self._environment_hash}.json"

    def lookup(self, key: Dict[str, Any]) -> Tuple[Optional[CachedDecision], Optional[str]]:
        """(decision, None) on a hit; (None, None) when nothing was cached for this layer anywhere;
        (None, why) when an entry exists but cannot be used (corrupt, truncated, for another
        layer, or tuned only under another environment)."""
        return self._lookup(key, "layer", CachedDecision.from_json)

    def store(self, key: Dict[str, Any], decision: CachedDecision) -> Path:
        """Write the decision for `key` atomically; returns its path."""
        return self._store(key, "layer", dataclasses.asdict(decision))

    def lookup_model(self, key: Dict[str, Any], from_json: Callable[[Any], Any]) -> Tuple[Any, Optional[str]]:
        """`lookup` for a model's decisions (`model_decision.model_key`), rebuilt by `from_json`
        (ValueError when the saved form is wrong)."""
        return self._lookup(key, "model", from_json)

    def store_model(self, key: Dict[str, Any], decision: Dict[str, Any]) -> Path:
        """Write a model's decisions (a JSON-able dict) for `key` atomically; returns its path."""
        return self._store(key, "model", decision)

    def _lookup(self, key: Dict[str, Any], kind: str, from_json: Callable[[Any], Any]) -> Tuple[Any, Optional[str]]:
        path = self.path(key, kind)
        if not path.exists():
            return None, self._elsewhere(key, kind)
        try:
            entry = json.loads(path.read_text())
            if not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {entry.get('format') if isinstance(entry, dict) else entry!r}, "
                                 f"expected {FORMAT_VERSION}")
            decision = from_json(entry.get("decision"))
        except (OSError, UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is a ValueError
            return None, f"corrupt cache entry {path} ({type(error).__name__}: {error})"
        if entry.get("environment") != self.environment:
            difference = describe_difference(entry.get("environment") or {}, self.environment)
            return None, f"cache entry {path} was tuned in another environment ({difference})"
        if entry.get(kind) != key:
            return None, f"cache entry {path} belongs to another {kind} (hash collision or a copied file)"
        return decision, None

    def _elsewhere(self, key: Dict[str, Any], kind: str = "layer") -> Optional[str]:
        """Why a key with no entry here has entries for other environments, or None if it has none.
        Our own entry may appear meanwhile (another process just tuned the layer): not "elsewhere"."""
        for other in sorted(self.directory.glob(self.path(key, kind).name.rsplit("-", 1)[0] + "-*.json")):
            try:
                environment = json.loads(other.read_text()).get("environment")
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                continue
            if isinstance(environment, dict) and environment != self.environment:
                return f"cached only for another environment ({describe_difference(environment, self.environment)})"
        return None

    def _store(self, key: Dict[str, Any], kind: str, decision: Dict[str, Any]) -> Path:
        path = self.path(key, kind)
        self.directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": FORMAT_VERSION, kind: key, "environment": self.environment,
                           "decision": decision}, indent=1, sort_keys=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(handle, "w") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return path
