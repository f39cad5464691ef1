"""Experiment (session 7, H100, at a2edc67): the "batch" kernel with a chunk's weights and offsets loaded
as two vectors (summed over the chunk, or one element extracted per step) against the scalar loop.
Result: `benchmarks/results/2026-11-22-h100-s7-vector-chunk-loads.jsonl`; usage: OUT_FILE LAYERS (comma-separated)."""
import json, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F
from sparsecnn.autotune import benchmark
from sparsecnn.bench.env import environment
from sparsecnn.bench.patterns import make_weight
from sparsecnn.formats import ChunkedCSRWeight
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.reference import reference_conv, relative_error
from sparsecnn.kernels.triton import direct_batch
from sparsecnn.kernels.triton.direct_conv import weight_arrays
from sparsecnn.kernels.triton.tiles import channel_pixel_tile
from sparsecnn.layers import get_suite


@triton.jit(do_not_specialize=["y_stride_n", "y_stride_k", "y_stride_pix"])
def _vec_kernel(x_ptr, val_ptr, off_ptr, row_ptr_ptr, y_ptr, N, K, PQ, Q, row_step, col_step, y_stride_n, y_stride_k,
                y_stride_pix, BLOCK_PIX: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, LAYOUT: tl.constexpr):
    kb, n_block, pix, pix_ok, x_pos = channel_pixel_tile(K, PQ, Q, row_step, col_step, BLOCK_PIX)
    img = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(row_ptr_ptr + kb)
    end = tl.load(row_ptr_ptr + kb + 1)
    if LAYOUT == 0:
        x_tile = x_ptr + (x_pos * N)[:, None] + img[None, :]
        acc = tl.zeros([BLOCK_PIX, BLOCK_N], dtype=tl.float32)
        for j in range(start, end, CHUNK):
            w = tl.load(val_ptr + j + tl.arange(0, CHUNK))
            off = tl.load(off_ptr + j + tl.arange(0, CHUNK))
            xv = tl.load(x_tile[:, :, None] + (off * N)[None, None, :])
            acc += tl.sum(xv.to(tl.float32) * w[None, None, :], axis=2)
    else:
        x_tile = x_ptr + (x_pos * N)[:, None] + img[None, :]
        acc = tl.zeros([BLOCK_PIX, BLOCK_N], dtype=tl.float32)
        for j in range(start, end, CHUNK):
            w = tl.load(val_ptr + j + tl.arange(0, CHUNK))
            off = tl.load(off_ptr + j + tl.arange(0, CHUNK))
            for c in tl.static_range(CHUNK):
                wc = tl.sum(tl.where(tl.arange(0, CHUNK) == c, w, 0.0), axis=0)
                oc = tl.sum(tl.where(tl.arange(0, CHUNK) == c, off, 0), axis=0)
                acc = tl.fma(tl.load(x_tile + oc * N).to(tl.float32), wc, acc)
    y_offs = pix[:, None] * y_stride_pix + img[None, :].to(tl.int64) * y_stride_n + kb * y_stride_k
    tl.store(y_ptr + y_offs, acc, mask=pix_ok[:, None] & (img < N)[None, :])


def main():
    torch.backends.cudnn.allow_tf32 = False
    out_path = sys.argv[1]
    layers = sys.argv[2].split(",")
    specs = {s.name: s.with_batch(32) for s in get_suite("resnet50")}
    env = environment("cuda")
    for name in layers:
        spec = specs[name]
        weight, label = make_weight(spec, 0.9, "dlmc-magnitude_pruning", 0, "cuda")
        x = torch.randn(spec.input_shape, device="cuda")
        ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
        res = {"cudnn": benchmark(lambda: F.conv2d(x, weight, None, spec.stride, spec.padding), torch.device("cuda"),
                                  warmup_ms=25, rep_ms=100)["median_ms"]}
        ph, pw = spec.padding
        xp = direct_batch.padded_batch_inner(x, ph, pw)
        hp, wp = xp.shape[1], xp.shape[2]
        out = batch_inner_view(spec.output_shape, torch.float32, x.device)
        pq = spec.P * spec.Q
        errs = {}
        for chunk in (8, 16):
            packed = ChunkedCSRWeight.from_dense(weight, chunk)
            values, offsets, row_ptr, row_order = weight_arrays(packed, hp, wp)
            for pix in (4, 8):
                def base():
                    direct_batch.launch_batch(xp, values, offsets, row_ptr, row_order, None, None, out, spec.stride,
                                              False, (1, pix, 32), chunk, 1)
                    return out
                grid = (spec.K * triton.cdiv(pq, pix),)
                st = out.stride()
                def vec(layout):
                    def run():
                        _vec_kernel[grid](xp, values, offsets, row_ptr, out, 32, spec.K, pq, spec.Q, spec.stride[0] * wp,
                                          spec.stride[1], st[0], st[1], st[3], BLOCK_PIX=pix, BLOCK_N=32, CHUNK=chunk,
                                          LAYOUT=layout, num_warps=1, num_stages=1)
                        return out
                    return run
                for label2, fn in (("scalar", base), ("vec-sum", vec(0)), ("vec-extract", vec(1))):
                    out.fill_(float("nan"))
                    try:
                        errs[f"{label2}-p{pix}-c{chunk}"] = relative_error(fn(), ref)
                        res[f"{label2}-p{pix}-c{chunk}"] = benchmark(fn, torch.device("cuda"), warmup_ms=25,
                                                                     rep_ms=100)["median_ms"]
                    except Exception as e:
                        print(name, label2, pix, chunk, "failed", type(e).__name__, str(e)[:300])
        cud = res["cudnn"]
        print(name, " ".join(f"{k}:{cud / v:.2f}x" for k, v in res.items() if k != "cudnn"),
              "maxerr %.1e" % max(errs.values()), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps({**env, "layer": name, "ms": res, "rel_err": errs}) + "\n")


main()
