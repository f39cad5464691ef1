"""sparsecnn: fast inference for pruned (unstructured-sparse) CNNs on NVIDIA GPUs.

Importing this package never initialises CUDA.
"""
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite
from sparsecnn.nn import SparseConv2d
from sparsecnn.passes import prepare_for_inference
from sparsecnn.tuning import CompileConfig, autotune_model, compile, sparsify_

__version__ = "0.1.0"
__all__ = ["CompileConfig", "ConvSpec", "SparseConv2d", "autotune_model", "compile", "compile_model", "get_suite", "load",
           "prepare_for_inference", "sparsify_", "__version__"]
_ARTIFACT_NAMES = ("compile_model", "load")


def __getattr__(name: str):
    """`compile_model` and `load` (sparsecnn.artifact), imported on first use."""
    if name in _ARTIFACT_NAMES:
        from sparsecnn import artifact

        return getattr(artifact, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
