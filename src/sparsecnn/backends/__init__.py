"""The registered backends, one folder each (importing this package registers them all).

Each `backends/<name>/` holds its weight format, kernel source or generator, launcher, configs,
`torch.library` op (`op.py`) and `Backend` registration (`backend.py`). Adding a backend: one
folder, one line below, one test file under tests/backends/.
"""
from sparsecnn.backends.dense import backend as _dense  # noqa: F401  (dense, dense-tf32, dense-channels-last, dense-fused)
from sparsecnn.backends.im2col import backend as _im2col  # noqa: F401  (im2col-cublas, im2col-cusparse)
from sparsecnn.backends.codegen import backend as _codegen  # noqa: F401  (loads cuda-python/CuPy only to launch)
from sparsecnn.backends.direct import backend as _direct  # noqa: F401  (imports triton only on first use)
from sparsecnn.backends.blocks import backend as _blocks  # noqa: F401  (imports triton only on first use)
from sparsecnn.backends.staged import backend as _staged  # noqa: F401  (triton and CUDA code only on first use)
from sparsecnn.backends.unrolled import backend as _unrolled  # noqa: F401  (triton and CUDA code only on first use)
from sparsecnn.backends.tensorcore import backend as _tensorcore  # noqa: F401  (imports triton only on first use)
from sparsecnn.core.registry import Backend, backend_names, config_to_dict, get_backend, register_backend

__all__ = ["Backend", "backend_names", "config_to_dict", "get_backend", "register_backend"]
