"""The direct kernels tuning will launch for a layer, compiled ahead in worker processes
(`core.triton_ahead`): `prefetch` submits them, `bind` settles them (never waits).

Which launches: each "chunk" and "batch" config offered (the others are not in `auto`), on the
input tuning times them on (NCHW, padded by the launcher), with each epilogue the layer may be tuned
with (`epilogues`); for a padded layer also "batch" on a batch-innermost input (the masked path,
what the layouts phase times after a "batch" layer), with an output in either layout.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_ahead import AheadCompiles, Launch, compile_target, epilogues

_COMPILES = AheadCompiles("direct compile")
_CHUNK = "sparsecnn.backends.direct.kernel:_direct_chunk_kernel"
_BATCH = "sparsecnn.backends.direct.kernel_batch:_direct_batch_kernel"
_INDEX = torch.int32


def ahead_launches(spec: ConvSpec, dtype: torch.dtype, has_bias: bool, config: Any, relu_only: bool) -> List[Launch]:
    """The launches of `config` for a layer of `spec` at `dtype`, tensors as dtypes, built by
    `kernel.chunk_launch` / `kernel_batch.batch_launch` as the launcher builds them."""
    from sparsecnn.backends.direct.kernel import chunk_launch, for_batch
    from sparsecnn.backends.direct.kernel_batch import batch_launch

    operands = (dtype, torch.float32, _INDEX, _INDEX, dtype, dtype, dtype)
    (ph, pw), (hp, wp) = spec.padding, (spec.H + 2 * spec.padding[0], spec.W + 2 * spec.padding[1])
    out_shape = (spec.N, spec.K, spec.P, spec.Q)
    nchw = (spec.K * spec.P * spec.Q, spec.P * spec.Q, spec.Q, 1)
    batch_inner = (1, spec.P * spec.Q * spec.N, spec.Q * spec.N, spec.N)
    config = for_batch(config, spec.N)
    launches = []
    for relu, residual in epilogues(relu_only):
        if config.variant == "chunk":
            _, args, meta = chunk_launch(operands, (spec.N, spec.C, hp, wp), spec, config, has_bias, residual, relu)
            launches.append((_CHUNK, args, meta))
        elif config.variant == "batch":
            tile = (config.block_pix, config.sub_batch, config.chunk, config.num_warps)
            inputs = [((spec.C, hp, wp, spec.N), (0, 0), nchw)]
            if (ph, pw) != (0, 0) and spec.R <= 8 and spec.S <= 8:  # masked: what a batch-inner input gets
                inputs += [((spec.C, spec.H, spec.W, spec.N), (ph, pw), strides) for strides in (nchw, batch_inner)]
            for input_shape, padding, out_strides in inputs:
                _, args, meta = batch_launch(operands, input_shape, out_shape, out_strides, spec.stride, padding,
                                             has_bias, residual, relu, tile)
                launches.append((_BATCH, args, meta))
    return launches


def prefetch(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool,
             configs: Optional[List[Any]] = None, relu_only: bool = False) -> None:
    """Start compiling, in worker processes, the direct kernels tuning will launch for this layer
    (`configs`; None: `kernel.auto_configs`) for the GPU `weight` is on; nothing for a weight
    elsewhere (under Triton's CPU interpreter nothing compiles). Returns at once."""
    arch = compile_target(weight, spec)
    if arch is None:
        return
    from sparsecnn.backends.direct import kernel

    for config in kernel.auto_configs(spec, dtype) if configs is None else configs:
        _COMPILES.submit((spec, config, dtype, has_bias), ahead_launches(spec, dtype, has_bias, config, relu_only), arch)


def settle(spec: ConvSpec, config: Any, dtype: torch.dtype, has_bias: bool) -> None:
    """At bind: the layer's prefetched compiles of `config` taken if done, cancelled if not started."""
    _COMPILES.settle((spec, config, dtype, has_bias))
