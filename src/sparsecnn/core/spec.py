"""`ConvSpec`: the shape of one convolution, and what it costs at minimum."""
from __future__ import annotations

import dataclasses
from typing import Tuple, Union

IntPair = Union[int, Tuple[int, int]]


def _pair(value: IntPair, name: str) -> Tuple[int, int]:
    if isinstance(value, int):
        value = (value, value)
    value = tuple(int(v) for v in value)
    if len(value) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """One 2-D convolution: input (N, C, H, W), weight (K, C // groups, R, S).

    A Conv1d is described with H = 1, R = 1 (its length in W and S).
    `stride`, `padding` and `dilation` are (vertical, horizontal) pairs; ints are accepted.
    """

    N: int
    C: int
    K: int
    H: int
    W: int
    R: int
    S: int
    stride: IntPair = 1
    padding: IntPair = 0
    dilation: IntPair = 1
    groups: int = 1
    name: str = ""

    def __post_init__(self):
        for field in ("stride", "padding", "dilation"):
            object.__setattr__(self, field, _pair(getattr(self, field), field))
        for field in ("N", "C", "K", "H", "W", "R", "S", "groups"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < (0 if field == "N" else 1):
                raise ValueError(f"ConvSpec.{field} must be a positive int, got {value!r}")
        if self.C % self.groups or self.K % self.groups:
            raise ValueError(f"groups={self.groups} must divide C={self.C} and K={self.K}")
        if self.P < 1 or self.Q < 1:
            raise ValueError(f"ConvSpec {self} has an empty output")

    @property
    def P(self) -> int:
        """Output height."""
        (sh, _), (ph, _), (dh, _) = self.stride, self.padding, self.dilation
        return (self.H + 2 * ph - dh * (self.R - 1) - 1) // sh + 1

    @property
    def Q(self) -> int:
        """Output width."""
        (_, sw), (_, pw), (_, dw) = self.stride, self.padding, self.dilation
        return (self.W + 2 * pw - dw * (self.S - 1) - 1) // sw + 1

    @property
    def weight_shape(self) -> Tuple[int, int, int, int]:
        return (self.K, self.C // self.groups, self.R, self.S)

    @property
    def input_shape(self) -> Tuple[int, int, int, int]:
        return (self.N, self.C, self.H, self.W)

    @property
    def output_shape(self) -> Tuple[int, int, int, int]:
        return (self.N, self.K, self.P, self.Q)

    @property
    def weight_numel(self) -> int:
        return self.K * (self.C // self.groups) * self.R * self.S

    @property
    def dense_flops(self) -> int:
        """Multiply-adds x 2 of the dense convolution (whole batch)."""
        return 2 * self.N * self.K * self.P * self.Q * (self.C // self.groups) * self.R * self.S

    def min_bytes(self, elem_bytes: int = 4, density: float = 1.0, index_bytes: int = 4) -> int:
        """Fewest bytes any kernel must move: input read once, output written once, weights.

        Below density 1 the weights are stored sparse: each non-zero costs its value plus an index.
        """
        activations = elem_bytes * (self.N * self.C * self.H * self.W + self.N * self.K * self.P * self.Q)
        if density >= 1.0:
            return activations + elem_bytes * self.weight_numel
        nnz = round(density * self.weight_numel)
        return activations + nnz * (elem_bytes + index_bytes)

    def with_batch(self, n: int) -> "ConvSpec":
        return dataclasses.replace(self, N=n)

    def as_dict(self) -> dict:
        """The results-schema fields of this spec (stride/padding as the vertical value when square)."""
        def flat(pair):
            return pair[0] if pair[0] == pair[1] else list(pair)

        return dict(layer=self.name, N=self.N, C=self.C, K=self.K, H=self.H, W=self.W, R=self.R, S=self.S,
                    stride=flat(self.stride), padding=flat(self.padding))

    @classmethod
    def from_conv(cls, conv, input_shape, name: str = "") -> "ConvSpec":
        """Spec of a `torch.nn.Conv1d`/`Conv2d` applied to an input of `input_shape`."""
        if conv.weight.dim() == 3:
            n, c, length = input_shape
            (s,), (p,), (d,) = conv.stride, _conv1d_padding(conv), conv.dilation
            return cls(n, c, conv.out_channels, 1, length, 1, conv.kernel_size[0], (1, s), (0, p), (1, d),
                       conv.groups, name)
        if isinstance(conv.padding, str):
            raise ValueError(f"{name or 'conv'}: string padding {conv.padding!r} is not supported; use ints")
        n, c, h, w = input_shape
        r, s = conv.kernel_size
        return cls(n, c, conv.out_channels, h, w, r, s, conv.stride, conv.padding, conv.dilation, conv.groups, name)


def _conv1d_padding(conv):
    if isinstance(conv.padding, str):
        raise ValueError(f"string padding {conv.padding!r} is not supported; use ints")
    return conv.padding
