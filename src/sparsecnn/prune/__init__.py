"""Pruning: dense weights with exact zeros, plus {module path: bool mask} dicts."""
from .dlmc import apply_dlmc_, dlmc_layer_mask, dlmc_root, dlmc_sets, load_dlmc_masks
from .magnitude import (
    absorb_torch_prune_,
    magnitude_mask,
    masks_from_weights,
    prunable_layers,
    prune_magnitude_,
)
from .report import format_sparsity_report, sparsity_report

__all__ = [
    "absorb_torch_prune_",
    "apply_dlmc_",
    "dlmc_layer_mask",
    "dlmc_root",
    "dlmc_sets",
    "format_sparsity_report",
    "load_dlmc_masks",
    "magnitude_mask",
    "masks_from_weights",
    "prunable_layers",
    "prune_magnitude_",
    "sparsity_report",
]
