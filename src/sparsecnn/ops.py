"""The package's torch.library bindings (namespace `sparsecnn`): one custom op per kernel.

Each op is a `torch.library.custom_op` with a fake implementation, so `torch.compile` traces a
layer as one graph node (inductor calls it as an extern kernel) and CUDA-graph capture records
its launches. Ops take only tensors, ints, bools and strings: a packed weight travels as its
tensors (each backend's `bind` lists them), a kernel config as the JSON of its dataclass
(`config_json`). Every op returns a new (N, K, P, Q) tensor of x's dtype, contiguous but where its
entry below says otherwise.

    direct_conv2d(x, values, offsets, row_ptr?, row_order?, codes?, bias?, residual?, kernel_shape,
                  padded_hw, stride, padding, config, relu)
        the direct kernel (kernels/triton/direct_conv.py) with its fused epilogue
        act(conv + bias + residual); the tensors of `direct_conv.weight_arrays` (codes: variant
        "batch" with padding reads a batch-innermost x unpadded with them).
    blocks_conv2d(x, rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets,
                  ell_values, bias?, residual?, kernel_shape, padded_hw, stride, padding, config, relu)
        the blocks kernel (kernels/triton/blocks_conv.py), same epilogue; `blocks_conv.weight_arrays`.
    staged_conv2d(x, entries, chunk_ptr, channel, bias?, residual?, kernel_shape, max_segment, stride,
                  padding, config, pool, relu)
        the staged-input kernel (kernels/codegen/staged.py: CUDA C compiled per geometry and config,
        fp32, N a multiple of 32), same epilogue; `staged.weight_arrays`. Its output is
        batch-innermost when the config's out_layout says so; pool 2: a 2x2 stride-2 max pool of
        act(conv + bias) in the epilogue, output (N, K, P // 2, Q // 2) (no residual).
    codegen_conv2d(x, bias?, handle)
        a compiled codegen kernel set (kernels/codegen: cubins launched through cuda-python),
        conv + bias only. A compiled kernel is not a tensor, so it lives in a process-local
        registry: `register_codegen(compiled)` returns an int handle and the op looks it up. A
        handle is valid only in the process that registered it, while its `CompiledConv` is alive
        (the registry holds it weakly; the backend's packed weight keeps it).
    unrolled_conv2d(x, bias?, residual?, handle, config, relu)
        a compiled unrolled kernel (kernels/codegen/unrolled.py: one layer's weights as FMA
        immediates, PTX through ptxas, fp32) registered like codegen's (`register_codegen`), with
        the fused epilogue; its output is batch-innermost when the config's out_layout says so.
    im2col_csr_conv2d(x, crow_indices, col_indices, values, bias?, kernel_shape, stride, padding,
                      dilation)
        the im2col + cuSPARSE baseline: torch.compile cannot trace sparse tensors, so the CSR
        weight travels as its three arrays and the op rebuilds it.
    cudnn_fused_conv2d(x, weight, bias?, residual?, stride, padding, dilation, groups, channels_last,
                       relu)
        dense cuDNN with the epilogue fused: with relu on CUDA, one cuDNN fusion graph (aten's
        cudnn_convolution_relu / cudnn_convolution_add_relu, which have no fake implementation of
        their own); its output is channels_last when `channels_last`, else contiguous.

Each op's `*_eager` twin is the same computation as a plain function: eager runs call it directly
(`backends.KernelCall`), skipping the dispatcher and the custom op's autograd and dynamo wrappers,
Python work that costs more than a small layer's kernel. The first dispatch of any custom op also
imports torch._dynamo (its implementation is wrapped in `torch._disable_dynamo`): 5-14 s on a cold
machine, which tuning used to pay through the codegen op.

padded_hw: the (H + 2 pad_h, W + 2 pad_w) the offsets were expanded for; an input of another
size is refused (its gathers would read the wrong elements). The dense and im2col + cuBLAS
baselines are aten compositions (backends/baselines.py) and need no op.

Importing this module registers the ops; it imports neither triton nor CUDA libraries (the
implementations import their kernels on first call).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import threading
import warnings
import weakref
from typing import Any, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.library import custom_op, register_fake

from .kernels.batch_inner import new_output
from .kernels.configs import check_residual

__all__ = ["blocks_conv2d", "blocks_conv2d_eager", "codegen_conv2d", "codegen_conv2d_eager", "codegen_kernel",
           "config_json", "direct_conv2d", "direct_conv2d_eager", "im2col_csr_conv2d", "im2col_csr_conv2d_eager",
           "cudnn_fused_conv2d", "cudnn_fused_conv2d_eager",
           "register_codegen", "staged_conv2d", "staged_conv2d_eager", "unrolled_conv2d", "unrolled_conv2d_eager"]


def config_json(config: Any) -> str:
    """A kernel config dataclass as the JSON string the ops take (keys sorted: one text per config)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _output_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1):
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _output_shape(x: torch.Tensor, kernel_shape: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int] = (1, 1)):
    """(N, K, P, Q) of a conv of x (N, C, H, W) with a (K, C, R, S) kernel."""
    k, _, r, s = kernel_shape
    return (x.shape[0], k, _output_size(x.shape[2], r, stride[0], padding[0], dilation[0]),
            _output_size(x.shape[3], s, stride[1], padding[1], dilation[1]))


