"""Small torch.fx queries shared by the graph passes (`fuse`, `merge`) and `layout`."""
from __future__ import annotations

import operator
from collections import Counter
from typing import Optional

from torch import fx, nn


def called_module(gm: fx.GraphModule, node) -> Optional[nn.Module]:
    """The module `node` calls, or None if it is not a call_module node."""
    if isinstance(node, fx.Node) and node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def module_calls(gm: fx.GraphModule) -> Counter:
    """How many call sites each module has: a module called twice shares its weights and activation."""
    return Counter(node.target for node in gm.graph.nodes if node.op == "call_module")


def channel_slice(node) -> bool:
    """Whether `node` is `x[:, a:b]` (what `merge` leaves where a merged conv's outputs were used)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    index = node.args[1]
    return (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
            and isinstance(index[1], slice) and index[1].step is None)
