"""Test weights for one layer: a sparsity pattern (random or a real DLMC ResNet-50 mask) with values."""
from __future__ import annotations

import math
import zlib
from typing import Optional, Tuple

import torch

from sparsecnn.backends.blocks.extraction import provide_blocks
from sparsecnn.core.spec import ConvSpec
from sparsecnn.prune import dlmc_layer_mask, dlmc_sets, magnitude_mask
from sparsecnn.prune.tiles import CHUNK_SIZES, TILE_SIZES, TileParams, reprune_tiles

DLMC_PREFIX = "dlmc-"
# "tiles<rows>[x<chunk>][i]-<pattern>": <pattern>'s mask re-pruned into tiles of <rows> output channels
# sharing kept columns (issue 32), or units of <chunk> input channels at one tap (issue 45); "i": the
# tiles are runs of channels in index order (TileParams.order "none") instead of similarity order
TILES_PREFIX = "tiles"
TWO_FOUR = "2to4"  # 2 of every 4 consecutive input channels at each (output channel, tap): 50%, semi-structured


def layer_generator(seed: int, name: str) -> torch.Generator:
    """CPU generator seeded from (seed, name): the same pair always draws the same numbers."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1) so the weight is not all zero, got {sparsity!r}")


def _random_mask(spec: ConvSpec, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random bool mask of the weight's shape keeping exactly round((1 - sparsity) * numel)."""
    return magnitude_mask(torch.rand(spec.weight_shape, generator=generator), sparsity)


def _dlmc_mask(spec: ConvSpec, method: str, sparsity: float) -> Optional[torch.Tensor]:
    """The DLMC mask of layer `spec.name` in set "<method>-<sparsity>", or None when the data is
    not installed, the set lacks the layer, or the mask's shape is not this layer's (e.g. a
    ResNet-18 layer sharing a ResNet-50 name). ValueError if the data has no such set."""
    set_name = f"{method}-{sparsity:g}"
    try:
        sets = dlmc_sets()
    except FileNotFoundError:
        return None
    if set_name not in sets:
        raise ValueError(f"pattern: no DLMC set {set_name!r}; available: {', '.join(sets)}")
    try:
        mask = dlmc_layer_mask(set_name, spec.name)
    except ValueError:
        return None
    return mask if tuple(mask.shape) == spec.weight_shape else None


def split_tiles_pattern(pattern: str) -> Tuple[Optional[Tuple[int, int, str]], str]:
    """"tiles<rows>[x<chunk>][i]-<base>" -> ((rows, chunk, order), base), chunk 1 when absent, order
    "none" with the "i" suffix, else "greedy"; any other pattern -> (None, pattern). ValueError for
    tiles of other than 16, 32 or 64 rows or a chunk other than 1, 8, 16 or 32."""
    head, _, base = pattern.partition("-")
    if not head.startswith(TILES_PREFIX) or not base:
        return None, pattern
    size = head[len(TILES_PREFIX):]
    order = "none" if size.endswith("i") else "greedy"
    rows, _, chunk = size.removesuffix("i").partition("x")
    if rows not in {str(size) for size in TILE_SIZES} or chunk not in {"", *map(str, CHUNK_SIZES)}:
        raise ValueError(f"pattern {pattern!r}: tiles of {', '.join(map(str, TILE_SIZES))} rows, optionally "
                         f"x a chunk of {', '.join(map(str, CHUNK_SIZES))} channels and 'i' for index order, e.g. "
                         f"'tiles32-{base}' or 'tiles64x32i-{base}'")
    return (int(rows), int(chunk or 1), order), base