def _check_padded_hw(x: torch.Tensor, padded_hw: Sequence[int], padding: Sequence[int]) -> None:
    expected = [x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1]]
    if list(padded_hw) != expected:
        raise ValueError(f"the weight's offsets are for a padded {tuple(padded_hw)} input, x padded is "
                         f"{tuple(expected)}: bind the weight for this input size")


def _fake_output(x: torch.Tensor, residual: Optional[torch.Tensor], kernel_shape, stride, padding,
                 dilation=(1, 1)) -> torch.Tensor:
    shape = _output_shape(x, kernel_shape, stride, padding, dilation)
    check_residual(residual, shape, x)
    return x.new_empty(shape)


# --- direct -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _direct_config(text: str):
    from .kernels.triton.direct_conv import DirectConfig

    return DirectConfig.from_dict(json.loads(text))


def direct_conv2d_eager(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                        row_ptr: Optional[torch.Tensor], row_order: Optional[torch.Tensor],
                        codes: Optional[torch.Tensor], bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                        kernel_shape: List[int], padded_hw: List[int], stride: List[int], padding: List[int],
                        config: str, relu: bool) -> torch.Tensor:
    """act(direct sparse conv(x) + bias + residual) -> (N, K, P, Q); see the module docstring."""
    from .kernels.triton.direct_conv import direct_conv2d_arrays

    _check_padded_hw(x, padded_hw, padding)
    return direct_conv2d_arrays(x, values, offsets, row_ptr, row_order, codes, tuple(kernel_shape), bias,
                                tuple(stride), tuple(padding), _direct_config(config), relu=relu, residual=residual)


