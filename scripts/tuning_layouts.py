"""Each conv's input and residual memory format, the choice tuning makes (us, dense us) and the
fastest time of each backend timed for it, while the zoo ResNet-50 (DLMC masks re-pruned into
channel-run tiles, N=32) is tuned from an empty decision cache on a GPU; then the whole-model check.
For finding why layers are timed slower in tuning than alone. DTYPE: fp16 (default; channels_last
input) or tf32 (fp32 at PyTorch's defaults, NCHW input, tuned with dtype=None as `bench model` does).

Usage (GPU): PYTHONPATH=src python scripts/tuning_layouts.py [fp16|tf32]
"""
import os
import sys
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


def _fastest_per_backend(result):
    fastest = sorted(result.fastest_per_backend().items(), key=lambda item: item[1])
    return " ".join(f"{backend} {ms * 1e3:.1f}" for backend, ms in fastest)


def traced(self, name, layer, x, residual):
    result = _tune(self, name, layer, x, residual)
    seen.append((name, _layout(x), _layout(residual), result.choice[:70], round(result.time_ms * 1e3, 1),
                 round(result.dense_ms * 1e3, 1), _fastest_per_backend(result)))
    return result


tuning_pass._LayerTuning._tune = traced
os.environ["SPARSECNN_CACHE_DIR"] = tempfile.mkdtemp()
DTYPE = sys.argv[1] if len(sys.argv) > 1 else "fp16"
if DTYPE not in ("fp16", "tf32"):
    raise SystemExit(__doc__)
model, _, _ = _pruned_model("resnet50", 0.9, "tiles64x32i-dlmc-magnitude_pruning", 0, None)
model = _round_model_(model, DTYPE).cuda()
x = _input("resnet50", 32, 0, torch.device("cuda"), DTYPE)
if DTYPE == "fp16":
    x = x.contiguous(memory_format=torch.channels_last)
print("model input", _layout(x), x.dtype, flush=True)
gm = sparsecnn.prepare_for_inference(model)  # as `bench model` tunes it (bench.models._variant)
sparsecnn.sparsify_(gm, x, dtype="fp16" if DTYPE == "fp16" else None, progress=False)
for row in seen:
    print(*row, sep="  ", flush=True)
print(gm.sparsecnn_report.model_check.format(), flush=True)
