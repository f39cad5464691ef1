"""CUDA graphs for eager callers: `enable_cuda_graphs(module)` makes a plain `module(x)` replay a CUDA
graph captured once per input signature, and `disable_cuda_graphs(module)` restores the module's forward.

`enable_cuda_graphs` sets `module.forward` to a `CudaGraphForward` wrapping the module's original
forward. A call whose inputs match a signature seen before copies the inputs into that signature's
static input buffers (`copy_`) and replays its graph; the first call of a signature warms the forward up
eagerly on a side stream (lazy packing, kernel compilation and autotuning happen there), captures it with
`torch.cuda.graph` into a memory pool shared by all graphs of the module, and replays it once.

The signature of a call: for every tensor argument, positional or keyword (also inside tuples, lists and
dicts), its shape, dtype, device, strides and requires_grad; every other argument by value (`==` and
`hash`, with its type); and the modes a capture bakes in (CUDA autocast and its dtype, cuDNN and cuBLAS
TF32, cuDNN enabled). Outputs may be a tensor or tuples, lists and dicts of tensors (other values pass
through); they are returned as new tensors (`clone()`), or with `static_outputs=True` as the graph's
static output tensors themselves, which the module's next call overwrites (whatever its signature: the
graphs of a module share one memory pool).

The original forward runs instead (same result, eager speed) when:
- the wrapper is disabled (`wrapper.enabled = False`) or the module is in training mode;
- torch.compile is tracing (`torch.compiler.is_compiling()`): the compiled code contains the plain forward;
- an argument is unhashable, there is no tensor argument, the tensors are not all on one CUDA device, or
  a CUDA stream capture is already under way (the caller is capturing its own graph);
- autograd would record: `torch.is_grad_enabled()` and an input or a parameter of the module requires grad;
- capture failed for this signature (warned once per module with `CudaGraphWarning`, never retried), or
  the module already holds `max_graphs` graphs (warned once per module).

Caveats, by construction of CUDA graphs:
- A graph reads the parameters, buffers and any tensor the forward reaches (packed weights included) at
  the addresses they had at capture. In-place updates of those tensors are seen by replays only if the
  forward reads them directly; after replacing or converting parameters (`module.half()`, `.to()`,
  `load_state_dict` into a module whose forward caches derived tensors, such as `SparseConv2d`'s packed
  weight) call `wrapper.reset()` (or disable and enable again) so the next calls capture anew.
- A forward that writes into its inputs in place writes into the static copies, not the caller's tensors.
- Non-tensor arguments are compared by value; a mutable object that hashes by identity (or hides a
  tensor inside it) is assumed not to change between calls.
- The wrapper holds its module by a weak reference (no reference cycle keeps the module's CUDA memory
  alive): a forward kept after the module itself is gone raises ReferenceError.
- Memory a failed capture allocated from the pool may stay reserved until the process ends.
- Not thread-safe: one thread may call a wrapped module at a time, and no other capture may be under
  way in the process while a first call of a signature captures (the `torch.cuda.graph` restriction).

`copy.deepcopy(module)` gives the copy a fresh wrapper with no graphs; `module.state_dict()` and
`torch.save(module.state_dict())` do not see the wrapper. Pickling the whole module keeps the wrapper's
settings and drops its graphs.
"""
from __future__ import annotations

import copy
import warnings
import weakref
from collections import Counter
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["CudaGraphForward", "CudaGraphSteps", "CudaGraphWarning", "cuda_graph_forward",
           "disable_cuda_graphs", "enable_cuda_graphs", "input_signature"]

DEFAULT_MAX_GRAPHS = 8
WARMUP_RUNS = 2


class CudaGraphWarning(UserWarning):
    """A wrapped module ran eagerly where a CUDA graph was expected (capture failed, or too many graphs)."""


class _Unhashable(Exception):
    pass


# ---------------------------------------------------------------------------------------------- signatures