direct_conv2d = custom_op("sparsecnn::direct_conv2d", direct_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::direct_conv2d")
def _direct_conv2d_fake(x, values, offsets, row_ptr, row_order, codes, bias, residual, kernel_shape, padded_hw,
                        stride, padding, config, relu):
    contiguous = _fake_output(x, residual, kernel_shape, stride, padding)
    return new_output(contiguous.shape, x, _direct_config(config).out_layout)


# --- blocks -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _blocks_config(text: str):
    from .kernels.triton.blocks_conv import BlocksConfig

    return BlocksConfig.from_dict(json.loads(text))


def blocks_conv2d_eager(x: torch.Tensor, rows: torch.Tensor, dense_start: torch.Tensor,
                        dense_offsets: torch.Tensor, dense_values: torch.Tensor, ell_start: torch.Tensor,
                        ell_offsets: torch.Tensor, ell_values: torch.Tensor, bias: Optional[torch.Tensor],
                        residual: Optional[torch.Tensor], kernel_shape: List[int], padded_hw: List[int],
                        stride: List[int], padding: List[int], config: str, relu: bool) -> torch.Tensor:
    """act(blocks sparse conv(x) + bias + residual) -> (N, K, P, Q); see the module docstring."""
    from .kernels.triton.blocks_conv import blocks_conv2d_arrays

    _check_padded_hw(x, padded_hw, padding)
    arrays = (rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets, ell_values)
    return blocks_conv2d_arrays(x, arrays, tuple(kernel_shape), bias, tuple(stride), tuple(padding),
                                _blocks_config(config), relu=relu, residual=residual)


blocks_conv2d = custom_op("sparsecnn::blocks_conv2d", blocks_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::blocks_conv2d")
def _blocks_conv2d_fake(x, rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets, ell_values, bias,
                        residual, kernel_shape, padded_hw, stride, padding, config, relu):
    return _fake_output(x, residual, kernel_shape, stride, padding)


# --- staged -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _staged_config(text: str):
    from .kernels.codegen.staged import StagedConfig

    return StagedConfig.from_dict(json.loads(text))


def staged_conv2d_eager(x: torch.Tensor, entries: torch.Tensor, chunk_ptr: torch.Tensor, channel: torch.Tensor,
                        bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], kernel_shape: List[int],
                        max_segment: int, stride: List[int], padding: List[int], config: str, pool: int,
                        relu: bool) -> torch.Tensor:
    """act(staged sparse conv(x) + bias + residual) -> (N, K, P, Q), pooled with pool 2; see the module
    docstring."""
    from .kernels.codegen.staged import staged_conv2d_arrays

    return staged_conv2d_arrays(x, entries, chunk_ptr, channel, tuple(kernel_shape), max_segment, bias, residual,
                                tuple(stride), tuple(padding), _staged_config(config), relu, pool=pool)


staged_conv2d = custom_op("sparsecnn::staged_conv2d", staged_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::staged_conv2d")
def _staged_conv2d_fake(x, entries, chunk_ptr, channel, bias, residual, kernel_shape, max_segment, stride, padding,
                        config, pool, relu):
    from .kernels.codegen.staged import pooled_shape

    contiguous = _fake_output(x, residual, kernel_shape, stride, padding)
    return new_output(pooled_shape(contiguous.shape, pool), x, _staged_config(config).out_layout)


# --- codegen ------------------------------------------------------------------------------------

_CODEGEN_LOCK = threading.Lock()
_CODEGEN_BY_HANDLE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_CODEGEN_HANDLES: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_NEXT_HANDLE = itertools.count(1)


def register_codegen(compiled) -> int:
    """The handle of a compiled kernel, a `kernels.codegen.CompiledConv` or `CompiledUnrolled` (the
    same handle for the same object).

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


def _codegen_output(x: torch.Tensor, handle: int):
    spec = codegen_kernel(handle).plan.spec
    if x.dim() != 4 or tuple(x.shape[1:]) != (spec.C, spec.H, spec.W):
        raise ValueError(f"codegen kernel {handle} is compiled for (N, {spec.C}, {spec.H}, {spec.W}) inputs, "
                         f"got {tuple(x.shape)}")
    return (x.shape[0], spec.K, spec.P, spec.Q)


def codegen_conv2d_eager(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """conv(x) + bias by the codegen kernels registered under `handle` -> (N, K, P, Q)."""
    _codegen_output(x, handle)
    return codegen_kernel(handle)(x, bias)


codegen_conv2d = custom_op("sparsecnn::codegen_conv2d", codegen_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::codegen_conv2d")
def _codegen_conv2d_fake(x, bias, handle):
    return x.new_empty(_codegen_output(x, handle))


# --- unrolled -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _unrolled_config(text: str):
    from .kernels.codegen.unrolled import UnrolledConfig

    return UnrolledConfig.from_dict(json.loads(text))


def _unrolled_kernel(x: torch.Tensor, handle: int):
    compiled = codegen_kernel(handle)
    if tuple(x.shape) != compiled.spec.input_shape:
        raise ValueError(f"unrolled kernel {handle} is compiled for {compiled.spec.input_shape} inputs, got "
                         f"{tuple(x.shape)}")
    return compiled


def unrolled_conv2d_eager(x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], handle: int,
                          config: str, relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + residual) by the unrolled kernel registered under `handle` -> (N, K, P, Q)."""
    from .kernels.codegen.unrolled import unrolled_conv2d as launch

    return launch(x, _unrolled_kernel(x, handle), bias, residual, relu, _unrolled_config(config))


unrolled_conv2d = custom_op("sparsecnn::unrolled_conv2d", unrolled_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::unrolled_conv2d")
def _unrolled_conv2d_fake(x, bias, residual, handle, config, relu):
    compiled = _unrolled_kernel(x, handle)
    check_residual(residual, compiled.spec.output_shape, x)
    return new_output(compiled.spec.output_shape, x, _unrolled_config(config).out_layout)


# --- im2col + CSR SpMM --------------------------------------------------------------------------

def im2col_csr_conv2d_eager(x: torch.Tensor, crow_indices: torch.Tensor, col_indices: torch.Tensor,
                            values: torch.Tensor, bias: Optional[torch.Tensor], kernel_shape: List[int],
                            stride: List[int], padding: List[int], dilation: List[int]) -> torch.Tensor:
    """conv(x) + bias as CSR (K x C*R*S, the three arrays of a torch sparse CSR tensor) times the
    unfolded input (torch.sparse.mm: cuSPARSE on CUDA) -> (N, K, P, Q). groups = 1."""
    k, c, r, s = kernel_shape
    if x.dim() != 4 or x.shape[1] != c:
        raise ValueError(f"x must be (N, {c}, H, W), got {tuple(x.shape)}")
    n, _, p, q = _output_shape(x, kernel_shape, stride, padding, dilation)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # torch's beta-state notice
        weight = torch.sparse_csr_tensor(crow_indices, col_indices, values, (k, c * r * s), check_invariants=False)
    cols = F.unfold(x, (r, s), tuple(dilation), tuple(padding), tuple(stride))  # (N, CRS, PQ)
    y = torch.sparse.mm(weight, cols.transpose(0, 1).reshape(c * r * s, n * p * q))
    y = y.reshape(k, n, p, q).transpose(0, 1)
    return (y if bias is None else y + bias.view(1, -1, 1, 1)).contiguous()


im2col_csr_conv2d = custom_op("sparsecnn::im2col_csr_conv2d", im2col_csr_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::im2col_csr_conv2d")
def _im2col_csr_conv2d_fake(x, crow_indices, col_indices, values, bias, kernel_shape, stride, padding, dilation):
    return _fake_output(x, None, kernel_shape, stride, padding, dilation)


# --- dense cuDNN, epilogue fused ------------------------------------------------------------------

def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def cudnn_fused_conv2d_eager(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             residual: Optional[torch.Tensor], stride: List[int], padding: List[int],
                             dilation: List[int], groups: int, channels_last: bool, relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + residual) -> (N, K, P, Q), channels_last (NHWC) iff `channels_last`.

    x (N, C, H, W) any layout (converted to the output's); weight (K, C // groups, R, S) in that
    layout; bias (K,) or None; residual None or of the output's shape, dtype and device. With relu
    on CUDA the conv, bias, residual add and ReLU are one cuDNN fusion graph, instead of a conv and
    up to three passes over its output; without relu (cuDNN fuses no epilogue without an
    activation) and on CPU, F.conv2d then the epilogue.
    """
    layout = _memory_format(channels_last)
    x = x.contiguous(memory_format=layout)
    check_residual(residual, _output_shape(x, weight.shape, stride, padding, dilation), x)
    if relu and x.is_cuda:
        if residual is None:
            y = torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
        else:
            y = torch.cudnn_convolution_add_relu(x, weight, residual.contiguous(memory_format=layout), 1.0, bias,
                                                 stride, padding, dilation, groups)
        return y.contiguous(memory_format=layout)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups).contiguous(memory_format=layout)
    if residual is not None:
        y = y.add_(residual)
    return y.relu_() if relu else y


cudnn_fused_conv2d = custom_op("sparsecnn::cudnn_fused_conv2d", cudnn_fused_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::cudnn_fused_conv2d")
def _cudnn_fused_conv2d_fake(x, weight, bias, residual, stride, padding, dilation, groups, channels_last, relu):
    return _fake_output(x, residual, weight.shape, stride, padding, dilation).contiguous(
        memory_format=_memory_format(channels_last))
