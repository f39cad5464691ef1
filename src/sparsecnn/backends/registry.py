"""The backend registry: each backend declares what it supports and how to run.

A backend sees only 2-D convolutions (Conv1d arrives as H = R = 1) and a weight that follows the
pruning contract: dense (K, C // groups, R, S) with zeros at pruned positions.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..layers import ConvSpec

# prepare(weight, config) -> packed weight in the backend's format
PrepareFn = Callable[[torch.Tensor, Any], Any]
# run(x (N, C, H, W), packed, bias (K,) or None, spec, config) -> (N, K, P, Q)
RunFn = Callable[[torch.Tensor, Any, Optional[torch.Tensor], ConvSpec, Any], torch.Tensor]


def _supports_everything(spec: ConvSpec) -> Optional[str]:
    return None


def _no_configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    return [None]


@dataclasses.dataclass(frozen=True)
class Backend:
    """A way to run a sparse convolution.

    dtypes: per device type ("cpu", "cuda"), the input dtypes it runs.
    spec_check(spec) -> None when the layer is supported, else the reason it is not.
    configs(spec, dtype) -> the candidate configs the autotuner may try (each valid by construction);
    the first is the default for untuned use. `config_from_dict` rebuilds one from its saved form.
    autotune_devices: device types where `backend="auto"` may pick it unasked (None: wherever it
    runs); e.g. a Triton backend runs on CPU only in the interpreter, for tests.
    """

    name: str
    description: str
    dtypes: Mapping[str, Tuple[torch.dtype, ...]]
    prepare: PrepareFn
    run: RunFn
    spec_check: Callable[[ConvSpec], Optional[str]] = _supports_everything
    configs: Callable[[ConvSpec, torch.dtype], List[Any]] = _no_configs
    config_from_dict: Callable[[dict], Any] = lambda saved: None
    autotune_devices: Optional[Tuple[str, ...]] = None

    def unsupported_reason(self, spec: ConvSpec, dtype: torch.dtype, device_type: str) -> Optional[str]:
        """None when this backend can run `spec` at `dtype` on `device_type`, else why not."""
        if device_type not in self.dtypes:
            return f"{self.name} does not run on {device_type}"
        if dtype not in self.dtypes[device_type]:
            return f"{self.name} does not support {dtype} on {device_type}"
        return self.spec_check(spec)

    def default_config(self, spec: ConvSpec, dtype: torch.dtype) -> Any:
        return self.configs(spec, dtype)[0]


_REGISTRY: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def backend_names() -> List[str]:
    return list(_REGISTRY)


def config_to_dict(config: Any) -> Optional[dict]:
    """JSON-able form of a config (configs are frozen dataclasses or None)."""
    return None if config is None else dataclasses.asdict(config)
