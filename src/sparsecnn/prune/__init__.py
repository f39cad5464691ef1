"""Pruning: dense weights with exact zeros, plus {module path: bool mask} dicts."""
from sparsecnn.prune.admm import admm_prune_, project_onto_sparsity
from sparsecnn.prune.checkpoint import load_pruned, save_pruned
from sparsecnn.prune.dlmc import apply_dlmc_, dlmc_layer_mask, dlmc_root, dlmc_sets, load_dlmc_masks
from sparsecnn.prune.evolutionary import EvolutionSettings, evolutionary_prune_
from sparsecnn.prune.gradual import gradual_prune_, polynomial_sparsity
from sparsecnn.prune.magnitude import (absorb_torch_prune_, magnitude_mask, masks_from_weights, prunable_layers, prune_magnitude_)
from sparsecnn.prune.methods import get_method, method_names, prune_and_finetune, prune_with, register_method
from sparsecnn.prune.quantize import QUANTIZERS
from sparsecnn.prune.report import format_sparsity_report, sparsity_report
from sparsecnn.prune.resume import RunState
from sparsecnn.prune.reprune import benefits, knapsack, reprune_, reprune_layer
from sparsecnn.prune.selection import SelectionConfig, SelectionReport, layers_to_reprune, search_b3
from sparsecnn.prune.unit_selection import UnitSelectionConfig, UnitSelectionReport, search_units, unit_plans
from sparsecnn.prune.targets import layer_sparsities, pruned_layers
from sparsecnn.prune.tiles import TileDecomposition, TileGroup, TileParams, reprune_tiles, reprune_tiles_
from sparsecnn.prune.training import TrainConfig, classification_loss, top1_evaluator, train_epochs

__all__ = [
    "EvolutionSettings",
    "TileDecomposition",
    "TileGroup",
    "TileParams",
    "TrainConfig",
    "QUANTIZERS",
    "RunState",
    "SelectionConfig",
    "SelectionReport",
    "UnitSelectionConfig",
    "UnitSelectionReport",
    "absorb_torch_prune_",
    "admm_prune_",
    "apply_dlmc_",
    "benefits",
    "classification_loss",
    "dlmc_layer_mask",
    "dlmc_root",
    "dlmc_sets",
    "evolutionary_prune_",
    "format_sparsity_report",
    "get_method",
    "gradual_prune_",
    "knapsack",
    "layers_to_reprune",
    "layer_sparsities",
    "load_dlmc_masks",
    "load_pruned",
    "magnitude_mask",
    "masks_from_weights",
    "method_names",
    "polynomial_sparsity",
    "project_onto_sparsity",
    "prunable_layers",
    "prune_magnitude_",
    "prune_and_finetune",
    "prune_with",
    "pruned_layers",
    "register_method",
    "reprune_",
    "reprune_layer",
    "search_b3",
    "search_units",
    "reprune_tiles",
    "reprune_tiles_",
    "save_pruned",
    "sparsity_report",
    "top1_evaluator",
    "train_epochs",
    "unit_plans",
]
