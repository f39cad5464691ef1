"""Weight formats for direct sparse convolution (UnSparse-Opt, paper 003 Sec. 5, Algorithm 4).

The paper stores the K x (C*R*S) weight matrix as CSR whose every row (output channel) holds the
same number of non-zeros, and replaces each column index by the offset of its input element, so
the kernel does no index arithmetic per non-zero. Two formats here:

* `UniformELLWeight`: the paper's uniform rows (an ELL matrix): every channel padded to the
  largest channel's non-zero count L. One loop bound for the whole layer, no per-row masks.
* `OffsetCSRWeight`: plain per-channel CSR (row_ptr), for skewed real patterns (DLMC ResNet-50 at
  90% keeps 2% to 21% per channel), where padding every row to the longest would double the work.

Offsets. A non-zero at (c, r, s) reads input element c*Hp*Wp + r*Wp + s relative to the top-left
input position of the output pixel, in the *zero-padded* input (Hp = H + 2*pad_h, Wp = W + 2*pad_w).
The kernel pads the input once instead of bounds-checking every load: a check costs ~4 integer
instructions per multiply-add in the inner loop (two adds, two compares), doubling its work,
while padding costs one extra pass over the input. As the offsets depend on (Hp, Wp), the formats
keep the column index c*R*S + r*S + s and expand offsets per input size on first use (cached).
The exception: `ChunkedCSRWeight.masked_codes`, offsets into the unpadded input with the tap
(r, s) alongside, for the batch-innermost kernel's masked path (backends/direct/kernel_batch.py),
whose loop is bound by L2 rather than by instructions.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from sparsecnn.core.csr import CSRWeight
from sparsecnn.core.offsets import INT32_MAX as _INT32_MAX
from sparsecnn.core.offsets import OffsetCache, expand_offsets


def _check_weight(weight: torch.Tensor) -> Tuple[int, int, int, int]:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating (K, C, R, S) tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    return tuple(weight.shape)


def masked_codes(cols: torch.Tensor, kernel_shape: Tuple[int, int, int, int], height: int, width: int,
                 pad_h: int, pad_w: int) -> Optional[torch.Tensor]:
    """Column indices c*R*S + r*S + s -> int32 codes off * 64 + r * 8 + s, where off = c*height*width
    + (r - pad_h)*width + (s - pad_w) is the tap's offset in the unpadded height x width input (may
    be negative); a kernel decodes r = (code >> 3) & 7, s = code & 7, off = code >> 6 (arithmetic
    shift) and masks the taps outside the image. cols: int32, any shape; the codes have its shape.

    None when they cannot hold the layer: R or S > 8, or some (c, r, s) of the kernel shape whose
    |off| * 64 + 63 exceeds int32 (a bound on the shape, so the answer does not depend on the weight's
    pattern and needs no device sync).
    """
    _, channels, kh, kw = kernel_shape
    if kh > 8 or kw > 8:
        return None
    largest = max(pad_h * width + pad_w, (channels - 1) * height * width + (kh - 1 - pad_h) * width + kw - 1 - pad_w)
    if largest * 64 + 63 > _INT32_MAX:
        return None
    cols = cols.long()
    c, rs = cols // (kh * kw), cols % (kh * kw)
    r, s = rs // kw, rs % kw
    off = c * (height * width) + (r - pad_h) * width + (s - pad_w)
    return (off * 64 + r * 8 + s).to(torch.int32)


def padding_overhead(row_nnz: torch.Tensor) -> float:
    """Slots uniform-width rows add per real non-zero: (K * max - sum) / sum (0 when all empty).

    row_nnz: non-zeros per output channel, (K,) integer.
    """
    total = int(row_nnz.sum())
    width = int(row_nnz.max()) if row_nnz.numel() else 0
    return (row_nnz.numel() * width - total) / total if total else 0.0


@dataclasses.dataclass
class UniformELLWeight(OffsetCache):
    """Every output channel holds L = max non-zeros per channel; shorter rows padded with zeros.

    values: float32 (K, L); cols: int32 (K, L) column c*R*S + r*S + s; row_nnz: int32 (K,) real
    non-zeros per row (the first row_nnz[k] slots of row k, in increasing column order).
    Both (K, L) tensors are views of step-major (L, K) storage (strides (1, K)), so the K values of
    one step are contiguous: a kernel block of channels reads them with vector loads.
    Padding slots repeat the column of the row's last real non-zero (column 0 for an empty row):
    the kernel walks each row in column order, so that input is already in L1; value 0 makes it
    add nothing. Values are float32 whatever the weight's dtype (exact for fp16/bf16 weights).
    """

    values: torch.Tensor
    cols: torch.Tensor
    row_nnz: torch.Tensor
    kernel_shape: Tuple[int, int, int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "UniformELLWeight":
        """Build from a dense (K, C, R, S) weight whose zeros are the pruned positions."""
        return cls.from_csr(CSRWeight.from_dense(weight), _check_weight(weight))

    @classmethod
    def from_csr(cls, csr: CSRWeight, kernel_shape: Tuple[int, int, int, int]) -> "UniformELLWeight":
        """Pad the rows of `csr` (the K x C*R*S matrix of a weight of `kernel_shape`) to equal length."""
        row_nnz = csr.row_nnz()
        rows, width = row_nnz.numel(), int(row_nnz.max()) if row_nnz.numel() else 0
        slot = torch.arange(width, device=row_nnz.device)
        real = slot[None, :] < row_nnz[:, None]                                   # (K, L)
        # Index into the CSR arrays: the slot itself, or the row's last real entry for padding.
        last = (row_nnz - 1).clamp(min=0)[:, None]
        source = csr.row_ptr[:-1].long()[:, None] + torch.minimum(slot[None, :], last)
        source = source.clamp(max=max(csr.nnz - 1, 0))
        values = torch.zeros(width, rows, dtype=torch.float32, device=row_nnz.device)
        cols = torch.zeros(width, rows, dtype=torch.int32, device=row_nnz.device)
        if csr.nnz:
            values.t()[:] = torch.where(real, csr.values[source].float(), 0.0)
            cols.t()[:] = torch.where(row_nnz[:, None] > 0, csr.col_idx[source], 0)
        return cls(values.t(), cols.t(), row_nnz.to(torch.int32), tuple(kernel_shape))

    @property
    def width(self) -> int:
        """L: non-zero slots per output channel (real + padding)."""
        return self.values.shape[1]

    @property
    def nnz(self) -> int:
        """Real non-zeros (padding excluded)."""
        return int(self.row_nnz.sum())

    @property
    def padded_slots(self) -> int:
        return self.values.numel() - self.nnz

    @property
    def padding_overhead(self) -> float:
        """Padded slots per real non-zero (0 for perfectly uniform rows)."""
        return self.padded_slots / self.nnz if self.nnz else 0.0

    @property
    def device(self) -> torch.device:
        return self.values.device

    def _expand_offsets(self, height: int, width: int) -> torch.Tensor:
        """int32 (K, L), same strides as `values`."""
        return expand_offsets(self.cols.t(), self.kernel_shape, height, width).t()

    def to_dense(self) -> torch.Tensor:
        """The float32 (K, C, R, S) weight (padding adds zeros, so it decodes to the original)."""
        dense = torch.zeros(self.kernel_shape[0], self.kernel_shape[1] * self.kernel_shape[2] * self.kernel_shape[3],
                            dtype=torch.float32, device=self.device)
        dense.scatter_add_(1, self.cols.long(), self.values)
        return dense.reshape(self.kernel_shape)


@dataclasses.dataclass
class OffsetCSRWeight(OffsetCache):
    """Per-channel CSR (no padding) with channels ordered by decreasing non-zero count.

    csr: the `CSRWeight` of the K x C*R*S matrix (columns increasing within a row);
    values: its values as float32 (nnz,); row_order: int32 (K,) channels sorted by decreasing
    nnz (stable). A kernel that runs a block of channels to the block's longest row wastes the
    least when the block holds rows of similar length, hence the order.
    """

    csr: CSRWeight
    values: torch.Tensor
    row_order: torch.Tensor
    kernel_shape: Tuple[int, int, int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "OffsetCSRWeight":
        """Build from a dense (K, C, R, S) weight whose zeros are the pruned positions."""
        kernel_shape = _check_weight(weight)
        csr = CSRWeight.from_dense(weight)
        order = torch.sort(csr.row_nnz(), descending=True, stable=True).indices
        return cls(csr, csr.values.float(), order.to(torch.int32), kernel_shape)

    @property
    def row_ptr(self) -> torch.Tensor:
        """int32 (K + 1,)."""
        return self.csr.row_ptr

    @property
    def nnz(self) -> int:
        return self.csr.nnz

    @property
    def row_nnz(self) -> torch.Tensor:
        """Non-zeros per output channel, int64 (K,)."""
        return self.csr.row_nnz()

    @property
    def ell_padding_overhead(self) -> float:
        """What `UniformELLWeight` would pad per real non-zero for this weight."""
        return padding_overhead(self.row_nnz)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def _expand_offsets(self, height: int, width: int) -> torch.Tensor:
        """int32 (nnz,)."""
        return expand_offsets(self.csr.col_idx, self.kernel_shape, height, width)

    def to_dense(self) -> torch.Tensor:
        """The float32 (K, C, R, S) weight."""
        return self.csr.to_dense().float().reshape(self.kernel_shape)


@dataclasses.dataclass
class ChunkedCSRWeight(OffsetCache):
    """Per-channel CSR whose rows are padded with zeros to a multiple of `chunk` non-zeros.

    A kernel then loads a chunk of weights and offsets with one vector load each and issues the
    chunk's input gathers together (many loads in flight instead of one dependent load per step).
    values: float32 (slots,); cols: int32 (slots,) column c*R*S + r*S + s; row_ptr: int32 (K + 1,)
    in slots (multiples of `chunk`). Padding repeats the row's last real column (already in L1)
    with value 0; an empty row has no slots.
    """

    values: torch.Tensor
    cols: torch.Tensor
    row_ptr: torch.Tensor
    row_nnz: torch.Tensor
    chunk: int
    kernel_shape: Tuple[int, int, int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor, chunk: int) -> "ChunkedCSRWeight":
        """Build from a dense (K, C, R, S) weight whose zeros are the pruned positions."""
        kernel_shape = _check_weight(weight)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        csr = CSRWeight.from_dense(weight)
        row_nnz = csr.row_nnz()
        slots = (row_nnz + chunk - 1) // chunk * chunk
        row_ptr = torch.zeros(row_nnz.numel() + 1, dtype=torch.long, device=row_nnz.device)
        row_ptr[1:] = slots.cumsum(0)
        row = torch.repeat_interleave(torch.arange(row_nnz.numel(), device=row_nnz.device), slots)
        within = torch.arange(int(row_ptr[-1]), device=row_nnz.device) - row_ptr[:-1][row]
        real = within < row_nnz[row]
        source = csr.row_ptr[:-1].long()[row] + torch.minimum(within, row_nnz[row] - 1)
        values = torch.where(real, csr.values[source].float(), 0.0) if csr.nnz else csr.values.float()
        cols = csr.col_idx[source] if csr.nnz else csr.col_idx
        return cls(values, cols, row_ptr.to(torch.int32), row_nnz.to(torch.int32), chunk, kernel_shape)

    @property
    def nnz(self) -> int:
        return int(self.row_nnz.sum())

    @property
    def padding_overhead(self) -> float:
        """Padded slots per real non-zero."""
        return (self.values.numel() - self.nnz) / self.nnz if self.nnz else 0.0

    @property
    def device(self) -> torch.device:
        return self.values.device

    def _expand_offsets(self, height: int, width: int) -> torch.Tensor:
        """int32 (slots,)."""
        return expand_offsets(self.cols, self.kernel_shape, height, width)

    def masked_codes(self, height: int, width: int, pad_h: int, pad_w: int) -> Optional[torch.Tensor]:
        """int32 (slots,) `masked_codes` for an unpadded height x width input and this padding, or None
        when they do not fit; cached per (size, padding) beside the offsets."""
        key = ("masked", int(height), int(width), int(pad_h), int(pad_w))
        return self._cached(key, lambda: masked_codes(self.cols, self.kernel_shape, *key[1:]))

    def to_dense(self) -> torch.Tensor:
        """The float32 (K, C, R, S) weight."""
        k, rest = self.kernel_shape[0], self.kernel_shape[1] * self.kernel_shape[2] * self.kernel_shape[3]
        rows = torch.repeat_interleave(torch.arange(k, device=self.device),
                                       (self.row_ptr[1:] - self.row_ptr[:-1]).long())
        dense = torch.zeros(k, rest, dtype=torch.float32, device=self.device)
        dense.index_put_((rows, self.cols.long()), self.values, accumulate=True)
        return dense.reshape(self.kernel_shape)
