"""`SparseConv2d`: a drop-in Conv2d/Conv1d whose weight is pruned and run by a sparse backend."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.core.checks import check_residual
from sparsecnn.core.pool_args import PoolArgs
from sparsecnn.core.registry import KernelCall, apply_epilogue_
from sparsecnn.core.spec import ConvSpec
from sparsecnn.nn import shortcut as shortcut_fold
from sparsecnn.nn.pool import max_pool2d
from sparsecnn.nn.static import mark_static

ACTIVATIONS = ("none", "relu")
# Input signatures (e.g. batch sizes) a layer keeps bound at once, the least recently used dropped: enough
# for a model compiled at a few shapes to find every one bound, as torch.compile needs (see forward).
MAX_BINDINGS = 8


def _pair(value, conv_dims: int, height_value: int) -> Tuple[int, int]:
    """A Conv1d's (v,) becomes (height_value, v) for its H = 1 view; a Conv2d's pair stays."""
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,) * conv_dims
    return (height_value, *value) if conv_dims == 1 else value


class SparseConv2d(nn.Module):
    """Convolution with an unstructured-sparse weight, run by a named backend.

    weight: (K, C // groups, R, S) for 2-D or (K, C // groups, S) for 1-D, zeros at pruned positions;
    mask: bool of the same shape (the positions allowed to be non-zero). Input (N, C, H, W) or
    (N, C, L); output (N, K, P, Q) or (N, K, L_out), in the input's dtype:
    act(conv(x) + bias + residual), act = ReLU for activation="relu", fused into the kernel's
    epilogue where the backend can; then, when `pool` (a `core.pool_args.PoolArgs`, 2-D layers
    without a residual; set by `prepare_for_inference`) is set, the max pool of that, fused into
    the kernel where the backend can (`Backend.bind_pooled`), else run after it (`nn.pool`).
    Cases the backend does not support run densely (F.conv2d); `extra_repr` says so.

    Each input signature (shape, dtype, device, and whether a residual is passed) is planned,
    packed and bound once, eagerly (`prepare`, or the first forward), and kept (the
    `MAX_BINDINGS` signatures used last); after that forward is pure tensor work, so the layer runs under
    torch.compile as one graph node per conv, at every shape it was bound for, and under
    CUDA-graph capture. `takes_residual` (set by `prepare_for_inference` when it fuses an add
    into the layer) says which way `prepare` binds: with relu and no residual, a backend may
    compile the ReLU into its kernel (`Backend.bind_for`).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 mask: Optional[torch.Tensor] = None, stride=1, padding=0, dilation=1, groups: int = 1,
                 backend: str = "dense", config: Any = None, activation: str = "none"):
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
        self.activation = activation
        self.takes_residual = False
        self.pool: Optional[PoolArgs] = None
        self.shortcut: Optional[SparseConv2d] = None  # a folded 1x1 projection shortcut (`nn.shortcut`)
        # Whether an NCHW output (pooled, where there is a pool) is handed on in channels_last memory:
        # set by tuning where the layers after it read channels_last (`tuning.layout.keep_channels_last_outputs`).
        self.channels_last_output = False
        self.set_backend(backend, config)

    def set_backend(self, backend: str, config: Any) -> None:
        """Run on `backend` (a registered name) with `config` (None: its default) from the next call."""
        self.backend = get_backend(backend).name
        self.config = config
        self._packed = None
        self._packed_key = None
        self._bindings: Dict[Tuple, _Binding] = {}  # binding key -> binding, least recently used first
        self.shortcut_binding: Optional[shortcut_fold.ShortcutBinding] = None

    @property
    def _binding(self) -> Optional["_Binding"]:
        """The binding used or made last in eager mode (None: none since the backend was set)."""
        return next(reversed(self._bindings.values()), None)

    def backend_state(self) -> tuple:
        """The backend, config, packed weight and bindings, for `restore_backend` (so that trying
        another backend does not cost re-packing this one)."""
        return self.backend, self.config, self._packed, self._packed_key, dict(self._bindings)

    def restore_backend(self, state: tuple) -> None:
        """Back to a `backend_state()`, with its packed weight and bindings."""
        self.backend, self.config, self._packed, self._packed_key, bindings = state
        self._bindings = dict(bindings)

    @property
    def activation(self) -> str:
        """"none" or "relu": applied after the bias and residual add, in the kernel's epilogue."""
        return self._activation

    @activation.setter
    def activation(self, value: str) -> None:
        if value not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {value!r}")
        self._activation = value

    @classmethod
    def from_dense(cls, conv: nn.Module, backend: str = "dense", mask: Optional[torch.Tensor] = None,
                   config: Any = None, activation: str = "none") -> "SparseConv2d":
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
                   backend, config, activation)

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
        r, s = (1, self.weight.shape[2]) if self.conv_dims == 1 else self.weight.shape[2:]
        return ConvSpec(n, c, self.out_channels, h, w, r, s, self.stride, self.padding, self.dilation, self.groups)

    def weight_4d(self) -> torch.Tensor:
        """The masked weight as (K, C // groups, R, S) (a Conv1d's as (K, C // groups, 1, S))."""
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

    def _packing_key(self) -> Tuple:
        return (self.backend, self.weight.device, self.weight.dtype, self.weight._version, self.mask._version,
                self.config)

    def _packed_weight(self, backend):
        """The weight in the backend's format, repacked when the weight, mask, config or device changed."""
        key = self._packing_key()
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = backend.prepare(self.weight_4d().contiguous(), self.config)
            self._packed_key = key
        return self._packed

    def packed_weight(self) -> Any:
        """The masked weight in the backend's format (`Backend.prepare`), packed now if the weight,
        mask, config or device changed since it last was."""
        return self._packed_weight(get_backend(self.backend))

    def adopt_packed(self, packed: Any) -> None:
        """Use `packed` as the backend's format of the current weight, mask, config, dtype and device
        (e.g. restored from an artefact) instead of packing again; the caller vouches that it is.
        Any change to those afterwards repacks as usual."""
        self._packed, self._packed_key, self._bindings = packed, self._packing_key(), {}

    @property
    def relu_only(self) -> bool:
        """Whether the layer computes relu(conv + bias) with no residual, as `prepare` binds it."""
        return self._relu_only(self.takes_residual)

    def _relu_only(self, has_residual: bool) -> bool:
        return self.activation == "relu" and not has_residual

    def _binding_key(self, x: torch.Tensor, has_residual: bool) -> Tuple:
        return self.backend, tuple(x.shape), x.dtype, x.device, self.pool, self._relu_only(has_residual)

    def _bind(self, x: torch.Tensor, has_residual: bool) -> "_Binding":
        """The binding for inputs like `x` (eager only): the one kept for the input's shape, dtype
        and device, the residual's presence and the activation while the packed weight stays the
        same, else planned, packed and bound again."""
        key = self._binding_key(x, has_residual)
        old = self._bindings.get(key)
        if old is not None:
            spec, reason = old.spec, old.reason
        else:
            backend = get_backend(self.backend)
            spec = self.spec_for(x)
            reason = backend.unsupported_reason(spec, x.dtype, x.device.type)
        if reason is not None and self.fallback_reason != reason:
            warnings.warn(f"SparseConv2d: backend {self.backend!r} falls back to dense: {reason}")
            self.fallback_reason = reason
        runs_backend = reason is None and spec.N > 0
        packed = self._packed_weight(get_backend(self.backend)) if runs_backend else None
        if old is not None and old.packed is packed:
            self._bindings[key] = self._bindings.pop(key)  # the newest: the oldest is dropped first
            return old
        call, pooled = None, False
        if runs_backend:
            backend = get_backend(self.backend)
            if self.pool is not None and backend.bind_pooled is not None and not has_residual:
                call = backend.bind_pooled(packed, spec, self.config, x.dtype, self.bias is not None, self.pool)
                pooled = call is not None
            if call is None:
                call = backend.bind_for(packed, spec, self.config, x.dtype, self.bias is not None, relu_only=key[-1])
            mark_static(call.tensors)
        output_shape = spec.output_shape if self.conv_dims == 2 else (spec.N, spec.K, spec.Q)
        return self._remember(_Binding(key, spec, reason, packed, call, output_shape, pooled))

    def _remember(self, binding: "_Binding") -> "_Binding":
        """Keep `binding` as the newest, replacing one of its key, dropping the least recently used beyond
        MAX_BINDINGS."""
        self._bindings.pop(binding.key, None)
        if len(self._bindings) >= MAX_BINDINGS:
            del self._bindings[next(iter(self._bindings))]
        self._bindings[binding.key] = binding
        return binding

    def _current_binding(self, x: torch.Tensor, has_residual: bool) -> "_Binding":
        """Eager (and CUDA-graph capture): checked and refreshed. Under torch.compile: read only
        (dynamo guards on the kept bindings); a layer not bound for this input is bound outside the
        graph: one graph break, and the next call recompiles without it, the binding now kept."""
        if not torch.compiler.is_compiling():
            return self._bind(x, has_residual)
        key = self._binding_key(x, has_residual)
        for binding in self._bindings.values():  # equality, not hashing: dynamo traces it on any key
            if binding.key == key:
                return binding
        # Decorating _bind at import would import torch._dynamo (and triton) with sparsecnn.
        return torch.compiler.disable(self._bind)(x, has_residual)

    def prepare(self, example_input: torch.Tensor) -> "SparseConv2d":
        """Plan, pack and bind for inputs of `example_input`'s shape, dtype and device; returns self.

        forward does this on its first eager call. Do it (or run forward once) before CUDA-graph
        capture, and before torch.compile to keep the layer in one graph: under torch.compile the
        layer only reads its binding, so weight edits made after compiling are not seen until it
        recompiles (an eager forward or `prepare` repacks them). Binds for calls with a residual
        when `takes_residual`, else without.
        """
        self._check_input(example_input)
        with torch.no_grad():
            self._bind(example_input, self.takes_residual)
        return self

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                shortcut_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """act(conv(x) + bias + residual), then max-pooled when `pool` is set: x (N, C, H, W) or
        (N, C, L); residual None (always, with a pool) or a tensor of the conv output's shape, dtype
        and device; act per `activation`. With a folded `shortcut` (`passes.shortcut`):
        act(conv(x) + bias + shortcut(shortcut_input)) instead, and no residual."""
        if self.shortcut is not None:
            if residual is not None:
                raise ValueError("this layer has a folded shortcut: it takes shortcut_input=, not a residual")
            self._check_input(x)
            return shortcut_fold.forward(self, x, shortcut_input)
        if shortcut_input is not None:
            raise ValueError("shortcut_input= is for a layer with a folded shortcut; this one has none")
        return self.forward_plain(x, residual)

    def forward_plain(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`forward` without a folded shortcut (its first two arguments)."""
        self._check_input(x)
        if residual is not None and self.pool is not None:
            raise ValueError("this layer ends in a max pool: it takes no residual")
        binding = self._current_binding(x, residual is not None)
        check_residual(residual, binding.output_shape, x)
        if binding.spec.N == 0:
            shape = binding.output_shape
            return x.new_empty(shape if self.pool is None else (*shape[:2], *self.pool.output_hw(*shape[2:])))
        relu = self.activation == "relu"
        if self.conv_dims == 1:
            x = x.unsqueeze(2)
            residual = None if residual is None else residual.unsqueeze(2)
        if binding.call is None:
            y = self._dense(x, residual, relu)
        else:
            y = binding.call(x, self.bias, residual, relu)
        if self.pool is not None and not binding.pooled:
            y = max_pool2d(y, self.pool.kernel_size, self.pool.stride, self.pool.padding, self.pool.dilation,
                           self.pool.ceil_mode)
        if self.conv_dims == 1:
            return y.squeeze(2)
        return y.contiguous(memory_format=torch.channels_last) if self.channels_last_output else y

    def _dense(self, x: torch.Tensor, residual: Optional[torch.Tensor], relu: bool) -> torch.Tensor:
        """The fallback: F.conv2d on the masked weight (x and residual in the 2-D view)."""
        y = F.conv2d(x, self.weight_4d(), self.bias, self.stride, self.padding, self.dilation, self.groups)
        return apply_epilogue_(y, relu, residual)

    def get_extra_state(self) -> dict:
        return {"backend": self.backend, "config": config_to_dict(self.config), "activation": self.activation,
                "takes_residual": self.takes_residual, "channels_last_output": self.channels_last_output,
                "pool": None if self.pool is None else dataclasses.asdict(self.pool)}

    def set_extra_state(self, state: dict) -> None:
        backend = get_backend(state["backend"])
        config = None if state.get("config") is None else backend.config_from_dict(state["config"])
        self.set_backend(backend.name, config)
        self.activation = state.get("activation", "none")
        self.takes_residual = bool(state.get("takes_residual", self.takes_residual))
        self.channels_last_output = bool(state.get("channels_last_output", False))
        if "pool" in state:
            self.pool = None if state["pool"] is None else PoolArgs.of(**state["pool"])

    def extra_repr(self) -> str:
        kernel = tuple(self.weight.shape[2:])
        text = (f"{self.in_channels}, {self.out_channels}, kernel_size={kernel}, stride={self.stride}, "
                f"padding={self.padding}, density={self.density:.3f}, backend={self.backend}")
        if self.config is not None:
            text += f", config={self.config}"
        text += f", activation={self.activation}" + (", takes_residual=True" if self.takes_residual else "")
        if self.channels_last_output:
            text += ", channels_last_output=True"
        if self.groups != 1 or self.dilation != (1, 1):
            text += f", groups={self.groups}, dilation={self.dilation}"
        if self.pool is not None:
            text += f", max_pool(kernel_size={self.pool.kernel_size}, stride={self.pool.stride})"
        if self.fallback_reason is not None:
            text += f", fallback=dense ({self.fallback_reason})"
        return text


@dataclasses.dataclass(frozen=True)
class _Binding:
    """What forward needs for one input signature.

    key: (backend, input shape, dtype, device, pool, relu_only); spec: the 2-D layer; reason: why
    the backend cannot run it (None: it can); packed: the packed weight bound; call: the bound
    `KernelCall` (None for the dense fallback and empty batches); output_shape: the conv's
    (N, K, P, Q) or (N, K, L_out), before any pool; pooled: whether `call` applies the layer's pool.
    """

    key: Tuple
    spec: ConvSpec
    reason: Optional[str]
    packed: Any
    call: Optional[KernelCall]
    output_shape: Tuple[int, ...]
    pooled: bool = False
