"""Triton kernels. Importing this package imports triton (no CUDA initialisation); set
TRITON_INTERPRET=1 *before* the first import to run the kernels on CPU tensors."""
from .direct_conv import DirectConfig, candidate_configs, direct_conv2d

__all__ = ["DirectConfig", "candidate_configs", "direct_conv2d"]
