"""Backend `blocks`: OptPrune (paper 000, Sec. 4) in Triton: GEMM on dense blocks + sparse remainder.

prepare runs Algorithm 1 (`formats.blocks.extract_blocks`, t1 = B1 = B2 = 8 and the config's t2)
and packs the result for the kernel (`kernels.triton.blocks_conv.BlocksWeight`); bind hands its
tensors to the op `sparsecnn::blocks_conv2d`, whose epilogue fuses bias, residual and ReLU.
Extraction takes up to ~1 s per layer on one core and the autotuner prepares every candidate,
whose t2 values repeat, so extractions are cached by weight content and t2 (a few entries).

The kernel module imports triton, which decides at import whether kernels run compiled or in its
CPU interpreter (TRITON_INTERPRET=1); so it is imported on first use, never by `import sparsecnn`,
and nothing here touches CUDA. CPU (fp32) is offered only while TRITON_INTERPRET=1 is set.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Tuple

import torch

from ..formats.blocks import BlockDecomposition, BlockParams, extract_blocks
from ..layers import ConvSpec
from .registry import KernelCall
from .triton_common import op_static_args, padded_hw, register_triton_backend

_CACHE_SIZE = 8  # a layer's distinct t2 values (4) for two layers at a time


def _kernels():
    from ..kernels.triton import blocks_conv

    return blocks_conv


_EXTRACTIONS: "OrderedDict[Tuple[str, Tuple[int, ...], str, int], BlockDecomposition]" = OrderedDict()


def _extraction(weight: torch.Tensor, t2: int) -> BlockDecomposition:
    """Algorithm 1 on `weight` with the paper's t1 = B1 = B2 = 8 and this t2, cached by content."""
    data = weight.detach().cpu().contiguous()
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    key = (digest, tuple(data.shape), str(data.dtype), t2)
    if key in _EXTRACTIONS:
        _EXTRACTIONS.move_to_end(key)
        return _EXTRACTIONS[key]
    decomposition = extract_blocks(data, BlockParams(t2=t2))
    _EXTRACTIONS[key] = decomposition
    if len(_EXTRACTIONS) > _CACHE_SIZE:
        _EXTRACTIONS.popitem(last=False)
    return decomposition


def _prepare(weight: torch.Tensor, config: Any):
    """Dense (K, C, R, S) weight -> `BlocksWeight` on the weight's device, packed for `config`.

    config None: the default for this weight's dtype (candidate_configs' first; they depend on
    K only, so a 1x1-output spec of the weight's shape stands in for the layer).
    """
    kernels = _kernels()
    if config is None:
        k, c, r, s = weight.shape
        config = kernels.candidate_configs(ConvSpec(1, c, k, r, s, r, s), weight.dtype)[0]
    return kernels.BlocksWeight.from_decomposition(_extraction(weight, config.t2), config, weight.device)


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The op `sparsecnn::blocks_conv2d` on the packed weight's tensors for spec's padded input size
    (config None: the one the weight was packed for)."""
    kernels = _kernels()
    config = packed.config if config is None else config
    if config.packing != packed.packing:
        raise ValueError(f"config (t2, block_m, block_kred) = {config.packing} differs from the weight's packing "
                         f"{packed.packing}; prepare the weight for this config")
    return KernelCall(torch.ops.sparsecnn.blocks_conv2d.default,
                      kernels.weight_arrays(packed, *padded_hw(spec), dtype), op_static_args(packed, spec, config))


BLOCKS = register_triton_backend(
    "blocks",
    "OptPrune: dense blocks found by hypergraph partitioning, run as GEMM (tensor cores), plus a row-wise sparse "
    "remainder, one Triton launch",
    _kernels, "BlocksConfig", _prepare, _bind)
