"""CSR of a conv weight viewed as a K x (C*R*S) matrix."""
from __future__ import annotations

import dataclasses
import warnings

import torch


@dataclasses.dataclass
class CSRWeight:
    """Row-compressed K x (C*R*S) matrix; columns ordered (c, r, s) as in PyTorch's weight layout.

    row_ptr: int32 (K + 1,); col_idx: int32 (nnz,); values: (nnz,) in the weight's dtype.
    """

    row_ptr: torch.Tensor
    col_idx: torch.Tensor
    values: torch.Tensor
    shape: tuple

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "CSRWeight":
        """Build from a dense weight (K, ...) whose zeros are the pruned positions."""
        matrix = weight.detach().reshape(weight.shape[0], -1)
        nonzero = matrix != 0
        row_ptr = torch.zeros(matrix.shape[0] + 1, dtype=torch.int32, device=matrix.device)
        row_ptr[1:] = nonzero.sum(1).cumsum(0)
        rows, cols = nonzero.nonzero(as_tuple=True)
        return cls(row_ptr, cols.to(torch.int32), matrix[rows, cols], tuple(matrix.shape))

    @property
    def nnz(self) -> int:
        return self.values.numel()

    def row_nnz(self) -> torch.Tensor:
        """Non-zeros per output channel, int64 (K,)."""
        return (self.row_ptr[1:] - self.row_ptr[:-1]).long()

    def to_dense(self) -> torch.Tensor:
        """The K x (C*R*S) dense matrix."""
        dense = torch.zeros(self.shape, dtype=self.values.dtype, device=self.values.device)
        rows = torch.repeat_interleave(torch.arange(self.shape[0], device=dense.device), self.row_nnz())
        dense[rows, self.col_idx.long()] = self.values
        return dense

    def to_torch(self) -> torch.Tensor:
        """As a `torch.sparse_csr` tensor (int64 indices), for torch.sparse.mm (cuSPARSE on CUDA)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # torch's beta-state notices
            return torch.sparse_csr_tensor(self.row_ptr.long(), self.col_idx.long(), self.values, self.shape,
                                           check_invariants=False)
