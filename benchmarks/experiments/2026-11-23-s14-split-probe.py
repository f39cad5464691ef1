"""Experiment (session 14): would splitting staged's input channels across S blocks pay on 14x14 and 7x7 layers?

A split-S kernel at (C, N=32) runs S times the blocks, each over C/S channels: its main loop is
approximated by the unsplit kernel at (C/S, N=32*S) (same block count and work per block; the
reduction of the S partial outputs is not included). Per layer: cuDNN fp32, direct "batch" (best
auto config, batch-innermost in and out), and the best staged config for S = 1, 2, 4, 8. Random
masks at 0.9. Result: `benchmarks/results/2026-11-23-h100-s14-split-probe-edc7a91.jsonl`.
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-23-s14-split-probe.py OUT.jsonl
"""
import dataclasses, json, sys
import torch
from sparsecnn.autotune import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment
from sparsecnn.bench.patterns import make_weight
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.codegen import staged
from sparsecnn.kernels.triton import direct_conv
from sparsecnn.layers import get_suite
import torch.nn.functional as F
TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)
torch.backends.cudnn.allow_tf32 = False
out = open(sys.argv[1], "a")
specs = {s.name: s.with_batch(32) for s in get_suite("resnet50")}
specs.update({s.name: s.with_batch(32) for s in get_suite("pietron-vgg16")})
names = ["layer3.1.conv1", "layer3.1.conv2", "layer3.1.conv3", "layer4.1.conv1", "layer4.1.conv2", "layer4.1.conv3",
         "layer2.1.conv3", "vgg-512x14-512", "vgg-512x28-512"]
def t(fn):
    return benchmark(fn, torch.device("cuda"), **TIMING)["median_ms"]
for name in names:
    spec = specs[name]
    res = {"layer": name}
    w, _ = make_weight(spec, 0.9, "random", 0, "cuda")
    x = torch.randn(spec.input_shape, device="cuda")
    res["cudnn_ms"] = t(lambda: F.conv2d(x, w, None, spec.stride, spec.padding))
    xi = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
    oi = batch_inner_view(spec.output_shape, x.dtype, x.device)
    be = get_backend("direct")
    best = 1e9
    for cfg in be.auto_configs(spec, torch.float32):
        if cfg.variant != "batch":
            continue
        pk = be.prepare(w, cfg)
        best = min(best, t(lambda: direct_conv.direct_conv2d(xi, pk, None, spec.stride, spec.padding, cfg, out=oi)))
    res["direct_ms"] = best
    for S in (1, 2, 4, 8):
        if spec.C % S or spec.C // S < 16:
            continue
        sp = dataclasses.replace(spec, C=spec.C // S, N=32 * S)
        ws, _ = make_weight(sp, 0.9, "random", 0, "cuda")
        xs = torch.randn(sp.input_shape, device="cuda")
        xsi = batch_inner_view(xs.shape, xs.dtype, xs.device).copy_(xs)
        osi = batch_inner_view(sp.output_shape, xs.dtype, xs.device)
        cfgs = list(staged.candidate_configs(sp))
        for extra in ((2, 4, 8, 16, 4), (2, 4, 8, 8, 8), (4, 4, 8, 8, 4), (2, 8, 8, 8, 4), (2, 4, 16, 8, 4)):
            try:
                c = staged.StagedConfig(*extra)
                if c.smem_bytes(sp) <= staged.MAX_SMEM_BYTES:
                    cfgs.append(c)
            except ValueError:
                pass
        times = {}
        for cfg in dict.fromkeys(cfgs):
            pk = staged.pack_weight(ws, cfg)
            times[str(dataclasses.astuple(cfg)[:5])] = t(lambda: staged.staged_conv2d(xsi, pk, sp.stride, sp.padding, cfg, out=osi))
        b = min(times, key=times.get)
        res[f"staged_S{S}"] = times[b]; res[f"cfg_S{S}"] = b
    line = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}
    print(json.dumps(line), flush=True)
    out.write(json.dumps({**environment("cuda"), **line}) + "\n")
