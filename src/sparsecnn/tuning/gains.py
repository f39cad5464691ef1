"""Measured gains per conv that `reprune-select` re-prunes by: backend `blocks`'s (OptPrune's rule,
`prune.selection`) and backend `tensorcore`'s on each unit shape (`prune.unit_selection`)."""
from __future__ import annotations

import copy
from typing import Dict, List

from torch import nn

from sparsecnn.tuning.sparsify import sparsify_

BLOCKS = "blocks"
TENSORCORE = "tensorcore"


def block_gains(model: nn.Module, example_inputs: tuple, convs: List[str]) -> Dict[str, float]:
    """conv path -> dense ms / fastest `blocks` ms on the conv's real input from `model(*example_inputs)`,
    as `sparsify_` times them (on the inputs' device; a copy of `model` is tuned, `model` is left
    alone); 0.0 where `blocks` did not run or the tuner dropped it after one run as several times
    slower than dense (its gain is then far below any useful threshold)."""
    return _fastest_gains(model, example_inputs, convs, BLOCKS)


def _fastest_gains(model: nn.Module, example_inputs: tuple, convs: List[str], backend: str) -> Dict[str, float]:
    """conv path -> dense ms / fastest `backend` ms, as `sparsify_` times them on a copy of `model`
    (0.0 where `backend` did not run or was dropped)."""
    names = set(convs)
    tuned = sparsify_(copy.deepcopy(model).eval(), example_inputs, backends=[backend],
                      filter_fn=lambda name, module: name in names, progress=False)
    gains = {name: 0.0 for name in convs}
    for result in tuned.sparsecnn_report.layers:
        times = [ms for label, ms in result.times_ms.items() if label.startswith(backend)]
        if times and result.name in gains:
            gains[result.name] = result.dense_ms / min(times)
    return gains



def tensorcore_gains(model: nn.Module, example_inputs: tuple, convs: List[str]) -> Dict[str, float]:
    """conv path -> dense ms / fastest `tensorcore` ms, as `block_gains` for backend `tensorcore`:
    what `reprune-select` measures on each unit shape's re-pruned copy (`prune.unit_selection`);
    0.0 where `tensorcore` did not run (a CPU without TRITON_INTERPRET=1, an fp32 policy without
    TF32, a config the GPU refused)."""
    return _fastest_gains(model, example_inputs, convs, TENSORCORE)
