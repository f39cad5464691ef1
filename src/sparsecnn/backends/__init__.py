"""Backend registry and the registered backends (importing this registers them)."""
from . import baselines  # noqa: F401  (registers dense, im2col-cublas, im2col-cusparse)
from . import direct  # noqa: F401  (registers direct; imports triton only on first use)
from .registry import Backend, backend_names, config_to_dict, get_backend, register_backend

__all__ = ["Backend", "backend_names", "config_to_dict", "get_backend", "register_backend"]
