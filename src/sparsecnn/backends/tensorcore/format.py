"""The `tensorcore` weight format: kept units per output-channel group, packed as MMA B tiles.

A *unit* is a run of `chunk` consecutive input channels at one kernel tap (r, s). Output channels
are taken in `permutation` order and cut into groups of `group` channels (the last one padded).
A unit is kept for a group when any of its group x chunk weights is non-zero; a group's reduction
then runs over its kept units only, each one `chunk`-deep MMA step on tensor cores. With masks that
`prune.tiles.reprune_tiles(..., chunk=...)` makes, every kept unit is fully dense; on any other
mask the format stays exact and only spends MMA work on the zeros inside kept units.

Within a group units are ordered by (chunk, r, s), so consecutive steps read the same channels of
neighbouring pixels (cache reuse across taps). Kernels read a group's units from `unit_code`, a
table with one row per group padded to a power of two: a program loads its row at the same time as
its range in `group_start`, where a ranged list would need the range first (one memory latency).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch


@dataclasses.dataclass(frozen=True)
class UnitWeights:
    """A (K, C, R, S) weight in units (module docstring).

    values: (U, chunk, group), the weight's dtype: unit u's B tile, [input channel, output channel].
    unit_tap: (U,) int32, r * S + s. unit_chunk: (U,) int32, the unit's input channels start at
    unit_chunk * chunk. unit_code: (num_groups, `code_row(max_units)`) int32, row g holds group g's
    units in order as unit_tap | unit_chunk << 16, then 0. group_start: (num_groups + 1,) int32,
    group g owns units [group_start[g], group_start[g + 1]). out_channel: (num_groups * group,)
    int32, the output channel of each group row, -1 for padding rows. permuted: False when out_channel is 0..K-1
    (then rows past K are padding). order: how the channels were ordered, "index", "support" or
    "given" (an explicit permutation). max_units: the most units any group keeps (kernels size
    their register copy of a group's unit list by it). shortcut_channels, group_split: see
    `pack_shortcut_units` (0 and None for a plain weight).
    """

    values: torch.Tensor
    unit_tap: torch.Tensor
    unit_chunk: torch.Tensor
    unit_code: torch.Tensor
    group_start: torch.Tensor
    out_channel: torch.Tensor
    kernel_shape: tuple
    group: int
    chunk: int
    permuted: bool
    order: str = "index"
    max_units: int = 0
    shortcut_channels: int = 0
    group_split: Optional[torch.Tensor] = None

    @property
    def num_groups(self) -> int:
        return self.group_start.numel() - 1

    @property
    def num_units(self) -> int:
        return self.unit_tap.numel()

    def to(self, device) -> "UnitWeights":
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                            ("values", "unit_tap", "unit_chunk", "unit_code", "group_start",
                                             "out_channel", "group_split") if getattr(self, f) is not None})


CODE_FIELD_LIMIT = 1 << 15  # taps and chunk indices per unit code field (int32: tap | chunk << 16)


def code_row(max_units: int) -> int:
    """Columns of the `unit_code` table: the power of two holding `max_units` (at least 1)."""
    return 1 << max(0, max_units - 1).bit_length()


def unit_codes(unit_tap: torch.Tensor, unit_chunk: torch.Tensor, counts: torch.Tensor, max_units: int) -> torch.Tensor:
    """The (groups, code_row(max_units)) int32 `unit_code` table of units listed group after group,
    `counts` (groups,) units each; 0 past a group's units."""
    groups = counts.numel()
    table = torch.zeros(groups, code_row(max_units), dtype=torch.int32, device=unit_tap.device)
    if unit_tap.numel():
        group = torch.repeat_interleave(torch.arange(groups, device=counts.device), counts).to(unit_tap.device)
        first = torch.cumsum(counts, 0).to(unit_tap.device) - counts.to(unit_tap.device)
        column = torch.arange(unit_tap.numel(), device=unit_tap.device) - first[group]
        table[group, column] = unit_tap | (unit_chunk << 16)
    return table


def _check_permutation(permutation: Sequence[int], channels: int) -> list:
    order = [int(k) for k in permutation]
    if sorted(order) != list(range(channels)):
        raise ValueError(f"permutation must hold each output channel 0..{channels - 1} once, got {len(order)} "
                         "entries that do not")
    return order


def support_order(weight: torch.Tensor, chunk: int, group: int) -> list:
    """Output channels ordered so that channels keeping the same units sit side by side.

    A channel's support is the set of its units (chunk of input channels at one tap) holding a
    non-zero. Channels sharing a support form a class. Classes whose size is a multiple of `group`
    come first, so that groups cut from the order start at class boundaries (a re-pruning's tiles,
    and a tile it split in two, keep whole groups), then the others; within each part, classes by
    their lowest channel, channels by index. So a weight whose classes are already runs of whole
    groups in channel order (tiles re-pruned without reordering) keeps the identity, and its
    kernel stores whole channel runs. Returns a permutation of 0..K-1.
    """
    K, C, R, S = weight.shape
    chunks = -(-C // chunk)
    padded = torch.zeros(K, chunks * chunk, R, S, dtype=torch.bool)
    padded[:, :C] = weight.detach().ne(0).cpu()
    support = padded.reshape(K, chunks, chunk, R, S).any(dim=2).reshape(K, -1)
    keys = [bytes(row) for row in support.numpy()]
    sizes: dict = {}
    first: dict = {}
    for k, key in enumerate(keys):
        sizes[key] = sizes.get(key, 0) + 1
        first.setdefault(key, k)
    return sorted(range(K), key=lambda k: (sizes[keys[k]] % group != 0, first[keys[k]], k))


ORDERS = ("index", "support")


def _kept_units(padded: torch.Tensor, group: int, chunk: int) -> torch.Tensor:
    """(groups, chunks, R, S) bool: which units of a weight padded to whole groups and chunks
    ((groups * group, chunks * chunk, R, S)) hold a non-zero."""
    rows, channels, R, S = padded.shape
    return padded.reshape(rows // group, group, channels // chunk, chunk, R, S).ne(0).any(dim=3).any(dim=1)


def padded_work(weight: torch.Tensor, group: int, chunk: int) -> int:
    """Multiply-adds per output pixel that `pack_units(weight, group, chunk)` (index order) runs on
    tensor cores: its kept units x group x chunk, the zeros inside kept units and the padding of the
    last group and chunk included. weight: (K, C, R, S) with zeros."""
    K, C, R, S = weight.shape
    nonzero = torch.zeros(-(-K // group) * group, -(-C // chunk) * chunk, R, S, dtype=torch.bool,
                          device=weight.device)
    nonzero[:K, :C] = weight.detach().ne(0)
    return int(_kept_units(nonzero, group, chunk).sum()) * group * chunk


def pack_units(weight: torch.Tensor, group: int, chunk: int,
               order: Union[str, Sequence[int]] = "index") -> UnitWeights:
    """Pack a dense (K, C, R, S) `weight` with zeros into units of `chunk` input channels for
    groups of `group` output channels taken in `order`: "index" (0..K-1: each group is a run of
    channels, stored contiguously), "support" (`support_order`: fewer units when similar channels
    are scattered, stored through the channel map) or an explicit permutation of 0..K-1."""
    if weight.dim() != 4:
        raise ValueError(f"weight must be (K, C, R, S), got shape {tuple(weight.shape)}")
    K, C, R, S = weight.shape
    if R * S >= CODE_FIELD_LIMIT or -(-C // chunk) >= CODE_FIELD_LIMIT:
        raise ValueError(f"weight of shape {tuple(weight.shape)} has more than {CODE_FIELD_LIMIT - 1} taps or chunks "
                         f"of {chunk} input channels, more than a unit code holds")
    if isinstance(order, str):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} or a permutation, got {order!r}")
        label = order
        order = list(range(K)) if order == "index" else support_order(weight, chunk, group)
    else:
        label, order = "given", _check_permutation(order, K)
    num_groups = -(-K // group)
    chunks = -(-C // chunk)
    rows = torch.full((num_groups * group,), -1, dtype=torch.int64)
    rows[:K] = torch.as_tensor(order, dtype=torch.int64)
    padded = torch.zeros(num_groups * group, chunks * chunk, R, S, dtype=weight.dtype, device=weight.device)
    padded[:K, :C] = weight.detach()[rows[:K].to(weight.device)]
    blocks = padded.reshape(num_groups, group, chunks, chunk, R, S)
    kept = _kept_units(padded, group, chunk)
    g, c, r, s = kept.nonzero(as_tuple=True)  # lexicographic: by group, then (chunk, r, s)
    values = blocks[g, :, c, :, r, s]  # (U, group, chunk)
    counts = torch.bincount(g, minlength=num_groups)
    group_start = torch.zeros(num_groups + 1, dtype=torch.int32)
    group_start[1:] = torch.cumsum(counts.cpu(), 0)
    unit_tap, unit_chunk = (r * S + s).to(torch.int32), c.to(torch.int32)
    max_units = int(counts.max()) if num_groups else 0
    return UnitWeights(values=values.transpose(1, 2).contiguous(), unit_tap=unit_tap, unit_chunk=unit_chunk,
                       group_start=group_start.to(weight.device), out_channel=rows.to(torch.int32).to(weight.device),
                       kernel_shape=(K, C, R, S), group=group, chunk=chunk, permuted=order != list(range(K)),
                       order=label, max_units=max_units,
                       unit_code=unit_codes(unit_tap, unit_chunk, counts, max_units))


def pack_shortcut_units(weight: torch.Tensor, shortcut: torch.Tensor, group: int, chunk: int) -> UnitWeights:
    """`weight` (K, C, R, S) and a 1x1 `shortcut` weight (K, C2, 1, 1) packed as one reduction, for
    y = conv(x, weight) + conv(x2, shortcut) in one kernel: a ResNet block's last conv with its
    projection shortcut (the downsample conv) folded in, so the shortcut's output is never written
    and read back as a residual. The units are those of the (K, C + C2, R, S) weight holding
    `weight` in channels 0..C-1 and the shortcut at tap 0 in C..C+C2-1, in index order; a group's
    units of `weight` come first (units are ordered by chunk), the shortcut's from
    `group_split[g]` on. C must be a multiple of `chunk`, so that no unit spans both inputs.
    Returns its `UnitWeights`: kernel_shape (K, C, R, S), shortcut_channels C2, group_split
    (num_groups,) int32."""
    if weight.dim() != 4 or shortcut.dim() != 4 or shortcut.shape[2:] != (1, 1) or shortcut.shape[0] != weight.shape[0]:
        raise ValueError(f"weight must be (K, C, R, S) and shortcut (K, C2, 1, 1), got {tuple(weight.shape)} and "
                         f"{tuple(shortcut.shape)}")
    K, C, R, S = weight.shape
    if C % chunk:
        raise ValueError(f"weight's input channels C={C} must be a multiple of chunk={chunk} to take a shortcut")
    combined = torch.zeros(K, C + shortcut.shape[1], R, S, dtype=weight.dtype, device=weight.device)
    combined[:, :C] = weight.detach()
    combined[:, C:, 0, 0] = shortcut.detach()[:, :, 0, 0]
    packed = pack_units(combined, group, chunk)
    counts = (packed.group_start[1:] - packed.group_start[:-1]).cpu()
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    main_units = torch.bincount(owner[packed.unit_chunk.cpu() < C // chunk], minlength=counts.numel())
    group_split = (packed.group_start[:-1].cpu() + main_units).to(torch.int32)
    return dataclasses.replace(packed, kernel_shape=(K, C, R, S), shortcut_channels=shortcut.shape[1],
                               group_split=group_split.to(weight.device))
