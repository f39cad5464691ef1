"""Experiment (session 16): the unrolled kernel (`kernels/codegen/unrolled.py`: weights as FMA
immediates, batch-innermost activations, a thread keeps bk channels and loads each input column
once for all of them) against `direct` "batch" (its auto configs) and cuDNN, on ResNet-50 layers
at 28x28, 14x14 and 7x7 (DLMC 0.9, N=32, fp32, batch-innermost input and output, bias and ReLU,
the conv3 layers with their residual). Kernels compile in worker processes first (ptxas seconds).
Configs: bk 8, 16, 32 with 128 or 64 threads (the d3c6c32 run tried five of these six, as
(bk, vec, threads) with vec 1). The first run (691880e: bk 16-64, vec 1-2) read padded layers
with predicated loads, which were wrong on the GPU (relative error 0.4-0.9 on the 3x3 layers).
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-23-s16-unrolled-probe.py OUT.jsonl
"""
import concurrent.futures
import json
import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F

LAYERS = ("layer1.1.conv2", "layer1.1.conv3", "layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2", "layer2.1.conv3",
          "layer3.0.downsample.0", "layer3.1.conv1", "layer3.1.conv2", "layer3.1.conv3", "layer4.0.conv1",
          "layer4.1.conv1", "layer4.1.conv3")
CONFIGS = ((8, 128), (16, 128), (32, 128), (8, 64), (16, 64), (32, 64))
TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)


def _weight(name):
    from sparsecnn.bench.patterns import make_weight
    from sparsecnn.layers import get_suite
    spec = {s.name: s.with_batch(32) for s in get_suite("resnet50")}[name]
    weight, _ = make_weight(spec, 0.9, "dlmc-magnitude_pruning", 0, "cpu")
    return spec, weight


def _compile(job):
    torch.set_num_threads(1)
    from sparsecnn.kernels.codegen import unrolled
    name, (bk, threads) = job
    spec, weight = _weight(name)
    compiled = unrolled.compile_layer(weight, spec, unrolled.UnrolledConfig(bk, threads, "batch_inner"))
    return name, (bk, threads), compiled.compile_s, compiled.registers, compiled.spill_bytes


def main():
    from sparsecnn.autotune import benchmark
    from sparsecnn.backends import get_backend
    from sparsecnn.bench.env import environment
    from sparsecnn.kernels.batch_inner import batch_inner_view
    from sparsecnn.kernels.codegen import unrolled
    from sparsecnn.kernels.reference import reference_conv, relative_error
    from sparsecnn.kernels.triton import direct_conv

    torch.backends.cudnn.allow_tf32 = False
    jobs = [(name, config) for name in LAYERS for config in CONFIGS]
    compile_info = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, os.cpu_count() - 2), mp_context=context) as pool:
        for name, config, seconds, registers, spills in pool.map(_compile, jobs):
            compile_info[name, config] = dict(compile_s=round(seconds, 2), registers=registers, spills=spills)
            print("compiled", name, config, compile_info[name, config], flush=True)
    env = {**environment("cuda"), "kind": "experiment", "experiment": "unrolled batch-innermost kernel",
           "dtype": "fp32", "N": 32, "sparsity": 0.9, "pattern": "dlmc-magnitude_pruning"}
    time_ms = lambda fn: round(benchmark(fn, torch.device("cuda"), **TIMING)["median_ms"], 4)  # noqa: E731
    with open(sys.argv[1], "a") as out:
        for name in LAYERS:
            spec, weight = _weight(name)
            weight = weight.cuda()
            x = torch.randn(spec.input_shape, device="cuda")
            bias = torch.randn(spec.K, device="cuda") * 0.1
            residual = torch.randn(spec.output_shape, device="cuda") if name.endswith("conv3") else None
            ref = reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True)
            ref = torch.relu(ref + (0 if residual is None else residual.double()))
            xi = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
            ri = None if residual is None else batch_inner_view(residual.shape, x.dtype, x.device).copy_(residual)
            oi = batch_inner_view(spec.output_shape, x.dtype, x.device)
            dense = lambda: torch.relu_(F.conv2d(x, weight, bias, spec.stride, spec.padding)  # noqa: E731
                                        + (0 if residual is None else residual))
            row = {"layer": name, "nnz": int((weight != 0).sum()), "cudnn_ms": time_ms(dense)}
            backend = get_backend("direct")
            direct = {}
            for config in backend.auto_configs(spec, torch.float32):
                if config.variant != "batch":
                    continue
                packed = backend.prepare(weight, config)
                run = lambda: direct_conv.direct_conv2d(xi, packed, bias, spec.stride, spec.padding,  # noqa: E731
                                                        config, relu=True, residual=ri, out=oi)
                direct[f"pix{config.block_pix}"] = (time_ms(run), relative_error(run(), ref))
            row["direct_ms"] = min(t for t, _ in direct.values())
            row["direct"] = direct
            results = {}
            for config in CONFIGS:
                compiled = unrolled.compile_layer(weight.cpu(), spec, unrolled.UnrolledConfig(*config, "batch_inner"))
                oi.fill_(float("nan"))
                run = lambda: unrolled.unrolled_conv2d(xi, compiled, bias, ri, True, out=oi)  # noqa: E731
                error = relative_error(run(), ref)
                results["bk%d t%d" % config] = dict(ms=time_ms(run), rel_err=error, **compile_info[name, config])
            best = min(results, key=lambda k: results[k]["ms"])
            row.update(unrolled_best_ms=results[best]["ms"], unrolled_best=best, unrolled=results)
            row["speedup_vs_direct"] = round(row["direct_ms"] / row["unrolled_best_ms"], 3)
            print(json.dumps({k: v for k, v in row.items() if k not in ("unrolled", "direct")}), flush=True)
            out.write(json.dumps({**env, **row}) + "\n")


if __name__ == "__main__":
    main()
