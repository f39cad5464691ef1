#!/usr/bin/env bash
# Session 19, first device call: the tl.gather direct kernel (correctness on odd shapes, then six
# fp32 layers against `direct` "batch" and cuDNN), then `blocks`' remainder alone in fp16 on the
# resnet50 DLMC and pietron-vgg16 suites against cuDNN fp16 channels_last.
# Usage (device): OUT=out bash benchmarks/experiments/2026-11-25-s19-device-call1.sh
source "$(dirname "$0")/../../scripts/device-env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
here=benchmarks/experiments
timeout 60 python3 $here/2026-11-25-s19-gather-direct.py check 2>&1 | tail -n 5
timeout 200 python3 $here/2026-11-25-s19-gather-direct.py time "$OUT/gather-direct.jsonl" >"$OUT/gather-direct.log" 2>&1 \
    || echo "gather-direct: stopped (exit $?)"
grep -v "^vgg\|^layer" "$OUT/gather-direct.log" | tail -n 12
timeout 330 python3 $here/2026-11-25-s19-blocks-remainder.py "$OUT/blocks-remainder.jsonl" >"$OUT/blocks-remainder.log" 2>&1 \
    || echo "blocks-remainder: stopped (exit $?)"
python3 - "$OUT/blocks-remainder.jsonl" <<'PY'
import json, math, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
g = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
by = collections.defaultdict(list)
for r in rows:
    by[r["suite"]].append(r)
for suite, rs in by.items():
    print(suite, len(rs), "layers: blocks %.2fx, free-blocks bound %.2fx, L1 floor bound %.2fx" % (
        g([r["blocks_vs_cudnn"] for r in rs]), g([min(r["free_blocks_bound_vs_cudnn"], 1e3) for r in rs]),
        g([min(r["l1_floor_bound_vs_cudnn"], 1e3) for r in rs])))
PY
tail -n 3 "$OUT/blocks-remainder.log"
