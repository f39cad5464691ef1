"""Each conv's input and residual memory format, and the choice tuning makes, while the zoo ResNet-50
(DLMC masks re-pruned into channel-run tiles, fp16, N=32) is tuned from an empty decision cache on a
GPU; then the whole-model check. For finding why layers are timed slower in tuning than alone.

Usage (GPU): PYTHONPATH=src python scripts/tuning_layouts.py
"""
import os
import tempfile

import torch

import sparsecnn
from sparsecnn.bench.models import _input, _pruned_model, _round_model_
from sparsecnn.tuning import sparsify as tuning_pass

seen = []
_tune = tuning_pass._LayerTuning._tune


def _layout(tensor):
    if tensor is None:
        return None
    return "NHWC" if tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous() else "NCHW"


def traced(self, name, layer, x, residual):
    result = _tune(self, name, layer, x, residual)
    seen.append((name, _layout(x), _layout(residual), result.choice[:70], round(result.time_ms * 1e3, 1),
                 round(result.dense_ms * 1e3, 1)))
    return result


tuning_pass._LayerTuning._tune = traced
os.environ["SPARSECNN_CACHE_DIR"] = tempfile.mkdtemp()
model, _, _ = _pruned_model("resnet50", 0.9, "tiles64x32i-dlmc-magnitude_pruning", 0, None)
model = _round_model_(model, "fp16").cuda()
x = _input("resnet50", 32, 0, torch.device("cuda"), "fp16").contiguous(memory_format=torch.channels_last)
print("model input", _layout(x), flush=True)
gm = sparsecnn.prepare_for_inference(model)  # as `bench model` tunes it (bench.models._variant)
sparsecnn.sparsify_(gm, x, dtype="fp16", progress=False)
for row in seen:
    print(*row, sep="  ", flush=True)
print(gm.sparsecnn_report.model_check.format(), flush=True)
