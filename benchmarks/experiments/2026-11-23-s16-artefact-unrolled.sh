#!/usr/bin/env bash
# Session 16: a DLMC ResNet-50 artefact whose layers run `unrolled` (and codegen), compiled, then
# loaded in two fresh processes whose codegen cache starts empty ($SPARSECNN_CACHE), so every
# kernel must come from the artefact's codegen/ files: the load must run no ptxas and stay under 2 s.
# Usage (device): OUT=out bash benchmarks/experiments/2026-11-23-s16-artefact-unrolled.sh
source "$(dirname "$0")/../../scripts/device-env.sh"
python3 -c "import sys, torch; from sparsecnn.models import build_model; from sparsecnn.prune import apply_dlmc_
m = build_model('resnet50'); apply_dlmc_(m, 'magnitude_pruning-0.9', 0); torch.save(m.state_dict(), sys.argv[1])" /tmp/r50-dlmc.pt
python3 -m sparsecnn.cli compile /tmp/r50-dlmc.pt --model resnet50 --input-shape 32,3,224,224 -o /tmp/r50-artefact \
    2>&1 | grep -E "tuning time|worker jobs|unrolled|Error" | cut -c1-300
echo "unrolled layers in the manifest: $(python3 -c "import json; m = json.load(open('/tmp/r50-artefact/manifest.json')); print(sum(e['backend'] == 'unrolled' for e in m['layers'].values()))")"
echo "codegen/ files: $(find /tmp/r50-artefact/codegen -type f | wc -l)"
for run in 1 2; do
    rm -rf /tmp/empty-codegen-cache-$run
    start=$(date +%s.%N)
    SPARSECNN_CACHE=/tmp/empty-codegen-cache-$run python3 - <<'PY'
import traceback
import torch
from sparsecnn.kernels.codegen import toolchain
toolchain_calls = []
original = toolchain.ptxas_cubin
toolchain.ptxas_cubin = lambda *a, **k: (toolchain_calls.append(traceback.extract_stack()[-2].filename.split("/")[-1]),
                                         original(*a, **k))[1]
import sparsecnn
model = sparsecnn.load("/tmp/r50-artefact")
print("load phases:", {k: round(v, 3) for k, v in model.sparsecnn_load_phases.items()})
x = torch.randn(32, 3, 224, 224, device="cuda")
with torch.no_grad():
    model(x)
torch.cuda.synchronize()
print("ptxas calls during load and first forward:", len(toolchain_calls), toolchain_calls)
PY
    echo "load process $run wall: $(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 2))" "$start") s (imports and one forward included)"
done
