"""Input offsets of a gathered convolution: the column c*R*S + r*S + s of a weight row as the offset
c*H*W + r*W + s into a (padded) H x W input, and a cache of them per input size for weight formats.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch

INT32_MAX = 2**31 - 1


def expand_offsets(cols: torch.Tensor, kernel_shape: Tuple[int, int, int, int], height: int,
                   width: int) -> torch.Tensor:
    """Column indices c*R*S + r*S + s -> input offsets c*height*width + r*width + s, int32.

    cols: int32, any shape; height/width: the (padded) input size the kernel reads.
    """
    _, channels, kh, kw = kernel_shape
    if height < kh or width < kw:
        raise ValueError(f"input {height}x{width} is smaller than the {kh}x{kw} kernel")
    if channels * height * width > INT32_MAX:
        raise ValueError(f"one image of {channels}x{height}x{width} exceeds int32 offsets")
    cols = cols.long()
    c, rs = cols // (kh * kw), cols % (kh * kw)
    return (c * (height * width) + (rs // kw) * width + rs % kw).to(torch.int32)


@dataclasses.dataclass
class OffsetCache:
    """Input offsets per (padded) input size, expanded from the columns once per size."""

    _offsets: Dict[Tuple, Optional[torch.Tensor]] = dataclasses.field(default_factory=dict, repr=False,
                                                                      compare=False, kw_only=True)

    def offsets(self, height: int, width: int) -> torch.Tensor:
        """int32 input offsets for a (padded) height x width input (see `_expand_offsets`)."""
        key = (int(height), int(width))
        return self._cached(key, lambda: self._expand_offsets(*key))

    def _cached(self, key: Tuple, build: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        if key not in self._offsets:
            self._offsets[key] = build()
        return self._offsets[key]

    def _expand_offsets(self, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError
