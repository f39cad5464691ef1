"""Experiment (session 19): can `blocks` reach issue 4's fp16 target (geomean >= 1x over cuDNN fp16
channels_last at 90% on resnet50 DLMC N=32 and pietron-vgg16 N=128) at all?

`blocks` runs a layer as its dense blocks (tensor cores) plus the sparse remainder (the non-zeros
outside blocks). Its time is at least the remainder's. Per layer, fp16, same run: cuDNN fp16
channels_last; `blocks` as tuned (its auto configs, t2 4 and 8); and, for t2 4 and 8, the remainder
alone (the weight with the block non-zeros removed) on our fastest fp16 sparse kernel, `direct`
(best of its auto configs), i.e. `blocks` with free dense blocks. Also the remainder's floor at
one L1 gather per multiply-add (128 B per clock per SM = 64 fp16 values; 132 SMs at 1.98 GHz).
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-25-s19-blocks-remainder.py OUT.jsonl
"""
import json
import math
import sys

import torch
import torch.nn.functional as F

SUITES = (("resnet50", 32, "dlmc-magnitude_pruning"), ("pietron-vgg16", 128, "random"))
T2 = (4, 8)
L1_VALUES_PER_S = 132 * 64 * 1.98e9


def main(path):
    from sparsecnn.autotune import benchmark
    from sparsecnn.autotune.select import Candidate, MeasuringTimer, pick_fastest
    from sparsecnn.backends import get_backend
    from sparsecnn.backends.block_extraction import extraction, submit_extractions
    from sparsecnn.bench.env import environment
    from sparsecnn.bench.patterns import make_weight
    from sparsecnn.layers import get_suite

    device = torch.device("cuda")
    timer = MeasuringTimer(device)
    env = {**environment("cuda"), "kind": "experiment", "experiment": "blocks: remainder alone vs cuDNN fp16",
           "dtype": "fp16", "sparsity": 0.9}
    layers = []
    for suite, batch, pattern in SUITES:
        for spec in get_suite(suite):
            spec = spec.with_batch(batch)
            weight, label = make_weight(spec, 0.9, pattern, 0, "cpu")
            weight = weight.half()
            submit_extractions(weight.float(), T2)
            layers.append((suite, spec, weight, label))
    with open(path, "a") as out:
        for suite, spec, weight, label in layers:
            x = torch.randn(spec.input_shape, device=device).half()
            w_gpu = weight.to(device)
            xl, wl = x.to(memory_format=torch.channels_last), w_gpu.to(memory_format=torch.channels_last)
            cudnn = benchmark(lambda: F.conv2d(xl, wl, None, spec.stride, spec.padding), device,
                              hide_launch=True)["median_ms"]
            pq_n = spec.output_shape[0] * spec.output_shape[2] * spec.output_shape[3]
            row = {"suite": suite, "layer": spec.name, "N": spec.N, "pattern": label, "nnz": int((weight != 0).sum()),
                   "cudnn_fp16_cl_ms": cudnn}
            blocks = get_backend("blocks")
            selection = pick_fastest(x, w_gpu, None, spec,
                                     [Candidate("blocks", c) for c in blocks.auto_configs(spec, torch.float16)], timer)
            row["blocks_ms"] = selection.best_ms
            row["blocks_config"] = selection.best.label()
            direct = get_backend("direct")
            for t2 in T2:
                decomposition = extraction(weight.float(), t2)
                remainder = decomposition.remainder.to_dense().reshape(weight.shape).half().to(device)
                rem_nnz = int((remainder != 0).sum())
                entry = {"share_in_blocks": decomposition.report.share_in_blocks,
                         "fill": decomposition.report.fill, "remainder_nnz": rem_nnz,
                         "remainder_floor_ms": rem_nnz * pq_n / L1_VALUES_PER_S * 1e3}
                if rem_nnz:
                    pick = pick_fastest(x, remainder, None, spec,
                                        [Candidate("direct", c) for c in direct.auto_configs(spec, torch.float16)],
                                        timer)
                    entry.update(remainder_direct_ms=pick.best_ms, remainder_config=pick.best.label())
                else:
                    entry.update(remainder_direct_ms=0.0)
                row[f"t2={t2}"] = entry
            best_rem = min(row[f"t2={t2}"]["remainder_direct_ms"] for t2 in T2)
            row["blocks_vs_cudnn"] = cudnn / row["blocks_ms"]
            row["free_blocks_bound_vs_cudnn"] = cudnn / best_rem if best_rem else math.inf
            row["l1_floor_bound_vs_cudnn"] = cudnn / min(row[f"t2={t2}"]["remainder_floor_ms"] for t2 in T2)
            print(json.dumps(row), flush=True)
            out.write(json.dumps({**env, **row}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
