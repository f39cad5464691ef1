"""Backend registry and the registered backends (importing this registers them)."""
from . import baselines  # noqa: F401  (registers dense, im2col-cublas, im2col-cusparse)
from . import codegen  # noqa: F401  (registers codegen; loads cuda-python/CuPy only to launch)
from . import direct  # noqa: F401  (registers direct; imports triton only on first use)
from . import blocks  # noqa: F401  (registers blocks; imports triton only on first use)
from . import staged  # noqa: F401  (registers staged; imports triton and loads CUDA code only on first use)
from . import unrolled  # noqa: F401  (registers unrolled; imports triton and loads CUDA code only on first use)
from .registry import Backend, backend_names, config_to_dict, get_backend, register_backend

__all__ = ["Backend", "backend_names", "config_to_dict", "get_backend", "register_backend"]
