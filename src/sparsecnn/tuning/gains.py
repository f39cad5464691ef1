"""The measured gain of backend `blocks` per conv: what OptPrune's selection rule
(`prune.selection`) re-prunes by."""
from __future__ import annotations

import copy
from typing import Dict, List

from torch import nn

from sparsecnn.tuning.sparsify import sparsify_

BLOCKS = "blocks"


def block_gains(model: nn.Module, example_inputs: tuple, convs: List[str]) -> Dict[str, float]:
    """conv path -> dense ms / fastest `blocks` ms on the conv's real input from `model(*example_inputs)`,
    as `sparsify_` times them (on the inputs' device; a copy of `model` is tuned, `model` is left
    alone); 0.0 where `blocks` did not run or the tuner dropped it after one run as several times
    slower than dense (its gain is then far below any useful threshold)."""
    names = set(convs)
    tuned = sparsify_(copy.deepcopy(model).eval(), example_inputs, backends=[BLOCKS],
                      filter_fn=lambda name, module: name in names, progress=False)
    gains = {name: 0.0 for name in convs}
    for result in tuned.sparsecnn_report.layers:
        blocks_ms = [ms for label, ms in result.times_ms.items() if label.startswith(BLOCKS)]
        if blocks_ms and result.name in gains:
            gains[result.name] = result.dense_ms / min(blocks_ms)
    return gains