def tiled(weight: torch.Tensor, values: torch.Tensor, rows: int, chunk: int = 1, order: str = "greedy") -> torch.Tensor:
    """`weight` (K, C, R, S, pruned) re-pruned into tiles of `rows` output channels (units of
    `chunk` channels, channels grouped in `order`) at the same kept count
    (`prune.tiles.reprune_tiles`), every kept cell holding its value from `values` (as re-training
    fills the cells the tiles add); the tiles are handed to backend `blocks`."""
    decomposition = reprune_tiles(weight, weight != 0, TileParams(tile=rows, chunk=chunk, order=order))
    provide_blocks(decomposition.mask, decomposition.blocks)
    return torch.where(decomposition.mask, values, 0.0)


def two_four_mask(values: torch.Tensor) -> torch.Tensor:
    """Bool mask of (K, C, R, S) `values` keeping the 2 largest magnitudes of every 4 consecutive input
    channels at each (output channel, tap) (fewer channels at the end of C: the largest 2 of them), so
    that the K x (R*S*C) matrix in (r, s, c) order is 2:4 sparse along its rows where C % 4 == 0."""
    K, C, R, S = values.shape
    padded = torch.zeros(K, -(-C // 4) * 4, R, S, dtype=values.dtype)
    padded[:, :C] = values.abs() + 1  # padding channels are never among the largest
    groups = padded.reshape(K, -1, 4, R, S)
    top = groups.topk(2, dim=2).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, top, True)
    return mask.reshape(K, -1, R, S)[:, :C]


def make_weight(spec: ConvSpec, sparsity: float, pattern: str, seed: int, device: torch.device | str,
                dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, str]:
    """Weight (K, C // groups, R, S) of `dtype` on `device` with zeros at pruned positions, and the
    label of the pattern actually used.

    pattern "random": a uniformly random mask with exactly round((1 - sparsity) * numel) non-zeros.
    pattern "dlmc-<method>" (e.g. "dlmc-magnitude_pruning"): the DLMC ResNet-50 mask of layer
    `spec.name` from set f"{method}-{sparsity:g}" when present (label `pattern`); otherwise the
    random mask (label "random"). pattern "2to4": `two_four_mask` of the values (sparsity must be
    0.5). pattern "tiles<rows>[x<chunk>][i]-<pattern>" (rows 16, 32 or 64;
    chunk 8, 16 or 32; "i": index order): that pattern's weight re-pruned into tiles (`tiled`; label
    the same prefix + its label). Kept values
    are normal(0, 1) * sqrt(2 / fan_in), drawn from a generator seeded by (seed, spec.name).
    """
    tiles, base = split_tiles_pattern(pattern)
    if tiles is not None:
        weight, label = make_weight(spec, sparsity, base, seed, "cpu")
        values = make_weight(spec, 0.0, "random", seed, "cpu")[0]
        prefix = pattern.partition("-")[0]
        return tiled(weight, values, *tiles).to(device=device, dtype=dtype), f"{prefix}-{label}"
    _check_sparsity(sparsity)
    generator = layer_generator(seed, spec.name)
    mask, label = None, "random"
    if pattern.startswith(DLMC_PREFIX) and len(pattern) > len(DLMC_PREFIX):
        mask = _dlmc_mask(spec, pattern[len(DLMC_PREFIX):], sparsity)
        label = pattern if mask is not None else "random"
    elif pattern == TWO_FOUR:
        if sparsity != 0.5:
            raise ValueError(f"pattern {TWO_FOUR!r} keeps 2 of every 4 weights: sparsity must be 0.5, got {sparsity!r}")
        label = TWO_FOUR
    elif pattern != "random":
        raise ValueError(f"unknown pattern {pattern!r}; expected 'random', 'dlmc-<method>', '{TWO_FOUR}' or "
                         f"'tiles<rows>-<pattern>'")
    if mask is None and label != TWO_FOUR:
        mask = _random_mask(spec, sparsity, generator)  # drawn before the values, as every recorded run drew it
    fan_in = spec.weight_numel // spec.K
    values = torch.randn(spec.weight_shape, generator=generator) * math.sqrt(2.0 / fan_in)
    if label == TWO_FOUR:
        mask = two_four_mask(values)
    return torch.where(mask, values, 0.0).to(device=device, dtype=dtype), label