def _flatten(obj: Any, tensors: List[torch.Tensor]) -> Hashable:
    """The signature of `obj`, appending its tensors to `tensors` in order; raises _Unhashable."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("T", tuple(obj.shape), obj.dtype, obj.device, obj.stride(), obj.requires_grad)
    kind = type(obj)
    if kind is tuple or kind is list or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        return (kind, tuple(_flatten(item, tensors) for item in obj))
    if kind is dict:
        return (kind, tuple((_hashable(key), _flatten(value, tensors)) for key, value in obj.items()))
    return ("V", kind, _hashable(obj))


def _hashable(obj: Any) -> Any:
    try:
        hash(obj)
    except TypeError:
        raise _Unhashable from None
    return obj


def _signature_and_tensors(args: tuple, kwargs: dict) -> Tuple[Optional[Hashable], List[torch.Tensor]]:
    tensors: List[torch.Tensor] = []
    try:
        key = (_flatten(args, tensors), tuple((name, _flatten(value, tensors)) for name, value in kwargs.items()))
    except _Unhashable:
        return None, tensors
    return key, tensors


def input_signature(args: tuple, kwargs: Optional[dict] = None) -> Optional[Hashable]:
    """The key a call `forward(*args, **kwargs)` is graphed under, or None when an argument is unhashable
    (such a call runs eagerly). Tensors (also inside tuples, lists and dicts) count by shape, dtype,
    device, strides and requires_grad, never by value; every other argument by type and value."""
    return _signature_and_tensors(tuple(args), dict(kwargs or {}))[0]


def _mode_key() -> Hashable:
    """The global modes a capture bakes into the graph: CUDA autocast, TF32 in cuDNN and cuBLAS, cuDNN on."""
    autocast = torch.is_autocast_enabled("cuda")
    return (autocast, torch.get_autocast_dtype("cuda") if autocast else None, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.enabled)


def _rebuild(obj: Any, tensors) -> Any:
    """`obj` with its tensors replaced, in `_flatten`'s order, by the next ones from iterator `tensors`."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind(_rebuild(item, tensors) for item in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return kind(*(_rebuild(item, tensors) for item in obj))
    if kind is dict:
        return {key: _rebuild(value, tensors) for key, value in obj.items()}
    return obj


def _map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` (a tensor, or tuples, lists and dicts of them) with `fn` applied to each tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, item) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, _map_tensors(fn, value)) for key, value in obj.items())
    return obj


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


# --------------------------------------------------------------------------------------- the CUDA steps

class CudaGraphSteps:
    """The CUDA side of `CudaGraphForward`: which tensors can be graphed, the memory pool, warm-up and
    capture. Tests substitute a fake with the same methods to check the wrapper's logic without a GPU."""

    def __init__(self):
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` can be an input of a graph (a CUDA tensor)."""
        return tensor.is_cuda

    def is_capturing(self, device: torch.device) -> bool:
        """Whether a capture is under way on the current stream of `device` (no nested capture then)."""
        if device.index is None or device.index == torch.cuda.current_device():
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def new_pool(self) -> Any:
        """A memory pool handle shared by all graphs of one module."""
        return torch.cuda.graph_pool_handle()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of `device` for warm-up and capture (the same one for every capture into a pool)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def warm_up(self, run: Callable[[], Any], device: torch.device, runs: int = WARMUP_RUNS) -> None:
        """`runs` eager calls of `run` on a side stream that waits for (and is then waited for by) the
        current stream, as torch's CUDA graph docs do before a capture."""
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = self._stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(runs):
                    run()
            current.wait_stream(side)

    def capture(self, run: Callable[[], Any], device: torch.device, pool: Any) -> Tuple[Any, Any]:
        """(graph, static outputs) of `run` captured on `device` into `pool`. The capture does not execute
        the kernels: the outputs hold values only after `graph.replay()`. On failure no capture stays
        open and the current stream is the one before the call."""
        graph = torch.cuda.CUDAGraph()
        side = self._stream(device)
        with torch.cuda.device(device):
            previous = torch.cuda.current_stream(device)
            try:
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    outputs = run()
            except BaseException:
                # torch.cuda.graph's __exit__ leaves the side stream current when capture_end raises, and
                # an exception raised before capture_end leaves nothing to end only if capture_begin failed.
                with torch.cuda.stream(side):
                    if torch.cuda.is_current_stream_capturing():
                        try:
                            graph.capture_end()
                        except Exception:  # noqa: BLE001 - the original exception is the one to report
                            pass
                torch.cuda.set_stream(previous)
                _reset_generator_capture(side)
                raise
        return graph, outputs


