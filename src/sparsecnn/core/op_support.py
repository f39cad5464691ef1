"""What every `torch.library` op of the package shares (namespace `sparsecnn`; one op per backend,
in `backends/<name>/op.py`).

Each op is a `torch.library.custom_op` with a fake implementation, so `torch.compile` traces a
layer as one graph node (inductor calls it as an extern kernel) and CUDA-graph capture records
its launches. Ops take only tensors, ints, bools and strings: a packed weight travels as its
tensors (each backend's `bind` lists them), a kernel config as the JSON of its dataclass
(`config_json`). Every op returns a new (N, K, P, Q) tensor of x's dtype, contiguous unless its
docstring says otherwise.

Each op's `*_eager` twin is the same computation as a plain function: eager runs call it directly
(`core.registry.KernelCall`), skipping the dispatcher and the custom op's autograd and dynamo
wrappers. The first dispatch of any custom op also imports torch._dynamo, which is slow on a cold
machine, so tuning avoids it.

A compiled kernel is not a tensor, so it lives in a process-local registry: `register_codegen`
returns an int handle and the op looks it up (`codegen_kernel`). A handle is valid only in the
process that registered it, while its compiled object is alive (the registry holds it weakly; the
backend's packed weight keeps it).

padded_hw: the (H + 2 pad_h, W + 2 pad_w) the offsets were expanded for; an input of another size is
refused (its gathers would read the wrong elements).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from sparsecnn.core.checks import check_residual


def config_json(config: Any) -> str:
    """A kernel config dataclass as the JSON string the ops take (keys sorted: one text per config)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _output_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1):
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def output_shape(x: torch.Tensor, kernel_shape: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int] = (1, 1)):
    """(N, K, P, Q) of a conv of x (N, C, H, W) with a (K, C, R, S) kernel."""
    k, _, r, s = kernel_shape
    return (x.shape[0], k, _output_size(x.shape[2], r, stride[0], padding[0], dilation[0]),
            _output_size(x.shape[3], s, stride[1], padding[1], dilation[1]))


def check_padded_hw(x: torch.Tensor, padded_hw: Sequence[int], padding: Sequence[int]) -> None:
    expected = [x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1]]
    if list(padded_hw) != expected:
        raise ValueError(f"the weight's offsets are for a padded {tuple(padded_hw)} input, x padded is "
                         f"{tuple(expected)}: bind the weight for this input size")


def fake_output(x: torch.Tensor, residual: Optional[torch.Tensor], kernel_shape, stride, padding,
                 dilation=(1, 1)) -> torch.Tensor:
    shape = output_shape(x, kernel_shape, stride, padding, dilation)
    check_residual(residual, shape, x)
    return x.new_empty(shape)


_CODEGEN_LOCK = threading.Lock()
_CODEGEN_BY_HANDLE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_CODEGEN_HANDLES: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_NEXT_HANDLE = itertools.count(1)


def generated_machine_check(*tools: str) -> Callable[[], Optional[str]]:
    """A `Backend.machine_check` for a backend whose kernels are compiled with `tools` ("nvcc",
    "ptxas") and launched through a cubin loader: None when the machine has them, else why not."""
    def check() -> Optional[str]:
        from sparsecnn.core import cubin_loader, toolchain

        return toolchain.missing_tools(*tools) or cubin_loader.missing_loader()

    return check


def register_codegen(compiled) -> int:
    """The handle of a compiled kernel, a `backends.codegen.generator.CompiledConv` or
    `backends.unrolled.kernel.CompiledUnrolled` (the same handle for the same object).

    The registry holds it weakly: keep `compiled` alive as long as the handle is used.
    """
    with _CODEGEN_LOCK:
        if compiled not in _CODEGEN_HANDLES:
            handle = next(_NEXT_HANDLE)
            _CODEGEN_HANDLES[compiled] = handle
            _CODEGEN_BY_HANDLE[handle] = compiled
        return _CODEGEN_HANDLES[compiled]


def codegen_kernel(handle: int):
    """The `CompiledConv` registered under `handle` (ValueError if unknown or freed)."""
    compiled = _CODEGEN_BY_HANDLE.get(handle)
    if compiled is None:
        raise ValueError(f"no codegen kernel is registered under handle {handle} in this process "
                         "(handles are process-local; bind the layer again)")
    return compiled
