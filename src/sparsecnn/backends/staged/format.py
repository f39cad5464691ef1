"""Block- and chunk-ordered CSR for kernels that stage a tile of the input in shared memory,
chunk_c input channels at a time, for a block of `rows_per_block` output channels
(`backends/staged/kernel.py`).

The kernel consumes the non-zeros of the staged chunk before staging the next one, and stages
those non-zeros too. So the non-zeros are ordered by block of rows, then chunk, then row, then
column (c, r, s): one block's non-zeros of one chunk are one contiguous segment, copied to shared
memory with the input; `chunk_ptr[g, j, i]` is where row i of block g starts in chunk j's segment
and `chunk_ptr[g, j, rows_per_block]` where the segment ends (the next one's start).

For a staged tile geometry, `entries(halo_h, halo_w, lanes)` gives each non-zero as one
(weight, offset) pair of int32s, the weight as its float32 bits and the offset the position of
its input (c mod chunk_c, r, s) in the tile of halo_h x halo_w positions per channel, counted in
`lanes` units (the tile stores each position as `lanes` 16-byte vectors; the kernel adds its
lane's part and reads one vector): 8 bytes per non-zero and no index arithmetic. The halo
depends on the layer's stride, which the weight does not know, so entries are built per geometry
and cached.

Rows are not the output channels in order: a kernel gives `rows_per_warp` rows to each warp and
every warp waits at each chunk's barrier for the slowest of its block, so channels are dealt to
warps by decreasing non-zero count in snake order (each warp's total is about the same).
`channel[row]` is the output channel of a row, -1 for the empty rows that pad K to whole blocks.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from sparsecnn.core.offsets import OffsetCache


@dataclasses.dataclass
class StagedCSRWeight(OffsetCache):
    """values: float32 (nnz,) and cols: int32 (nnz,) (column c*R*S + r*S + s), in (block, chunk,
    row, column) order; chunk_ptr: int32 (blocks, n_chunks, rows_per_block + 1), absolute indices
    into values; channel: int32 (rows,); chunk_c: input channels per chunk; max_segment: the most
    non-zeros of one block in one chunk (what a kernel's shared memory must hold; an int, so a
    launch needs no device sync to know it); kernel_shape (K, C, R, S)."""

    values: torch.Tensor
    cols: torch.Tensor
    chunk_ptr: torch.Tensor
    channel: torch.Tensor
    chunk_c: int
    rows_per_block: int
    max_segment: int
    kernel_shape: Tuple[int, int, int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor, chunk_c: int, rows_per_warp: int, warps: int) -> "StagedCSRWeight":
        """Pack a dense (K, C, R, S) weight whose zeros are the pruned positions, on its device;
        rows_per_warp x warps: rows per block (K is padded to a multiple of it)."""
        if weight.dim() != 4:
            raise ValueError(f"weight must be (K, C, R, S), got shape {tuple(weight.shape)}")
        k, c, r, s = weight.shape
        for name, value in (("chunk_c", chunk_c), ("rows_per_warp", rows_per_warp), ("warps", warps)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        per_block = rows_per_warp * warps
        rows = -(-k // per_block) * per_block
        warp_of_rank, slot_of_rank = _snake(k, rows // rows_per_warp)
        dense = weight.detach().cpu().float().reshape(k, -1)
        order = torch.argsort(-(dense != 0).sum(1), stable=True)
        row_of_channel = torch.empty(k, dtype=torch.long)
        row_of_channel[order] = warp_of_rank * rows_per_warp + slot_of_rank
        channel = torch.full((rows,), -1, dtype=torch.int32)
        channel[row_of_channel] = torch.arange(k, dtype=torch.int32)

        kk, cols = dense.nonzero(as_tuple=True)
        row = row_of_channel[kk]
        n_chunks = -(-c // chunk_c)
        block, row_in_block, chunk = row // per_block, row % per_block, cols // (r * s * chunk_c)
        cell = (block * n_chunks + chunk) * per_block + row_in_block
        order_nz = torch.argsort(cell * (c * r * s) + cols)
        kk, cols, cell = kk[order_nz], cols[order_nz], cell[order_nz]
        blocks = rows // per_block
        flat = torch.zeros(blocks * n_chunks * per_block + 1, dtype=torch.long)
        flat[1:] = torch.bincount(cell, minlength=blocks * n_chunks * per_block).cumsum(0)
        segment = torch.arange(blocks * n_chunks)[:, None] * per_block + torch.arange(per_block + 1)[None, :]
        chunk_ptr = flat[segment].reshape(blocks, n_chunks, per_block + 1)
        device = weight.device
        max_segment = int((chunk_ptr[:, :, -1] - chunk_ptr[:, :, 0]).max()) if chunk_ptr.numel() else 0
        return cls(dense[kk, cols].to(device), cols.to(torch.int32).to(device),
                   chunk_ptr.to(torch.int32).contiguous().to(device), channel.to(device), chunk_c, per_block,
                   max_segment, (k, c, r, s))

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def n_chunks(self) -> int:
        return self.chunk_ptr.shape[1]

    def entries(self, halo_h: int, halo_w: int, lanes: int) -> torch.Tensor:
        """int32 (nnz, 2): (float32 bits of the weight, offset of its input in a staged tile of
        halo_h x halo_w positions per channel, in units of 1 / lanes position); cached."""
        _, _, r, s = self.kernel_shape
        if halo_h < r or halo_w < s:
            raise ValueError(f"halo {halo_h}x{halo_w} is smaller than the kernel {r}x{s}")
        key = ("entries", int(halo_h), int(halo_w), int(lanes))

        def build() -> torch.Tensor:
            cols = self.cols.long()
            c, tap = cols // (r * s), cols % (r * s)
            offsets = (((c % self.chunk_c) * halo_h + tap // s) * halo_w + tap % s) * lanes
            return torch.stack([self.values.view(torch.int32), offsets.to(torch.int32)], dim=1).contiguous()

        return self._cached(key, build)

    def to_dense(self) -> torch.Tensor:
        """The float32 (K, C, R, S) weight (decoded from blocks, chunks, rows and columns: a check
        of the packing)."""
        k, c, r, s = self.kernel_shape
        chunk_ptr, channel, per_block = self.chunk_ptr.cpu(), self.channel.cpu(), self.rows_per_block
        counts = (chunk_ptr[:, :, 1:] - chunk_ptr[:, :, :-1]).reshape(-1)
        cell = torch.repeat_interleave(torch.arange(counts.numel()), counts.long())
        block, chunk = cell // (self.n_chunks * per_block), cell // per_block % self.n_chunks
        row = block * per_block + cell % per_block
        cols = self.cols.cpu().long()
        if not torch.equal(cols // (r * s * self.chunk_c), chunk):
            raise ValueError("a non-zero lies outside its chunk's input channels")
        dense = torch.zeros(k, c * r * s)
        dense[channel[row].long(), cols] = self.values.cpu()
        return dense.reshape(k, c, r, s)


def _snake(k: int, warps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(warp, slot) of the channel of each rank 0..k-1 (ranks by decreasing non-zero count): rank i
    goes to round i // warps, forwards over the warps in even rounds and backwards in odd ones."""
    rank = torch.arange(k)
    round_, position = rank // warps, rank % warps
    warp = torch.where(round_ % 2 == 0, position, warps - 1 - position)
    return warp, round_