def _reset_generator_capture(stream: torch.cuda.Stream) -> None:
    """Leave the CUDA random generators out of capture mode after a failed capture.

    A capture whose end fails (it was invalidated, e.g. by a host sync) never runs the generators'
    capture epilogue, so every later random op on the device fails ("Offset increment outside graph
    capture"). An empty capture runs a prologue and an epilogue, which puts them back."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            pass
    except Exception:  # noqa: BLE001 - best effort; the failed capture's exception is the one reported
        pass


class _Entry:
    """One captured signature: the graph, its static input tensors (flattened) and static outputs."""
    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph, inputs: List[torch.Tensor], outputs: Any):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


def _static_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer with `tensor`'s shape, dtype, device and strides, holding its values (never an inference
    tensor, so later calls outside inference mode may copy into it)."""
    with torch.inference_mode(False), torch.no_grad():
        buffer = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
        buffer.copy_(tensor)
    return buffer


# ------------------------------------------------------------------------------------------- the wrapper

class CudaGraphForward:
    """A module's forward that replays a CUDA graph per input signature (see the module docstring for
    signatures, outputs and when it runs eagerly). Installed by `enable_cuda_graphs`; not thread-safe.

    Attributes: `enabled` (False: always the original forward), `static_outputs`, `max_graphs`, and
    `counts`, a Counter of how calls went: "replay", "capture" (a first call, which also replays), and
    "eager:<reason>" with reason one of disabled, training, unhashable, not-cuda, devices, autograd,
    capturing, failed, max-graphs. Calls traced by torch.compile are not counted.
    """

    def __init__(self, module: nn.Module, static_outputs: bool = False, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 steps: Optional[CudaGraphSteps] = None, instance_forward: Optional[Callable] = None):
        self._module_ref = weakref.ref(module)
        # The instance attribute `forward` the module had before (restored by disable), else None: the
        # class's forward, called through the weak reference so the module and its wrapper form no cycle.
        self._instance_forward = instance_forward
        self.static_outputs = bool(static_outputs)
        self.max_graphs = int(max_graphs)
        self.enabled = True
        self.steps = steps if steps is not None else CudaGraphSteps()
        self.counts: Counter = Counter()
        self._warned: set = set()
        self.reset()

    # -- bookkeeping

    @property
    def module(self) -> nn.Module:
        module = self._module_ref()
        if module is None:
            raise ReferenceError("the module of this CudaGraphForward no longer exists")
        return module

    def reset(self) -> None:
        """Drop every graph, static buffer and the memory pool; signatures that failed may capture again."""
        self._graphs: Dict[Hashable, _Entry] = {}
        self._eager_only: set = set()
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def __code__(self):
        """The code object of the forward this wraps: `torch.compile` of an fx.GraphModule reads
        `module.forward.__code__` before tracing (a plain object has none)."""
        forward = self._instance_forward if self._instance_forward is not None else type(self.module).forward
        return forward.__code__

    def original_forward(self, *args, **kwargs):
        """The module's forward as it was before `enable_cuda_graphs`."""
        if self._instance_forward is not None:
            return self._instance_forward(*args, **kwargs)
        module = self.module
        return type(module).forward(module, *args, **kwargs)

    def _eager(self, reason: str, args, kwargs):
        self.counts["eager:" + reason] += 1
        return self.original_forward(*args, **kwargs)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, CudaGraphWarning, stacklevel=4)

    # -- the call

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.original_forward(*args, **kwargs)
        if not self.enabled:
            return self._eager("disabled", args, kwargs)
        module = self.module
        if module.training:
            return self._eager("training", args, kwargs)
        signature, tensors = _signature_and_tensors(args, kwargs)
        if signature is None:
            return self._eager("unhashable", args, kwargs)
        if not tensors or not all(self.steps.accepts(t) for t in tensors):
            return self._eager("not-cuda", args, kwargs)
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            return self._eager("devices", args, kwargs)
        if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                        or any(p.requires_grad for p in module.parameters())):
            return self._eager("autograd", args, kwargs)
        if self.steps.is_capturing(device):
            return self._eager("capturing", args, kwargs)
        key = (signature, _mode_key())
        entry = self._graphs.get(key)
        if entry is not None:
            self.counts["replay"] += 1
            return self._replay(entry, tensors)
        if key in self._eager_only:
            return self._eager("failed", args, kwargs)
        if len(self._graphs) >= self.max_graphs:
            self._warn_once("max-graphs", f"{type(module).__name__}: {len(self._graphs)} CUDA graphs captured "
                            f"(max_graphs={self.max_graphs}); calls with new input signatures run eagerly")
            return self._eager("max-graphs", args, kwargs)
        entry = self._capture(key, args, kwargs, tensors, device)
        if entry is None:
            return self._eager("failed", args, kwargs)
        self.counts["capture"] += 1
        self._graphs[key] = entry
        return self._replay(entry, tensors)  # copies the inputs again: the warm-up may have written into them

    def _replay(self, entry: _Entry, tensors: List[torch.Tensor]):
        with torch.no_grad():
            for static, tensor in zip(entry.inputs, tensors):
                if static is not tensor:
                    static.copy_(tensor)
        entry.graph.replay()
        return self._outputs(entry)

    def _outputs(self, entry: _Entry):
        if self.static_outputs:
            return entry.outputs
        with torch.no_grad():
            return _map_tensors(_clone, entry.outputs)

    def _capture(self, key, args, kwargs, tensors, device) -> Optional[_Entry]:
        """Warm up and capture the call; None (and the key remembered as eager-only) when capture failed.
        Exceptions of the warm-up are the forward's own and propagate, as an eager call's would."""
        try:
            inputs = [_static_copy(t) for t in tensors]
        except RuntimeError as error:  # e.g. an expanded input: no buffer of its strides can be written
            self._failed(key, "no static input buffer", error)
            return None
        static_args, static_kwargs = _rebuild((args, kwargs), iter(inputs))  # _flatten's order: args, kwargs

        def run():
            return self.original_forward(*static_args, **static_kwargs)

        self.steps.warm_up(run, device)
        if self._pool is None:
            self._pool = self.steps.new_pool()
        try:
            graph, outputs = self.steps.capture(run, device, self._pool)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            self._failed(key, "CUDA graph capture failed", error)
            return None
        return _Entry(graph, inputs, outputs)

    def _failed(self, key, what: str, error: Exception) -> None:
        self._eager_only.add(key)
        if not self._graphs:
            self._pool = None  # the next capture starts from a fresh pool
        self._warn_once("failed", f"{type(self.module).__name__}: {what} ({type(error).__name__}: {error}); "
                        "calls with this input signature run eagerly")

    # -- copies and pickling

    def __deepcopy__(self, memo):
        """A fresh wrapper without graphs, bound to the module's copy when the module is being copied."""
        module = self.module
        copied_module = memo.get(id(module), module)
        wrapper = CudaGraphForward(copied_module, self.static_outputs, self.max_graphs, self.steps,
                                   copy.deepcopy(self._instance_forward, memo))
        wrapper.enabled = self.enabled
        memo[id(self)] = wrapper
        return wrapper

    def __reduce__(self):
        return (_restore, (self.module, self.static_outputs, self.max_graphs, self.enabled, self._instance_forward))

    def __repr__(self) -> str:
        return (f"CudaGraphForward({type(self.module).__name__}, graphs={len(self._graphs)}, "
                f"static_outputs={self.static_outputs}, enabled={self.enabled})")


