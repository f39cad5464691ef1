"""Launching a Triton kernel with less Python per call than `kernel[grid](...)`.

Why. An eager call of a sparsified model is CPU-bound: a tuned ResNet-50 takes more CPU time per
call to issue its GPU work than the GPU work takes, and Triton's `JITFunction.run` (binding and
specialising every argument, hashing the cache key, checking globals) is a large part of it.
Here the compiled kernel is found by a key computed from what Triton specialises on, then
launched through the compiled kernel's launcher (`CompiledKernel.run`).

What Triton 3.x specialises on: each tensor's dtype and 16-byte alignment; each int's width (i32 or
i64) and, unless the parameter is in `do_not_specialize`, whether it is 1 or a multiple of 16; the
constexprs and launch options. The key holds all of these, so a launch never reuses a kernel
compiled for another specialisation (the key may split more finely than Triton does, never less).
The first launch of each key, launches while a launch hook is set (profilers) and the interpreter
(TRITON_INTERPRET=1: no compiled kernels) take Triton's own path, as every launch does when the
environment sets SPARSECNN_FAST_LAUNCH=0 (`settings.fast_launch`, checked at every launch).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from triton import knobs

import sparsecnn.settings as settings

_COMPILED: Dict[Tuple, Tuple[Any, Tuple]] = {}
_current_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None
_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _specialisation(kernel, args: Sequence[Any]) -> Tuple:
    """Per runtime argument, what Triton's compiled kernel depends on."""
    key = []
    for param, arg in zip(kernel.params, args):
        if type(arg) is int:
            wide = not _INT32_MIN <= arg <= _INT32_MAX
            key.append(wide if param.do_not_specialize else (wide, arg == 1, arg % 16 == 0))
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, param.do_not_specialize_on_alignment or arg.data_ptr() % 16 == 0))
        else:
            key.append((type(arg), arg))
    return tuple(key)


def _hooked() -> bool:
    """Whether a launch hook is set: Triton 3.6 holds them in a `HookChain` (empty: none), older
    versions in a callable or None."""
    hooks = knobs.runtime.launch_enter_hook
    return hooks is not None and bool(getattr(hooks, "calls", True))


def _constexpr_values(kernel, args: Sequence[Any], meta: Dict[str, Any]) -> Optional[Tuple]:
    """The values of the parameters after `args`, all constexprs named in `meta`, in declaration
    order (the compiled launcher takes every parameter); None when they are not."""
    rest = kernel.params[len(args):]
    if not all(param.is_constexpr and param.name in meta for param in rest):
        return None
    return tuple(meta[param.name] for param in rest)


def launch(kernel, grid: Tuple[int, ...], args: Sequence[Any], **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`: args are the kernel's leading runtime parameters in order
    (tensors, ints), meta its constexprs by name and the launch options (num_warps, num_stages)."""
    if _current_stream is None or not settings.fast_launch() or not hasattr(kernel, "params"):  # off, no CUDA, or interpreted
        kernel[grid](*args, **meta)
        return
    key = (kernel, tuple(meta.items()), _specialisation(kernel, args))
    cached = _COMPILED.get(key)
    if cached is None or _hooked():
        compiled = kernel[grid](*args, **meta)
        constexprs = _constexpr_values(kernel, args, meta)
        if constexprs is not None and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = (compiled, constexprs)
        return
    compiled, constexprs = cached
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    stream = _current_stream(torch.cuda.current_device())
    # No launch metadata and no hooks: _hooked() said none is set (CompiledKernel[grid] would build
    # the metadata dict anyway).
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *constexprs)
