"""Backend registry and the registered backends (importing this registers them)."""
from . import baselines  # noqa: F401  (registers dense, im2col-cublas, im2col-cusparse)
from .registry import Backend, backend_names, config_to_dict, get_backend, register_backend

__all__ = ["Backend", "backend_names", "config_to_dict", "get_backend", "register_backend"]