def _restore(module, static_outputs, max_graphs, enabled, instance_forward) -> CudaGraphForward:
    wrapper = CudaGraphForward(module, static_outputs, max_graphs, instance_forward=instance_forward)
    wrapper.enabled = enabled
    return wrapper


# ----------------------------------------------------------------------------------------- install/remove

def cuda_graph_forward(module: nn.Module) -> Optional[CudaGraphForward]:
    """The `CudaGraphForward` installed on `module`, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, CudaGraphForward) else None


def enable_cuda_graphs(module: nn.Module, static_outputs: bool = False, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
                       steps: Optional[CudaGraphSteps] = None) -> CudaGraphForward:
    """Make `module(...)` replay CUDA graphs (see this file's docstring); returns the installed wrapper.

    Idempotent: on a module that has a wrapper already, updates its `static_outputs` and `max_graphs`
    (and enables it) and returns it. `steps` replaces the CUDA operations (tests pass a fake).
    """
    wrapper = cuda_graph_forward(module)
    if wrapper is not None:
        wrapper.static_outputs = bool(static_outputs)
        wrapper.max_graphs = int(max_graphs)
        wrapper.enabled = True
        if steps is not None:
            wrapper.steps = steps
        return wrapper
    wrapper = CudaGraphForward(module, static_outputs, max_graphs, steps, module.__dict__.get("forward"))
    module.forward = wrapper
    return wrapper


def disable_cuda_graphs(module: nn.Module) -> None:
    """Restore the forward `module` had before `enable_cuda_graphs` and drop its graphs (no-op without)."""
    wrapper = cuda_graph_forward(module)
    if wrapper is None:
        return
    wrapper.reset()
    if wrapper._instance_forward is not None:
        module.forward = wrapper._instance_forward
    else:
        del module.forward
