"""The artefact's tensor file and checksums: safetensors when installed, else a weights-only torch file.

`weights.safetensors` (safetensors: no code at all) or `weights.pt` (`torch.save` of a flat
{name: tensor} dict, read back with `torch.load(weights_only=True)`, which refuses every pickled
object but tensors and plain containers). Which one an artefact holds is named in its manifest;
reading picks the reader by the file's suffix, so both are read wherever they were written.
"""
from __future__ import annotations

import hashlib
import importlib.util
import pickle
from pathlib import Path
from typing import Dict

import torch

from sparsecnn.artifact.errors import ArtifactError

_ALIGNMENT = 64  # bytes: what torch's CPU allocator guarantees
WEIGHTS_FORMATS = {"safetensors": "weights.safetensors", "pt": "weights.pt"}


def default_weights_format() -> str:
    """"safetensors" when the package is importable, else "pt"."""
    return "safetensors" if importlib.util.find_spec("safetensors") is not None else "pt"


def _standalone(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU tensors that each own their whole storage (safetensors refuses shared memory, and
    torch.save would write a view's entire storage)."""
    result, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != tensor.nbytes or tensor.numel() == 0:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        result[name] = tensor
    return result


def write_tensors(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    """Write {name: tensor} to `path`, in the format its suffix names (.safetensors or .pt)."""
    tensors = _standalone(tensors)
    if path.suffix == ".safetensors":
        from safetensors.torch import save

        path.write_bytes(save(tensors))  # not save_file, which makes the file private (0600)
    elif path.suffix == ".pt":
        torch.save(tensors, path)
    else:
        raise ArtifactError(f"weights file {path.name}: expected a .safetensors or .pt name")


def read_tensors(path: Path, aligned: bool = True) -> Dict[str, torch.Tensor]:
    """{name: CPU tensor} from a `write_tensors` file; never runs pickled code. aligned: copy the
    tensors of a safetensors file that do not start on a 64-byte boundary (pass False when they
    are about to be copied to a GPU anyway)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as error:
            raise ArtifactError(f"{path} is a safetensors file: install the safetensors package") from error
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as error:  # safetensors raises its own SafetensorError for damaged files
            raise ArtifactError(f"{path}: not a readable safetensors file ({error})") from error
        # Tensors inside the file sit at any byte offset; CPU kernels pick other (vector) code paths,
        # with other rounding, for unaligned data, so the loaded model would not match bit for bit.
        return {name: tensor if not aligned or tensor.data_ptr() % _ALIGNMENT == 0 else tensor.clone()
                for name, tensor in tensors.items()}
    if path.suffix != ".pt":
        raise ArtifactError(f"weights file {path.name}: expected a .safetensors or .pt name")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ArtifactError(f"{path}: refused to load, it holds objects other than tensors and plain containers "
                            f"(weights_only=True): {error}") from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ArtifactError(f"{path}: not a readable torch file ({error})") from error
    if not isinstance(payload, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in payload.items()):
        raise ArtifactError(f"{path}: expected a flat {{name: tensor}} dict")
    return payload


def file_record(path: Path) -> Dict[str, object]:
    """{"sha256", "bytes"} of a file, as the manifest lists it."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}
