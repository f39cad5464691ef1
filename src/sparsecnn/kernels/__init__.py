"""Compute kernels: the fp64-capable reference, Triton kernels (`triton/`), generated CUDA (`codegen/`)."""
