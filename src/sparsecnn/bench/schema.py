"""The results schema: one JSON object per measurement, one object per line of a `.jsonl` file.

Every row has exactly the keys in `FIELDS`. Layer rows (`kind` "layer") carry the layer's shape and
`model` null; model rows (`kind` "model") carry `model` and `N` (the batch), with `layer` and the other
shape fields null. Times are milliseconds; `rel_err` is ||out - ref|| / ||ref|| against a float64
reference; `floor_ms` is the roofline lower bound (`roofline.floor_ms`), null where none applies.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Tuple, Union

import torch

PathLike = Union[str, os.PathLike]

# dtype name -> (torch dtype the data is stored in, whether TF32 math is allowed)
DTYPES: Dict[str, Tuple[torch.dtype, bool]] = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "fp16": (torch.float16, False),
    "bf16": (torch.bfloat16, False),
}
KINDS = ("layer", "model")
# "gpu": a layer's GPU time alone, the CPU's launch overhead hidden (as under CUDA graphs)
MODES = ("eager", "cudagraph", "compile", "gpu")

FIELDS: Tuple[str, ...] = (
    "run", "kind", "device", "torch", "cudnn", "triton", "driver", "commit", "date",
    "suite", "layer", "model", "N", "C", "K", "H", "W", "R", "S", "stride", "padding",
    "dtype", "sparsity", "pattern", "backend", "config", "mode",
    "median_ms", "p20_ms", "p80_ms", "rel_err", "floor_ms",
)
_SHAPE_FIELDS = ("C", "K", "H", "W", "R", "S", "stride", "padding")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype data of dtype name `name` ("fp32", "tf32", "fp16", "bf16") is stored in."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name][0]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_or_pair(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_int, value)))


def _is_time(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0


def _optional(check):
    return lambda value: value is None or check(value)


def _string(value: Any) -> bool:
    return isinstance(value, str)


# field -> (check, what the field must be, for the error message)
_CHECKS = {
    "run": (_string, "a string"),
    "kind": (lambda v: v in KINDS, f"one of {KINDS}"),
    "device": (_string, "a string"),
    "torch": (_string, "a string"),
    "cudnn": (_optional(_is_int), "an int or null"),
    "triton": (_optional(_string), "a string or null"),
    "driver": (_optional(_string), "a string or null"),
    "commit": (_string, "a string"),
    "date": (_string, "a string"),
    "suite": (_optional(_string), "a string or null"),
    "layer": (_optional(_string), "a string or null"),
    "model": (_optional(_string), "a string or null"),
    "N": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    **{name: (_optional(lambda v: _is_int(v) and v >= 1), "an int >= 1 or null") for name in "CKHWRS"},
    "stride": (_optional(_is_int_or_pair), "an int, a pair of ints, or null"),
    "padding": (_optional(_is_int_or_pair), "an int, a pair of ints, or null"),
    "dtype": (lambda v: v in DTYPES, f"one of {tuple(DTYPES)}"),
    "sparsity": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "pattern": (_string, "a string"),
    "backend": (_string, "a string"),
    "config": (_optional(lambda v: isinstance(v, dict)), "a dict or null"),
    "mode": (lambda v: v in MODES, f"one of {MODES}"),
    "median_ms": (_is_time, "a finite number >= 0"),
    "p20_ms": (_is_time, "a finite number >= 0"),
    "p80_ms": (_is_time, "a finite number >= 0"),
    "rel_err": (_optional(lambda v: _is_number(v) and v >= 0), "a number >= 0 (inf allowed) or null"),
    "floor_ms": (_optional(_is_time), "a finite number >= 0 or null"),
}


def _check_kind(row: Dict[str, Any]) -> None:
    """Layer rows name a layer and give its shape; model rows name a model and leave the layer null."""
    if row["kind"] == "layer":
        if row["layer"] is None:
            raise ValueError("field 'layer' must be a string in a layer row")
        if row["model"] is not None:
            raise ValueError("field 'model' must be null in a layer row")
        for name in _SHAPE_FIELDS:
            if row[name] is None:
                raise ValueError(f"field {name!r} must not be null in a layer row")
    else:
        if row["model"] is None:
            raise ValueError("field 'model' must be a string in a model row")
        if row["layer"] is not None:
            raise ValueError("field 'layer' must be null in a model row")


def validate_row(row: Dict[str, Any]) -> None:
    """Raise ValueError naming the first bad field of `row`: a missing or extra key, a wrong type,
    a value outside its enum, or a null where the row's kind needs a value."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be a dict, got {type(row).__name__}")
    missing = [name for name in FIELDS if name not in row]
    if missing:
        raise ValueError(f"row is missing field(s) {', '.join(map(repr, missing))}")
    extra = sorted(set(row) - set(FIELDS))
    if extra:
        raise ValueError(f"row has unknown field(s) {', '.join(map(repr, extra))}")
    for name in FIELDS:
        check, expected = _CHECKS[name]
        if not check(row[name]):
            raise ValueError(f"field {name!r} must be {expected}, got {row[name]!r}")
    _check_kind(row)


def write_jsonl(rows: Iterable[Dict[str, Any]], path: PathLike, append: bool = True) -> Path:
    """Validate every row, then write one JSON object per line to `path` (appended unless
    `append=False`); parent directories are created. Returns the path."""
    rows = list(rows)
    for i, row in enumerate(rows):
        try:
            validate_row(row)
        except ValueError as error:
            raise ValueError(f"row {i}: {error}") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for row in rows:
            f.write(json.dumps({name: row[name] for name in FIELDS}) + "\n")
    return path


def read_jsonl(path: PathLike) -> List[Dict[str, Any]]:
    """The rows of a results file, each validated (ValueError names the line); blank lines skipped."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                validate_row(row)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
            rows.append(row)
    return rows
