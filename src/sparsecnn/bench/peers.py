"""Peer systems for `sparsecnn bench layers --peers NAME`: other projects' sparse kernels, timed on the
same layers, masks and inputs as our backends, in rows whose backend is "peer:<variant>".

A peer is not part of the package. Its adapter lives in the checkout, `benchmarks/peers/<name>.py`,
and calls code built outside the repository (e.g. `benchmarks/peers/build_sputnik.sh`); it is loaded
by path only when asked for, so the package never imports it. An adapter defines
`load_peer() -> Peer`, which raises FileNotFoundError saying what is missing (the built library, the
setting that points at it).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from sparsecnn.core.spec import ConvSpec

PEER_PREFIX = "peer:"  # rows of a peer's variant V have backend PEER_PREFIX + V
# src/sparsecnn/bench/peers.py -> the checkout's root, three folders up from this one
PEERS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "peers"


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer system, ready to run (its library loaded).

    variants: what it times per layer, each a row of backend "peer:<variant>" (e.g. the whole
    convolution, and its kernel alone). dtypes: the dtype names it runs ("fp32", "fp16", ...).
    unsupported_reason(spec, dtype, device_type): why it cannot run that layer, None if it can.
    config(variant, spec, dtype): the row's config dict (what the variant includes, versions).
    bind(variant, weight, x, spec, dtype): all preparation done once (weight format, buffers);
    returns the call to time, which returns the output (N, K, P, Q) in x's dtype. weight: (K, C, R, S)
    dense with zeros; x: (N, C, H, W) contiguous; both of dtype name `dtype`'s torch dtype.
    """

    name: str
    variants: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    unsupported_reason: Callable[[ConvSpec, str, str], Optional[str]]
    config: Callable[[str, ConvSpec, str], dict]
    bind: Callable[[str, torch.Tensor, torch.Tensor, ConvSpec, str], Callable[[], torch.Tensor]]


def common_unsupported_reason(peer: str, dtypes: Sequence[str], spec: ConvSpec, dtype: str, device_type: str,
                              needs_cuda: bool, dtype_note: str = "") -> Optional[str]:
    """The checks every peer makes first, None when they pass: dtype name `dtype` among `dtypes`
    (dtype_note: why not others), a CUDA device when needs_cuda (a CPU stand-in runs anywhere),
    groups 1 and no dilation (a peer runs plain convolutions only)."""
    if dtype not in dtypes:
        return f"{peer} runs {', '.join(dtypes)}, not {dtype}" + (f" ({dtype_note})" if dtype_note else "")
    if needs_cuda and device_type != "cuda":
        return f"{peer} needs a CUDA device"
    if spec.groups != 1 or spec.dilation != (1, 1):
        return f"{peer} runs no grouped and dilated convolutions"
    return None


def peer_names(folder: Path = PEERS_DIR) -> List[str]:
    """Names of the adapters in `folder` (each <name>.py; files starting with "_" are helpers)."""
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))


def peer_module(name: str, folder: Path = PEERS_DIR) -> ModuleType:
    """The adapter module `folder`/<name>.py, imported once by path (as sparsecnn_peer_<name>).
    FileNotFoundError naming the folder and the adapters it holds when there is none."""
    path = folder / f"{name}.py"
    if not path.is_file():
        where = f"{folder} holds {', '.join(peer_names(folder)) or 'none'}" if folder.is_dir() else \
            f"{folder} does not exist (adapters live in a checkout's benchmarks/peers)"
        raise FileNotFoundError(f"no peer adapter {name!r}: {where}")
    module_name = f"sparsecnn_peer_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before exec: dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def load_peer(name: str, folder: Path = PEERS_DIR) -> Peer:
    """The Peer of adapter `name`, its library loaded (FileNotFoundError when either is missing)."""
    peer = peer_module(name, folder).load_peer()
    if not isinstance(peer, Peer):
        raise TypeError(f"{folder / name}.py: load_peer() returned {type(peer).__name__}, not a Peer")
    return peer
