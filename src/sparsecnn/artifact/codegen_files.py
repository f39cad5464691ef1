"""Generated code in an artefact: the PTX and cubins of the model's layers whose backend generates
code per layer (`Backend.compile_kernels`: `codegen`, `unrolled`).

Compiling replays each such layer's compile through a disk cache that also writes every file it
reads or makes into OUT/codegen/, in the layout of `core.toolchain.DiskCache`
(<key[:2]>/<key>.<suffix>). Loading copies the missing ones into the local codegen cache (atomic
writes), so binding the layers finds every kernel there and runs neither nvcc nor ptxas. The keys
include the toolchain's versions and flags, so the files serve only the same toolchain; the
manifest records it (`toolchain`), and another one re-tunes.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Iterable, Optional

from sparsecnn.backends import get_backend
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.toolchain import DiskCache, ToolchainError, decode_entry, toolchain_id
from sparsecnn.nn import SparseConv2d

CODEGEN_DIR = "codegen"


class _RecordingCache(DiskCache):
    """The local codegen cache (`source`), with every file read or written also copied under `root`."""

    def __init__(self, root: Path, source: DiskCache):
        super().__init__(root)
        self.source = source

    def get(self, key: str, suffix: str) -> Optional[bytes]:
        data = self.source.get(key, suffix)
        if data is not None:
            super().put(key, suffix, data)
        return data

    def put(self, key: str, suffix: str, data: bytes) -> None:
        self.source.put(key, suffix, data)
        super().put(key, suffix, data)

    def exclusive(self, key: str):
        return self.source.exclusive(key)  # the lock guards the local cache; no lock file in the artefact


def record_kernels(layer: SparseConv2d, spec: ConvSpec, directory: Path) -> None:
    """Copy the generated kernels of one layer for inputs of `spec` into `directory`/codegen (compiled
    now only if the local cache lacks them: the layer was bound, so it normally has them), through its
    backend's `compile_kernels`."""
    get_backend(layer.backend).compile_kernels(
        layer.packed_weight(), spec, layer.config, layer.weight.dtype, layer.bias is not None, layer.relu_only,
        _RecordingCache(directory / CODEGEN_DIR, DiskCache()))


def generates_code(layer: SparseConv2d) -> bool:
    """Whether the layer's backend compiles code per layer (kernels an artefact carries)."""
    return get_backend(layer.backend).compile_kernels is not None


def install_codegen(directory: Path, names: Iterable[str]) -> int:
    """Copy the artefact's codegen files among `names` (manifest paths) into the local codegen cache,
    skipping those it has; returns how many were copied."""
    cache, copied = DiskCache(), 0
    for name in names:
        parts = PurePosixPath(name).parts
        if len(parts) != 3 or parts[0] != CODEGEN_DIR:
            continue
        key, _, suffix = parts[2].partition(".")
        data = decode_entry((directory / name).read_bytes())
        if data is not None and not cache.path(key, suffix).exists():  # None: an older format, recompiled
            cache.put(key, suffix, data)
            copied += 1
    return copied


def current_toolchain() -> str:
    """`toolchain_id()`, or why there is none here."""
    try:
        return toolchain_id()
    except ToolchainError as error:
        return f"unavailable ({error})"
