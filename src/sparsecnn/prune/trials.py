"""The accuracy-budgeted search both `reprune-select` rules share (`selection.search_b3`,
`unit_selection.search_units`): re-prune a copy per candidate, re-train it, keep the first within
the budget."""
from __future__ import annotations

import copy
from typing import Callable, Iterable, List, Optional, Tuple, TypeVar

from torch import nn

from sparsecnn.prune.distributed import broadcast_tensors_
from sparsecnn.prune.magnitude import Masks
from sparsecnn.prune.training import apply_masks_

Candidate = TypeVar("Candidate")


def first_within_budget(model: nn.Module, masks: Masks, candidates: Iterable[Candidate],
                        remask: Callable[[nn.Module, Candidate], Masks], retrain: Callable[[nn.Module, Masks], None],
                        top1: Callable[[nn.Module], float],
                        budget: float) -> Tuple[Masks, float, List[Tuple[Candidate, float]], Optional[Candidate]]:
    """Try `candidates` in order on copies of `model`: `remask(copy, candidate)` re-prunes the copy
    in place and returns its masks (rank 0's are broadcast), then `retrain(copy, masks)` and
    `top1(copy)`. The first within `budget` top-1 points of `top1(model)` is loaded into `model`.
    Returns (its masks, or `masks` when none is within; the baseline top-1; each candidate tried
    with its top-1; the candidate kept or None)."""
    baseline = top1(model)
    trials: List[Tuple[Candidate, float]] = []
    for candidate in candidates:
        trial = copy.deepcopy(model)
        trial_masks = broadcast_tensors_(remask(trial, candidate))  # rank 0's re-pruning decisions
        apply_masks_(trial, trial_masks)
        retrain(trial, trial_masks)
        trials.append((candidate, top1(trial)))
        if trials[-1][1] >= baseline - budget:
            model.load_state_dict(trial.state_dict())
            return trial_masks, baseline, trials, candidate
    return masks, baseline, trials, None
