"""Peer "torch-2to4": 2:4 semi-structured sparsity through PyTorch (`torch.sparse.to_sparse_semi_structured`:
cuSPARSELt where PyTorch has it, else CUTLASS) as a convolution: issue 45's 2:4 peer, at 50% where it applies.

The weight is flattened as K x (R*S*C), reduction ordered (r, s, c) (`torch_bsr.weight_matrix`), and
must be 2:4 along it: at most 2 non-zeros in every 4 consecutive columns, what `bench layers
--pattern 2to4 --sparsity 0.5` makes (2 of every 4 input channels at each tap; C a multiple of 4).
* "torch-2to4": im2col of the input in (r, s, c) order (`torch_bsr.im2col_rsc`), the semi-structured
  matmul, the output as (N, K, P, Q).
* "torch-2to4-mm": the matmul alone on columns prepared ahead.
fp16/bf16; K and R*S*C multiples of the library's minimum tile (cuSPARSELt 16 x 16, CUTLASS 32 x 64).
"""
from __future__ import annotations

import torch

from sparsecnn.bench.peers import Peer, common_unsupported_reason, peer_module
from sparsecnn.core.spec import ConvSpec

VARIANTS = ("torch-2to4", "torch-2to4-mm")
DTYPES = ("fp16", "bf16")
_bsr = peer_module("torch_bsr")  # the (r, s, c) weight matrix and im2col, shared with the BSR peer


def library() -> str:
    """"cusparselt" where PyTorch was built with it, else "cutlass"."""
    available = getattr(torch.backends, "cusparselt", None)
    return "cusparselt" if available is not None and available.is_available() else "cutlass"


def _tensor_class(name: str):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    return SparseSemiStructuredTensorCUSPARSELT if name == "cusparselt" else SparseSemiStructuredTensorCUTLASS


def minimum_tile(name: str) -> tuple:
    """(rows, columns) the sparse matrix's shape must be multiples of, for fp16/bf16."""
    constraints = _tensor_class(name)._DTYPE_SHAPE_CONSTRAINTS[torch.float16]
    return constraints.sparse_min_rows, constraints.sparse_min_cols


def is_two_four(matrix: torch.Tensor) -> bool:
    """Whether every 4 consecutive columns of each row of `matrix` hold at most 2 non-zeros."""
    return matrix.shape[1] % 4 == 0 and bool((matrix.ne(0).reshape(matrix.shape[0], -1, 4).sum(-1) <= 2).all())


def unsupported_reason(spec: ConvSpec, dtype: str, device_type: str, name: str = None):
    reason = common_unsupported_reason("torch-2to4", DTYPES, spec, dtype, device_type, needs_cuda=True,
                                       dtype_note="semi-structured fp16/bf16")
    rows, columns = minimum_tile(name or library())
    if reason is None and (spec.K % rows or (spec.R * spec.S * spec.C) % columns):
        return (f"the {spec.K} x {spec.R * spec.S * spec.C} weight is not a multiple of {name or library()}'s "
                f"{rows} x {columns}")
    return reason


def load_peer() -> Peer:
    name = library()
    tensor_class = _tensor_class(name)

    def config(variant: str, spec: ConvSpec, dtype: str) -> dict:
        return {"part": "conv" if variant == "torch-2to4" else "matmul", "torch": torch.__version__,
                "library": name, "im2col": "strided copy, (r, s, c)"}

    def bind(variant: str, weight: torch.Tensor, x: torch.Tensor, spec: ConvSpec, dtype: str):
        matrix = _bsr.weight_matrix(weight).contiguous()
        if not is_two_four(matrix):
            raise ValueError("torch-2to4 needs a weight with at most 2 non-zeros in every 4 consecutive (r, s, c) "
                             "columns: bench layers --pattern 2to4 --sparsity 0.5")
        sparse = tensor_class.from_dense(matrix)
        n, count = x.shape[0], x.shape[0] * spec.P * spec.Q

        def output(product: torch.Tensor) -> torch.Tensor:
            return product[:, :count].view(spec.K, n, spec.P, spec.Q).transpose(0, 1)

        if variant == "torch-2to4":
            return lambda: output(torch.mm(sparse, _bsr.im2col_rsc(x, spec))).contiguous()
        columns = _bsr.im2col_rsc(x, spec)
        return lambda: output(torch.mm(sparse, columns))

    return Peer(name="torch-2to4", variants=VARIANTS, dtypes=DTYPES,
                unsupported_reason=lambda spec, dtype, device_type: unsupported_reason(spec, dtype, device_type, name),
                config=config, bind=bind)
