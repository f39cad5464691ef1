"""Restartable training runs: the state after every epoch in one file, resumed where it stopped.

A run is a sequence of training phases (`train_epochs` calls: dense training, ADMM, fine-tuning,
...), numbered in the order the run makes them. `RunState(path)` is passed to each phase through
`TrainConfig.state`; after every epoch rank 0 writes, atomically (a temporary file, then
`os.replace`), the phase's number and description, epochs and steps done, the model's state dict,
the masks, the optimiser, learning-rate schedule and gradient scaler states, the batches' own
state where they have `state_dict()` (`data.Batches`, torchdata's StatefulDataLoader), the extra
state of the method (ADMM's Z, U and rho) and torch's random generators. The evolutionary search
is one phase whose state is recorded after every generation instead of every epoch
(`evolutionary.evolutionary_prune_`).

Run again with the same code and a `RunState` on the same file, each phase the file records as
finished returns at once (the last one loads its weights and masks), and the phase in progress
loads everything and goes on from the next epoch: the resumed run ends with the weights and masks
of an uninterrupted one. A file written by a run whose phases, or the settings a phase records
with `begin`, differ is refused.

The file is read with `torch.load(weights_only=True)`: tensors, numbers, strings and containers.
"""
from __future__ import annotations

import math
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from sparsecnn.prune.distributed import barrier, is_main

FORMAT = "sparsecnn-run-state"
VERSION = 1
Masks = Dict[str, torch.Tensor]


class RunState:
    """The per-epoch state file of one run at `path` (str or os.PathLike); read once, here, when it
    exists. Use one `RunState` per run: it counts the phases the run starts."""

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"RunState path must be a non-empty str or path, got {path!r}")
        self.path = Path(path)
        self._next_phase = 0
        self._saved = _read(self.path) if self.path.exists() else None
        self._descriptions: Dict[int, str] = dict(self._saved["descriptions"]) if self._saved else {}
        self._finished: Dict[int, float] = dict(self._saved["finished"]) if self._saved else {}
        self._values: Dict[str, Any] = dict(self._saved.get("values", {})) if self._saved else {}
        self._settings: Dict[int, dict] = dict(self._saved.get("settings", {})) if self._saved else {}

    def begin(self, description: str, settings: Optional[Dict[str, Any]] = None) -> int:
        """Number the next phase of the run; ValueError when the file's phase of that number has
        another description or other `settings` (the file belongs to a different run).

        settings: {name: value} the phase's saved state depends on beyond what its description
        says (numbers, strings, bools, None, and lists, tuples and dicts of them); the error names
        every one that differs from the file's."""
        phase, self._next_phase = self._next_phase, self._next_phase + 1
        recorded = self._descriptions.get(phase)
        if recorded is not None and recorded != description:
            raise ValueError(f"run state {self.path}: phase {phase} is {recorded!r} there but {description!r} "
                             f"in this run; delete the file or use another path")
        settings = dict(settings or {})
        # A phase the file does not hold, or a file from before settings were recorded, has none to compare.
        differing = _differing(self._settings.get(phase, settings), settings)
        if differing:
            raise ValueError(f"run state {self.path}: phase {phase} ({description!r}) ran with {differing}; delete "
                             f"the file or use another path")
        self._descriptions[phase] = description
        self._settings[phase] = settings
        return phase

    def remember(self, key: str, compute: Callable[[], Any]) -> Any:
        """A value the run computes between phases (e.g. the accuracy before pruning): `compute()`
        the first time, saved with the next epoch's state; the saved value when resumed, where the
        finished phases it depends on are skipped and the model does not hold their weights."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]

    def resume(self, phase: int, parts: Dict[str, Any], masks: Optional[Masks]) -> Optional[dict]:
        """Restore `phase` from the file: None when the file has nothing of it (train from the
        start); else {"epoch", "step", "loss"}, epochs and steps done and the last epoch's mean
        loss, with the weights, masks (updated in place), `parts` (objects with
        `load_state_dict`: "model", "optimiser", ...) and random generators loaded when the
        phase is the file's latest; a finished earlier phase loads nothing."""
        saved = self._saved
        if saved is None or phase > saved["phase"]:
            return None
        if phase < saved["phase"]:
            return {"epoch": math.inf, "step": 0, "loss": self._finished[phase]}
        for name, part in parts.items():
            if part is not None and name in saved["parts"]:
                part.load_state_dict(saved["parts"][name])
        if masks is not None:
            device = next(iter(masks.values())).device if masks else torch.device("cpu")
            masks.clear()
            masks.update({name: mask.to(device) for name, mask in saved["masks"].items()})
        torch.set_rng_state(saved["rng"]["cpu"])
        if "cuda" in saved["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["rng"]["cuda"])
        return {"epoch": saved["epoch"], "step": saved["step"], "loss": saved["loss"]}

    def save(self, phase: int, epoch: int, finished: bool, step: int, loss: float, parts: Dict[str, Any],
             masks: Optional[Masks], device: torch.device) -> None:
        """Record `phase` after `epoch` epochs (`finished`: its last) and `step` steps with last
        mean `loss`; rank 0 writes the file atomically, every rank then waits for it."""
        if finished:
            self._finished[phase] = loss
        if is_main():
            rng = {"cpu": torch.get_rng_state()}
            if device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(device)
            payload = {
                "format": FORMAT, "version": VERSION, "phase": phase, "epoch": epoch, "step": step,
                "loss": loss, "descriptions": dict(self._descriptions), "finished": dict(self._finished),
                "values": dict(self._values), "settings": dict(self._settings),
                "parts": {name: part.state_dict() for name, part in parts.items() if part is not None},
                "masks": {name: mask.detach().to("cpu", torch.bool) for name, mask in (masks or {}).items()},
                "rng": rng,
            }
            atomic_save(payload, self.path)
        barrier()


def atomic_save(payload: Any, path: str | os.PathLike) -> None:
    """`torch.save(payload)` to a temporary file beside `path`, then `os.replace` onto it: a reader
    (or a run killed while writing) sees the old file or the new one, never a part."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(payload, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _differing(recorded: Dict[str, Any], settings: Dict[str, Any]) -> str:
    """Each name whose value differs, as "a=1 there but 2 here" ("unset" where one side lacks
    it), joined by ", "; "" when none does."""
    unset = object()
    parts = []
    for name in sorted(set(recorded) | set(settings)):
        there, here = recorded.get(name, unset), settings.get(name, unset)
        if there != here:
            parts.append(f"{name}={'unset' if there is unset else repr(there)} there but "
                         f"{'unset' if here is unset else repr(here)} here")
    return ", ".join(parts)


def _read(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(f"run state {path} is not readable as a sparsecnn run state: {error}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a sparsecnn run state file")
    if payload.get("version") != VERSION:
        raise ValueError(f"run state {path}: version {payload.get('version')!r}, expected {VERSION}")
    return payload
