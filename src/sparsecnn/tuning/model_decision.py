"""A tuned model's whole-model decisions, cached beside its layers' so that a reload times nothing.

After its layers are tuned, `autotune_model` times whole models: each `SplitKLinear`'s split, the
output layouts (`layout`), the model against dense with layers switched in context and against the
model as given (`model_check`). Those timings take seconds (2.6 s for ResNet-50's check on an H200),
longer than a reload may. They depend on the layers' decisions, so when every layer's decision came
from the cache, the model's decisions recorded with them hold again: `model_key` names every layer's
cache key, the model's structure and inputs, the model as given and the check's rules, and `apply`
puts a recorded `ModelDecision` back without timing anything. `retune` or any layer tuned anew
times the model again and records the result.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import fx, nn

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes.shortcut import fold_shortcut
from sparsecnn.tuning.cache import TuneCache, key_digest
from sparsecnn.tuning.layout import set_batch_inner_outputs, set_channels_last_outputs
from sparsecnn.tuning.model_check import MAX_SWITCHES, MIN_GAIN
from sparsecnn.tuning.report import LayerResult, ModelCheck

# Part of every model key: a change to what the record holds or how it is applied makes old records miss.
RECORD_VERSION = 4


@dataclasses.dataclass(frozen=True)
class ModelDecision:
    """What the whole-model phases decided: `check` (a `ModelCheck` as a dict), the tuned layers
    they left on another backend or config than their tuned choice (`backends`: path -> [backend,
    config as a dict]: the check's dense backend, or the config a shortcut fold runs), each timed
    `SplitKLinear`'s result (`linears`: path -> {"splits", "ms", "dense_ms"}), the layers writing
    batch-innermost outputs (`batch_inner`) and the two whole-model times that decided it
    (`layout_ms`)."""

    check: Dict[str, Any]
    backends: Dict[str, List[Any]]
    linears: Dict[str, Dict[str, Any]]
    batch_inner: List[str]
    layout_ms: Dict[str, float]

    @classmethod
    def from_json(cls, saved: Any) -> "ModelDecision":
        """Rebuild from its JSON form; ValueError when anything is missing or of the wrong type."""
        if not isinstance(saved, dict) or set(saved) != {field.name for field in dataclasses.fields(cls)}:
            raise ValueError(f"model decision fields {sorted(saved) if isinstance(saved, dict) else saved!r}")
        check_fields = {field.name for field in dataclasses.fields(ModelCheck)} - {"cached"}
        ok = (isinstance(saved["check"], dict) and set(saved["check"]) == check_fields
              and saved["check"]["kept"] in ("tuned", "dense", "given")
              and isinstance(saved["batch_inner"], list)
              and all(isinstance(saved[name], dict) for name in ("backends", "linears", "layout_ms"))
              and all(isinstance(choice, list) and len(choice) == 2 and isinstance(choice[0], str)
                      and (choice[1] is None or isinstance(choice[1], dict)) for choice in saved["backends"].values())
              and all(isinstance(linear, dict) and isinstance(linear.get("splits"), int)
                      for linear in saved["linears"].values())
              and all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(name, str) for name in pair)
                      for pair in saved["check"]["shortcuts"])
              and isinstance(saved["check"]["channels_last_outputs"], list)
              and all(isinstance(name, str) for name in saved["check"]["channels_last_outputs"]))
        if not ok:
            raise ValueError("model decision fields of the wrong type")
        return cls(**saved)


def _structure(model: nn.Module, tuned: Dict[str, SparseConv2d]) -> str:
    """A digest of what the model computes around its tuned layers: its fx code when it has a graph,
    and each other module's path, type and settings (`extra_repr`); parameter values do not enter."""
    parts: List[Any] = [model.code if isinstance(model, fx.GraphModule) else type(model).__qualname__]
    parts += [[name, type(module).__qualname__, module.extra_repr()] for name, module in model.named_modules()
              if name not in tuned and not isinstance(module, SplitKLinear)]
    parts += [[name, module.in_features, module.out_features, str(module.weight.dtype)]
              for name, module in model.named_modules() if isinstance(module, SplitKLinear)]
    return key_digest({"structure": parts})


def _inputs(inputs: tuple) -> List[Any]:
    return [[list(x.shape), str(x.dtype), x.device.type] if isinstance(x, torch.Tensor) else repr(x)
            for x in inputs]


def model_key(results: List[LayerResult], model: nn.Module, tuned: Dict[str, SparseConv2d], inputs: tuple,
              given: List[Any], dense_backend: str, run_mode: str) -> Dict[str, Any]:
    """What a tuned model's whole-model decisions depend on, as a JSON-able dict: each tuned layer's
    path and cache key digest in call order (`LayerResult.key`), the model's structure around them,
    the inputs' shapes and dtypes, `given` (a JSON-able description of the model as given: see
    `whole_model.GivenModel.describe`), the check's dense backend and rules, and the run mode."""
    return json.loads(json.dumps({
        "record": RECORD_VERSION,
        "layers": [[result.name, result.key] for result in results],
        "structure": _structure(model, tuned),
        "inputs": _inputs(inputs),
        "given": key_digest({"given": given}),
        "check": {"dense_backend": dense_backend, "max_switches": MAX_SWITCHES, "min_gain": MIN_GAIN},
        "run_mode": run_mode,
    }))


def reusable(results: List[LayerResult], retune: bool) -> bool:
    """Whether a recorded model decision may stand for this tuning: every layer's decision came
    from the cache (a layer tuned anew may choose differently, so the model is timed again)."""
    return not retune and bool(results) and all(result.cache == "hit" and result.key for result in results)


def lookup(cache: TuneCache, key: Dict[str, Any]) -> Optional[ModelDecision]:
    """The recorded decision for `key`, or None (nothing recorded, or an entry that cannot be used:
    the model is then timed and the entry rewritten)."""
    decision, _ = cache.lookup_model(key, ModelDecision.from_json)
    return decision


def record(cache: TuneCache, key: Dict[str, Any], check: ModelCheck, tuned: Dict[str, SparseConv2d],
           results: Dict[str, LayerResult], linears: Dict[str, Dict[str, Any]], batch_inner: List[str],
           layout_ms: Dict[str, float]) -> ModelDecision:
    """Store what the whole-model phases left: `check`, the layers now on another backend or config
    than tuned, and the linears' and layouts' choices. Returns the stored decision."""
    backends = {name: [layer.backend, config_to_dict(layer.config)] for name, layer in tuned.items()
                if (layer.backend, layer.config) != (results[name].backend, results[name].config)}
    saved = {field.name: getattr(check, field.name) for field in dataclasses.fields(check) if field.name != "cached"}
    decision = ModelDecision(json.loads(json.dumps(saved)), json.loads(json.dumps(backends)),
                             json.loads(json.dumps(linears)), list(batch_inner), dict(layout_ms))
    cache.store_model(key, dataclasses.asdict(decision))
    return decision


def apply(decision: ModelDecision, model: nn.Module, tuned: Dict[str, SparseConv2d],
          restore_given: Callable[[], None]) -> ModelCheck:
    """Put `decision` back on `model`, whose `tuned` layers run their (cached) tuned choices: the
    linears' splits, the output layouts, the layers' final backends, or the whole model as given
    (`restore_given()`), the folded shortcuts and the outputs handed on in channels_last. Returns the
    recorded check, marked `cached`."""
    check = ModelCheck(**decision.check, cached=True)
    for name, module in model.named_modules():
        if isinstance(module, SplitKLinear) and name in decision.linears:
            module.splits = decision.linears[name]["splits"]
    set_batch_inner_outputs(tuned, [name for name in decision.batch_inner if name in tuned])
    for name, (backend, config) in decision.backends.items():
        tuned[name].set_backend(backend, None if config is None else get_backend(backend).config_from_dict(config))
    if check.kept == "given":
        restore_given()
    for name, shortcut_name in check.shortcuts:
        fold_shortcut(model, name, shortcut_name)
    set_channels_last_outputs(tuned, check.channels_last_outputs)
    return check
