"""Bound weight tensors marked as static for torch.compile's CUDA graphs."""
from __future__ import annotations

import sys

STATIC_INPUT_TYPE = "unguarded"  # what torch._dynamo.mark_static_address(t) sets as t._dynamo_static_input_type


def mark_static(tensors) -> None:
    """Tell torch.compile's CUDA graphs that the bound weight tensors keep their addresses (they
    would be copied into the graph's own buffers on every replay otherwise).

    Sets what `torch._dynamo.mark_static_address(t)` sets when dynamo is not imported yet:
    importing it is slow, most of the cost of loading an artefact (a test checks the two agree)."""
    dynamo = sys.modules.get("torch._dynamo")
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            if dynamo is not None:
                dynamo.mark_static_address(tensor)
            else:
                tensor._dynamo_static_input_type = STATIC_INPUT_TYPE
