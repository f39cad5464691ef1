"""Backend `blocks`: OptPrune (paper 000, Sec. 4) in Triton: GEMM on dense blocks + sparse remainder.

prepare runs Algorithm 1 (`backends.blocks.format.extract_blocks`, t1 = B1 = B2 = 8 and the config's t2)
and packs the result for the kernel (`backends.blocks.kernel.BlocksWeight`); bind hands its
tensors to the op `sparsecnn::blocks_conv2d`, whose epilogue fuses bias, residual and ReLU.

Algorithm 1 runs ahead of tuning in worker processes and is cached by weight content and t2
(`block_extraction`). `backend="auto"` tries `blocks` only on layers whose blocks a re-pruning gave
(`_worth_timing`).

The kernel module imports triton, which decides at import whether kernels run compiled or in its
CPU interpreter (TRITON_INTERPRET=1); so it is imported on first use, never by `import sparsecnn`,
and nothing here touches CUDA. CPU (fp32) is offered only while TRITON_INTERPRET=1 is set.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from sparsecnn.backends.blocks import op
from sparsecnn.backends.blocks.extraction import extraction, has_provided_blocks, submit_extractions
from sparsecnn.core.registry import KernelCall
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_backend import (
    op_static_args,
    padded_hw,
    register_triton_backend,
)


def _kernels():
    from sparsecnn.backends.blocks import kernel as blocks_conv

    return blocks_conv


def _candidate_configs(weight: torch.Tensor, dtype: torch.dtype) -> List[Any]:
    """candidate_configs for a (K, C, R, S) weight: they depend on K only, so a 1x1-output spec of
    the weight's shape stands in for the layer."""
    k, c, r, s = weight.shape
    return _kernels().candidate_configs(ConvSpec(1, c, k, r, s, r, s), dtype)


# The t2 values `backend="auto"` tries (each costs one CPU run of Algorithm 1 per layer): most
# layers that blocks won in model runs used t2 = 4 or 8, and 8 is the tensor-core default; those
# won at 12 or 16 all ran exact fp32 on FMA units, no longer the default.
AUTO_T2 = (4, 8)


def _auto_configs(spec: ConvSpec, dtype: torch.dtype) -> List[Any]:
    """Those of AUTO_T2; in fp32 only the "tf32" ones (offered under the tf32 policy alone): under the
    fp32 policy blocks was never chosen for a layer of the fp32 models tuned, while its extractions,
    binds and compiles took a sizeable share of a ResNet-50's tuning. Asked for by name (`backends=[..., "blocks"]`),
    it is tried with all its configs."""
    precision = "tf32" if dtype == torch.float32 else None
    return [config for config in _kernels().candidate_configs(spec, dtype, precision) if config.t2 in AUTO_T2]


def _worth_timing(weight: torch.Tensor, configs: List[Any]) -> List[Any]:
    """`configs` where a re-pruning gave this (K, C, R, S) weight's blocks (`provide_blocks`), else none.
    On Algorithm 1's own blocks of unstructured masks `blocks` won no layer of the models tuned in
    fp16 and at most one per model in fp32, while its extractions, binds and Triton compiles took
    about a third of a cold ResNet-50 tuning. Named in `backends=[...]`, it is tried on every layer."""
    return configs if has_provided_blocks(weight) else []


def _prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
              configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Submit the extractions of every t2 of `configs` (None: those `backend="auto"` tries) for
    `weight` at `dtype` (they depend on nothing else)."""
    if configs is None:
        configs = _auto_configs(spec, dtype)
    submit_extractions(weight.to(dtype), [config.t2 for config in configs])


def _prepare(weight: torch.Tensor, config: Any):
    """Dense (K, C, R, S) weight -> `BlocksWeight` on the weight's device, packed for `config`
    (None: the default for this weight's dtype, candidate_configs' first)."""
    kernels = _kernels()
    if config is None:
        config = _candidate_configs(weight, weight.dtype)[0]
    return kernels.BlocksWeight.from_decomposition(extraction(weight, config.t2), config, weight.device)


def _bind(packed, spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    """The op `sparsecnn::blocks_conv2d` on the packed weight's tensors for spec's padded input size
    (config None: the one the weight was packed for)."""
    kernels = _kernels()
    config = packed.config if config is None else config
    if config.packing != packed.packing:
        raise ValueError(f"config (t2, block_m, block_kred) = {config.packing} differs from the weight's packing "
                         f"{packed.packing}; prepare the weight for this config")
    return KernelCall(torch.ops.sparsecnn.blocks_conv2d.default,
                      kernels.weight_arrays(packed, *padded_hw(spec), dtype), op_static_args(packed, spec, config),
                      eager=op.blocks_conv2d_eager)


BLOCKS = register_triton_backend(
    "blocks",
    "OptPrune: dense blocks found by hypergraph partitioning, run as GEMM (tensor cores), plus a row-wise sparse "
    "remainder, one Triton launch",
    _kernels, "BlocksConfig", _prepare, _bind, _prefetch, _auto_configs, _worth_timing)
