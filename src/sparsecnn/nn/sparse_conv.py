"""`SparseConv2d`: a drop-in Conv2d/Conv1d whose weight is pruned and run by a sparse backend."""
from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import config_to_dict, get_backend
from ..layers import ConvSpec


def _pair(value, conv_dims: int, height_value: int) -> Tuple[int, int]:
    """A Conv1d's (v,) becomes (height_value, v) for its H = 1 view; a Conv2d's pair stays."""
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,) * conv_dims
    return (height_value, *value) if conv_dims == 1 else value


class SparseConv2d(nn.Module):
    """Convolution with an unstructured-sparse weight, run by a named backend.

    weight: (K, C // groups, R, S) for 2-D or (K, C // groups, S) for 1-D, zeros at pruned positions;
    mask: bool of the same shape (the positions allowed to be non-zero). Input (N, C, H, W) or
    (N, C, L); output (N, K, P, Q) or (N, K, L_out), in the input's dtype.
    Cases the backend does not support run densely (F.conv2d); `extra_repr` says so.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 mask: Optional[torch.Tensor] = None, stride=1, padding=0, dilation=1, groups: int = 1,
                 backend: str = "dense", config: Any = None):
        super().__init__()
        if weight.dim() not in (3, 4):
            raise ValueError(f"weight must be (K, C, R, S) or (K, C, S), got shape {tuple(weight.shape)}")
        if mask is None:
            mask = weight != 0
        if mask.shape != weight.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool with the weight's shape {tuple(weight.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self.conv_dims = weight.dim() - 2
        self.weight = nn.Parameter(weight.detach() * mask)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.register_buffer("mask", mask.clone())
        self.stride = _pair(stride, self.conv_dims, 1)
        self.padding = _pair(padding, self.conv_dims, 0)
        self.dilation = _pair(dilation, self.conv_dims, 1)
        self.groups = groups
        self.in_channels = weight.shape[1] * groups
        self.out_channels = weight.shape[0]
        self.fallback_reason: Optional[str] = None
        self.timings: Optional[dict] = None
        self._set_backend(backend, config)

    def _set_backend(self, backend: str, config: Any) -> None:
        self.backend = get_backend(backend).name
        self.config = config
        self._packed = None
        self._packed_key = None
        self._plan_key = None

    @classmethod
    def from_dense(cls, conv: nn.Module, backend: str = "dense", mask: Optional[torch.Tensor] = None,
                   config: Any = None) -> "SparseConv2d":
        """Wrap an `nn.Conv2d` or `nn.Conv1d`.

        The mask is `mask` if given, else the `weight_mask` left by `torch.nn.utils.prune`, else the
        weight's non-zeros.
        """
        if not isinstance(conv, (nn.Conv1d, nn.Conv2d)):
            raise TypeError(f"conv must be nn.Conv1d or nn.Conv2d, got {type(conv).__name__}")
        if mask is None and hasattr(conv, "weight_mask"):
            mask = conv.weight_mask.bool()
        if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            raise ValueError(f"conv padding={conv.padding!r}, padding_mode={conv.padding_mode!r}: "
                             "only integer zero padding is supported")
        return cls(conv.weight, conv.bias, mask, conv.stride, conv.padding, conv.dilation, conv.groups,
                   backend, config)

    def to_dense(self) -> nn.Module:
        """An equivalent `nn.Conv2d` (or `nn.Conv1d`) holding the masked weight."""
        conv_type = nn.Conv1d if self.conv_dims == 1 else nn.Conv2d
        squeeze = (lambda pair: pair[1:]) if self.conv_dims == 1 else (lambda pair: pair)
        conv = conv_type(self.in_channels, self.out_channels, tuple(self.weight.shape[2:]),
                         squeeze(self.stride), squeeze(self.padding), squeeze(self.dilation), self.groups,
                         bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            conv.weight.copy_(self.weight * self.mask)
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    @property
    def density(self) -> float:
        return (self.weight.detach() * self.mask).count_nonzero().item() / self.weight.numel()

    def spec_for(self, x: torch.Tensor) -> ConvSpec:
        """The 2-D `ConvSpec` of this layer applied to `x` (a Conv1d input is viewed as H = 1)."""
        n, c, *spatial = x.shape
        h, w = (1, spatial[0]) if self.conv_dims == 1 else spatial
        return ConvSpec(n, c, self.out_channels, h, w, *self._weight_4d().shape[2:], self.stride, self.padding,
                        self.dilation, self.groups)

    def _weight_4d(self) -> torch.Tensor:
        weight = self.weight * self.mask
        return weight.unsqueeze(2) if self.conv_dims == 1 else weight

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        layout = "(N, C, L)" if self.conv_dims == 1 else "(N, C, H, W)"
        if x.dim() != self.conv_dims + 2:
            raise ValueError(f"input must be {layout}, got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"input has {x.shape[1]} channels, expected in_channels={self.in_channels}")
        if x.dtype != self.weight.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the weight's {self.weight.dtype}; "
                            "convert the module with .to(dtype)")
        if x.device != self.weight.device:
            raise ValueError(f"input is on {x.device} but the weight is on {self.weight.device}")

    def _packed_weight(self, backend, spec: ConvSpec):
        key = (self.backend, self.weight.device, self.weight.dtype, self.weight._version, self.mask._version,
               str(self.config))
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = backend.prepare(self._weight_4d().contiguous(), self.config)
            self._packed_key = key
        return self._packed

    def _plan(self, x: torch.Tensor):
        """(backend, spec, reason it cannot run or None) for this input, cached per shape/dtype/device."""
        key = (self.backend, tuple(x.shape), x.dtype, x.device.type)
        if self._plan_key != key:
            backend, spec = get_backend(self.backend), self.spec_for(x)
            self._plan_cache = (backend, spec, backend.unsupported_reason(spec, x.dtype, x.device.type))
            self._plan_key = key
        return self._plan_cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        backend, spec, reason = self._plan(x)
        if reason is not None:
            return self._fallback(x, reason)
        if spec.N == 0:
            return x.new_empty(spec.output_shape if self.conv_dims == 2 else (0, spec.K, spec.Q))
        x4 = x.unsqueeze(2) if self.conv_dims == 1 else x
        y = backend.run(x4, self._packed_weight(backend, spec), self.bias, spec, self.config)
        return y.squeeze(2) if self.conv_dims == 1 else y

    def _fallback(self, x: torch.Tensor, reason: str) -> torch.Tensor:
        if self.fallback_reason != reason:
            warnings.warn(f"SparseConv2d: backend {self.backend!r} falls back to dense: {reason}")
            self.fallback_reason = reason
        conv = F.conv1d if self.conv_dims == 1 else F.conv2d
        squeeze = (lambda pair: pair[1:]) if self.conv_dims == 1 else (lambda pair: pair)
        return conv(x, self.weight * self.mask, self.bias, squeeze(self.stride), squeeze(self.padding),
                    squeeze(self.dilation), self.groups)

    def get_extra_state(self) -> dict:
        return {"backend": self.backend, "config": config_to_dict(self.config)}

    def set_extra_state(self, state: dict) -> None:
        backend = get_backend(state["backend"])
        config = None if state.get("config") is None else backend.config_from_dict(state["config"])
        self._set_backend(backend.name, config)

    def extra_repr(self) -> str:
        kernel = tuple(self.weight.shape[2:])
        text = (f"{self.in_channels}, {self.out_channels}, kernel_size={kernel}, stride={self.stride}, "
                f"padding={self.padding}, density={self.density:.3f}, backend={self.backend}")
        if self.config is not None:
            text += f", config={self.config}"
        if self.groups != 1 or self.dilation != (1, 1):
            text += f", groups={self.groups}, dilation={self.dilation}"
        if self.fallback_reason is not None:
            text += f", fallback=dense ({self.fallback_reason})"
        return text
