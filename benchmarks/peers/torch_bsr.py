"""Peer "torch-bsr": PyTorch's block-sparse (BSR) matmul, `torch.sparse._triton_ops.bsr_dense_mm`
(PyTorch's own Triton kernel, untuned defaults), as a convolution: issue 45's tensor-core peer.

The weight is flattened as K x (R*S*C), reduction ordered (r, s, c), so that a unit of backend
`tensorcore` (a run of input channels at one tap) is a run of columns; its rows are ordered by the
units they keep (`backends.tensorcore.format.support_order`), the same grouping our backend gets.
The block size is the (rows, columns) among BLOCKS that stores the fewest block elements (the
tightest fit to the mask; ties to the larger block).
* "torch-bsr": im2col of the NHWC input in (r, s, c) order (one strided copy), the BSR matmul, the
  rows put back in channel order, as an (N, K, P, Q) output.
* "torch-bsr-mm": the matmul alone on columns prepared ahead (output left as a view).
fp16/bf16 only (its kernel's dtypes); N*P*Q padded to a multiple of 64 (its tiling needs it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsecnn.backends.tensorcore.format import support_order
from sparsecnn.bench.peers import Peer, common_unsupported_reason
from sparsecnn.core.spec import ConvSpec

VARIANTS = ("torch-bsr", "torch-bsr-mm")
DTYPES = ("fp16", "bf16")
BLOCKS = ((64, 64), (64, 32), (32, 32), (64, 16), (32, 16), (16, 16))
_PAD = 64


def weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(K, R*S*C): the (K, C, R, S) weight with its reduction ordered (r, s, c)."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)


def best_blocksize(matrix: torch.Tensor) -> tuple:
    """The block of BLOCKS (dividing the matrix) storing the fewest elements; ties to the larger block."""
    best = None
    for rows, cols in BLOCKS:
        if matrix.shape[0] % rows or matrix.shape[1] % cols:
            continue
        blocks = matrix.ne(0).reshape(matrix.shape[0] // rows, rows, -1, cols).any(dim=(1, 3))
        stored = int(blocks.sum()) * rows * cols
        if best is None or stored < best[0]:
            best = (stored, (rows, cols))
    return None if best is None else best[1]


def im2col_rsc(x: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """(R*S*C, N*P*Q padded to _PAD) columns of x (N, C, H, W), reduction ordered (r, s, c)."""
    n = x.shape[0]
    (ph, pw), (sh, sw) = spec.padding, spec.stride
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph)).contiguous()
    hp, wp, c = xp.shape[1:]
    view = xp.as_strided((spec.R, spec.S, c, n, spec.P, spec.Q), (wp * c, c, 1, hp * wp * c, sh * wp * c, sw * c))
    columns = view.reshape(spec.R * spec.S * c, n * spec.P * spec.Q)
    return F.pad(columns, (0, -columns.shape[1] % _PAD))


def unsupported_reason(spec: ConvSpec, dtype: str, device_type: str):
    reason = common_unsupported_reason("torch-bsr", DTYPES, spec, dtype, device_type, needs_cuda=True,
                                       dtype_note="its Triton kernel's dtypes")
    if reason is None and best_blocksize(torch.zeros(spec.K, spec.R * spec.S * spec.C)) is None:
        return f"no block of {BLOCKS} divides the {spec.K} x {spec.R * spec.S * spec.C} weight"
    return reason


def load_peer() -> Peer:
    from torch.sparse._triton_ops import bsr_dense_mm

    def prepared(weight: torch.Tensor):
        order = torch.tensor(support_order(weight, 16, 64), device=weight.device)
        matrix = weight_matrix(weight)[order]
        blocksize = best_blocksize(matrix)
        return matrix.to_sparse_bsr(blocksize), torch.argsort(order), blocksize

    def config(variant: str, spec: ConvSpec, dtype: str) -> dict:
        return {"part": "conv" if variant == "torch-bsr" else "matmul", "torch": torch.__version__,
                "im2col": "strided copy, (r, s, c)", "blocks": [list(b) for b in BLOCKS]}

    def bind(variant: str, weight: torch.Tensor, x: torch.Tensor, spec: ConvSpec, dtype: str):
        bsr, inverse, _ = prepared(weight)
        n, count = x.shape[0], x.shape[0] * spec.P * spec.Q

        def output(product: torch.Tensor) -> torch.Tensor:
            return product[:, :count].view(spec.K, n, spec.P, spec.Q).transpose(0, 1)

        if variant == "torch-bsr":
            return lambda: output(bsr_dense_mm(bsr, im2col_rsc(x, spec))[inverse]).contiguous()
        columns = im2col_rsc(x, spec)
        return lambda: output(bsr_dense_mm(bsr, columns))

    return Peer(name="torch-bsr", variants=VARIANTS, dtypes=DTYPES, unsupported_reason=unsupported_reason,
                config=config, bind=bind)
