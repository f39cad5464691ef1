"""`manifest.json`: what an artefact holds, checked before anything else is read; atomic directories.

Top-level fields: "format" ("sparsecnn-artifact"), "version", "sparsecnn" (package version),
"created" (ISO-8601 UTC), "model" {"name", "num_classes", "input_shape" [N, C, H, W]}, "policy"
(precision policy name), "run_mode" ("graph" or "eager": what tuning timed; absent in older
artefacts: "graph"), "backends" (the tuning candidates asked for, null for the default set),
"device" ("cuda" or "cpu": where it was tuned), "environment" (the autotuner's fingerprint of that
device), "codegen_toolchain" (nvcc/ptxas versions and flags when a layer runs `codegen`, else
null), "fuse" (the `FuseReport` of `prepare_for_inference`), "tuning" {"max_rel_error",
"unreached"}, "layers" {conv path: decision, see `compile`}, "linears" {linear path: splits} (version 2
on), "shortcuts" (the folded projection shortcuts; optional), "weights" (the tensor file's name) and
"files" {relative path: {"sha256", "bytes"}} for every other file of the artefact.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Dict

from sparsecnn.artifact.errors import ArtifactError
from sparsecnn.artifact.tensors import file_record

FORMAT = "sparsecnn-artifact"
VERSION = 3  # 2: "linears" (SplitKLinear splits); 3: tensorcore weights carry their unit_code table
MANIFEST = "manifest.json"
_FIELDS = {"format": str, "version": int, "model": dict, "policy": str, "device": str, "environment": dict,
           "fuse": dict, "tuning": dict, "layers": dict, "linears": dict, "weights": str, "files": dict}


def write_manifest(directory: Path, manifest: Dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False))


def _check_model(model: dict, path: Path) -> None:
    shape = model.get("input_shape")
    if not isinstance(model.get("name"), str) or not (
            isinstance(shape, list) and len(shape) >= 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise ArtifactError(f"{path}: 'model' must hold a name and an input_shape of positive ints, got {model!r}")


def read_manifest(directory: Path) -> Dict[str, Any]:
    """The parsed, checked manifest of the artefact in `directory`; ArtifactError naming the file
    and the problem when it is missing, truncated, not JSON, of another format or version, or lacks
    a field."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise ArtifactError(f"{directory} is not a directory (expected a sparsecnn artefact)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ArtifactError(f"{path} is missing: {directory} is not a sparsecnn artefact") from error
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ArtifactError(f"{path} is corrupt or truncated ({type(error).__name__}: {error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a sparsecnn artefact manifest (format "
                            f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise ArtifactError(f"{path}: artefact version {manifest.get('version')!r}, this sparsecnn reads {VERSION}")
    for field, kind in _FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            raise ArtifactError(f"{path}: field {field!r} must be a {kind.__name__}, got {manifest.get(field)!r}")
    _check_model(manifest["model"], path)
    if manifest["weights"] not in manifest["files"]:
        raise ArtifactError(f"{path}: the weights file {manifest['weights']!r} is not among the listed files")
    return manifest


def _inside(directory: Path, name: str) -> Path:
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ArtifactError(f"{directory / MANIFEST}: file name {name!r} points outside the artefact")
    return directory / relative


def verify_files(directory: Path, manifest: Dict[str, Any]) -> None:
    """Every listed file is present with its size and sha256; ArtifactError naming the first that is not."""
    for name, record in manifest["files"].items():
        path = _inside(directory, name)
        if not isinstance(record, dict) or not {"sha256", "bytes"} <= set(record):
            raise ArtifactError(f"{directory / MANIFEST}: file entry {name!r} lacks sha256/bytes")
        if not path.is_file():
            raise ArtifactError(f"{path} is missing from the artefact")
        found = file_record(path)
        if found["bytes"] != record["bytes"]:
            raise ArtifactError(f"{path} is truncated or damaged: {found['bytes']} bytes, the manifest says "
                                f"{record['bytes']}")
        if found["sha256"] != record["sha256"]:
            raise ArtifactError(f"{path} is damaged: its sha256 differs from the manifest's")


def list_files(directory: Path) -> Dict[str, Dict[str, object]]:
    """{relative path: record} of every file under `directory` except the manifest."""
    return {path.relative_to(directory).as_posix(): file_record(path)
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}


def new_directory(out_dir: Path) -> Path:
    """An empty temporary directory beside `out_dir` (same file system, so it can be renamed onto it)."""
    temporary = out_dir.parent / f".{out_dir.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    temporary.mkdir(parents=True)  # not mkdtemp, whose 0700 would make the artefact private
    return temporary


def _is_artefact(path: Path) -> bool:
    return path.is_dir() and (not any(path.iterdir()) or (path / MANIFEST).is_file())


def _swap(temporary: Path, out_dir: Path) -> None:
    """Rename `temporary` to `out_dir`; an existing `out_dir` is first renamed aside (so its contents
    are judged where no other writer can change them) and deleted once replaced."""
    if not out_dir.exists():
        os.replace(temporary, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    previous = old / "artefact"
    try:
        os.replace(out_dir, previous)
    except OSError:
        old.rmdir()
        raise
    if not _is_artefact(previous):
        try:
            os.replace(previous, out_dir)
        except OSError as error:
            raise ArtifactError(f"output {out_dir} was not a sparsecnn artefact and could not be put back: "
                                f"it is now {previous} ({error})") from error
        old.rmdir()
        raise ArtifactError(f"output {out_dir} exists and is not a sparsecnn artefact: refusing to replace it")
    try:
        os.replace(temporary, out_dir)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def publish(temporary: Path, out_dir: Path, attempts: int = 100) -> None:
    """Move the finished `temporary` directory to `out_dir`, replacing an older artefact there.

    Readers see the old artefact or the new one, never a mix (only, between two renames, briefly
    none); when several processes publish at once, one complete artefact wins. A non-empty
    `out_dir` that is not an artefact is left alone: ArtifactError."""
    for attempt in range(attempts):
        try:
            _swap(temporary, out_dir)
            return
        except OSError:  # another writer renamed out_dir between our renames: wait a moment, try again
            if attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0.001, 0.01))
