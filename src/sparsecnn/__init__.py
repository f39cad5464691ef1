"""sparsecnn: fast inference for pruned (unstructured-sparse) CNNs on NVIDIA GPUs.

Importing this package never initialises CUDA.
"""
from .layers import ConvSpec, get_suite
from .nn import SparseConv2d, sparsify_

__version__ = "0.1.0"
__all__ = ["ConvSpec", "SparseConv2d", "compile_model", "get_suite", "load", "sparsify_", "__version__"]
_ARTIFACT_NAMES = ("compile_model", "load")


def __getattr__(name: str):
    """`compile_model` and `load` (sparsecnn.artifact), imported on first use."""
    if name in _ARTIFACT_NAMES:
        from . import artifact

        return getattr(artifact, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
