"""Experiment (session 14): are direct "batch" and staged layers slower when they write NCHW or read NCHW?

In the tuned GoogLeNet (fp32, N=32) the "batch" layers that write NCHW (their consumer is an
inception concatenation with NCHW inputs) took 1.3-2.7x their tuning time in the model profile
(`benchmarks/results/2026-11-23-h100-s14-profile-edc7a91.jsonl`). Per GoogLeNet-like layer: cuDNN
and each auto config, batch-innermost (bi) or NCHW input and output. Random masks at 0.9.
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-23-s14-layout-probe.py OUT.jsonl
"""
import json, sys
import torch
import torch.nn.functional as F
from sparsecnn.autotune import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment
from sparsecnn.bench.patterns import make_weight
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.codegen import staged
from sparsecnn.kernels.triton import direct_conv
from sparsecnn.layers import ConvSpec
TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)
torch.backends.cudnn.allow_tf32 = False
out = open(sys.argv[1], "a")
specs = [ConvSpec(32, 160, 320, 14, 14, 3, 3, 1, 1, name="g4e.b2.1"), ConvSpec(32, 96, 208, 14, 14, 3, 3, 1, 1, name="g4a.b2.1"),
         ConvSpec(32, 48, 128, 7, 7, 3, 3, 1, 1, name="g5b.b3.1"), ConvSpec(32, 128, 192, 28, 28, 3, 3, 1, 1, name="g3b.b2.1"),
         ConvSpec(32, 832, 384, 7, 7, 1, 1, 1, 0, name="g5b.b1")]
def t(fn):
    return round(benchmark(fn, torch.device("cuda"), **TIMING)["median_ms"], 4)
for spec in specs:
    w, _ = make_weight(spec, 0.9, "random", 0, "cuda")
    x = torch.randn(spec.input_shape, device="cuda")
    xi = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
    oi = batch_inner_view(spec.output_shape, x.dtype, x.device)
    on = torch.empty(spec.output_shape, device="cuda")
    res = {"layer": spec.name, "cudnn_ms": t(lambda: F.conv2d(x, w, None, spec.stride, spec.padding))}
    be = get_backend("direct")
    for cfg in be.auto_configs(spec, torch.float32):
        pk = be.prepare(w, cfg)
        name = f"{cfg.variant}-{cfg.block_pix}-{cfg.sub_batch}"
        if cfg.variant == "batch":
            res[name + " bi>bi"] = t(lambda: direct_conv.direct_conv2d(xi, pk, None, spec.stride, spec.padding, cfg, out=oi))
            res[name + " bi>nchw"] = t(lambda: direct_conv.direct_conv2d(xi, pk, None, spec.stride, spec.padding, cfg, out=on))
            res[name + " nchw>nchw"] = t(lambda: direct_conv.direct_conv2d(x, pk, None, spec.stride, spec.padding, cfg, out=on))
            res[name + " nchw>bi"] = t(lambda: direct_conv.direct_conv2d(x, pk, None, spec.stride, spec.padding, cfg, out=oi))
        else:
            res[name + " nchw>nchw"] = t(lambda: direct_conv.direct_conv2d(x, pk, None, spec.stride, spec.padding, cfg, out=on))
    for cfg in staged.candidate_configs(spec)[:2]:
        pk = staged.pack_weight(w, cfg)
        name = "staged" + str((cfg.tile_h, cfg.tile_w, cfg.rows_per_warp))
        res[name + " bi>bi"] = t(lambda: staged.staged_conv2d(xi, pk, spec.stride, spec.padding, cfg, out=oi))
        res[name + " bi>nchw"] = t(lambda: staged.staged_conv2d(xi, pk, spec.stride, spec.padding, cfg, out=on))
        res[name + " nchw>nchw"] = t(lambda: staged.staged_conv2d(x, pk, spec.stride, spec.padding, cfg, out=on))
    print(json.dumps(res), flush=True)
    out.write(json.dumps({**environment("cuda"), **res}) + "\n")
