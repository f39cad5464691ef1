"""Experiment (session 19): can a Triton kernel stage the input tile on chip, as `staged` (CUDA)
does, and so beat `direct` "batch" (L2-bound, one gather from L1/L2 per multiply-add)?

Triton has no shared-memory pointer and no dynamic indexing of a register tensor; its one on-chip
gather is `tl.gather(src, index, axis)`, and each call re-distributes the whole `src`. So one call
per chunk of input channels must serve every non-zero of the program's channels in that chunk.
Here one program: G output channels x a TH x TW pixel tile x NB images (batch-innermost padded
input (C, Hp, Wp, N), as "batch"). Per chunk of CC input channels it loads the tile's input window
[CC*WH*WW, NB] (coalesced along the images), then per group of NZ slots per channel (an ELL of the
chunk's non-zeros, padded with zero weights) one gather of [NZ*G*TP, NB] and a sum over the slots.

Result (H100, `benchmarks/results/2026-11-25-h100-s19-gather-direct-e9a861b.jsonl`): correct, and
0.24-0.47x of `direct`'s speed on six layers. Compiled offline for sm_90, Triton gives the gather a
layout whose gathered axis lies within one warp and lowers it to warp shuffles: one SHFL per
gathered value for a 32-row window (the fastest config), about four for 128 rows; and at 90%
sparsity most of the G x NZ slots per chunk are padding.
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-25-s19-gather-direct.py {check|time OUT.jsonl}
"""
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["C", "Hp", "Wp", "P", "Q", "n_chunks", "stride_h", "stride_w",
                               "y_stride_n", "y_stride_k", "y_stride_pix"])
def _gather_kernel(xp_ptr, val_ptr, off_ptr, group_ptr, chan_ptr, y_ptr,
                   N, C, Hp, Wp, P, Q, n_chunks, stride_h, stride_w, y_stride_n, y_stride_k, y_stride_pix,
                   G: tl.constexpr, NZ: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                   WH: tl.constexpr, WW: tl.constexpr, CC: tl.constexpr, WINP: tl.constexpr, NB: tl.constexpr):
    TP: tl.constexpr = TH * TW
    M: tl.constexpr = NZ * G * TP
    blk = tl.program_id(0)
    tile = tl.program_id(1)
    img = tl.program_id(2) * NB + tl.arange(0, NB)
    tiles_w = tl.cdiv(Q, TW)
    oh0 = (tile // tiles_w) * TH
    ow0 = (tile % tiles_w) * TW
    wr = tl.arange(0, WINP)
    w_c = wr // (WH * WW)
    ih = oh0 * stride_h + (wr // WW) % WH
    iw = ow0 * stride_w + wr % WW
    in_window = (wr < CC * WH * WW) & (ih < Hp) & (iw < Wp)
    m = tl.arange(0, M)
    slot = m // TP           # z * G + g: the entry of the (G, NZ) group, slot-major
    entry = (slot % G) * NZ + slot // G
    p = m % TP
    pix_off = (p // TW) * stride_h * WW + (p % TW) * stride_w
    acc = tl.zeros([G * TP, NB], dtype=tl.float32)
    for ch in range(n_chunks):
        c = ch * CC + w_c
        ok = in_window & (c < C)
        x_rows = ((c * Hp + ih) * Wp + iw).to(tl.int64) * N
        win = tl.load(xp_ptr + x_rows[:, None] + img[None, :], mask=ok[:, None], other=0.0)
        g0 = tl.load(group_ptr + blk * n_chunks + ch)
        g1 = tl.load(group_ptr + blk * n_chunks + ch + 1)
        for gi in range(g0, g1):
            w = tl.load(val_ptr + gi * (G * NZ) + entry)
            idx = tl.load(off_ptr + gi * (G * NZ) + entry) + pix_off
            v = tl.gather(win, tl.broadcast_to(idx[:, None], [M, NB]), 0)
            acc += tl.sum(tl.reshape(v * w[:, None], [NZ, G * TP, NB]), axis=0)
    r = tl.arange(0, G * TP)
    k = tl.load(chan_ptr + blk * G + r // TP)
    oh = oh0 + (r % TP) // TW
    ow = ow0 + (r % TP) % TW
    ok = (k >= 0) & (oh < P) & (ow < Q)
    y_offs = (k * y_stride_k + (oh * Q + ow) * y_stride_pix)[:, None] + img[None, :].to(tl.int64) * y_stride_n
    tl.store(y_ptr + y_offs, acc, mask=ok[:, None])


def pack(weight, G, NZ, CC, WH, WW):
    """Dense (K, C, R, S) -> per (block of G channels, chunk of CC input channels) groups of NZ
    slots per channel: values/offsets (groups, G, NZ) (offset of the input in the window of
    CC x WH x WW positions), group_ptr (blocks * n_chunks + 1,), channel (blocks * G,)."""
    k, c, r, s = weight.shape
    blocks, n_chunks = -(-k // G), -(-c // CC)
    dense = weight.detach().cpu().float()
    values, offsets, group_ptr, channel = [], [], [0], torch.full((blocks * G,), -1, dtype=torch.int32)
    channel[:k] = torch.arange(k, dtype=torch.int32)
    for b in range(blocks):
        for ch in range(n_chunks):
            rows = []
            for g in range(G):
                kk = b * G + g
                if kk >= k:
                    rows.append(([], []))
                    continue
                part = dense[kk, ch * CC:(ch + 1) * CC]
                cc_, rr, ss = part.nonzero(as_tuple=True)
                rows.append((part[cc_, rr, ss].tolist(), ((cc_ * WH + rr) * WW + ss).tolist()))
            groups = -(-max(len(v) for v, _ in rows) // NZ)
            for gi in range(groups):
                val = torch.zeros(G, NZ)
                off = torch.zeros(G, NZ, dtype=torch.int32)
                for g, (v, o) in enumerate(rows):
                    part_v, part_o = v[gi * NZ:(gi + 1) * NZ], o[gi * NZ:(gi + 1) * NZ]
                    val[g, :len(part_v)] = torch.tensor(part_v)
                    off[g, :len(part_o)] = torch.tensor(part_o, dtype=torch.int32)
                values.append(val)
                offsets.append(off)
            group_ptr.append(group_ptr[-1] + groups)
    values = torch.stack(values) if values else torch.zeros(1, G, NZ)
    offsets = torch.stack(offsets) if offsets else torch.zeros(1, G, NZ, dtype=torch.int32)
    return values, offsets, torch.tensor(group_ptr, dtype=torch.int32), channel


def gather_conv2d(x, weight, stride, padding, packed=None, **cfg):
    """x (N, C, H, W) float32; weight (K, C, R, S); no bias/activation. Returns NCHW (N, K, P, Q)."""
    xp = F.pad(x, (padding,) * 4).permute(1, 2, 3, 0).contiguous()
    y = x.new_full((x.shape[0], weight.shape[0], (x.shape[2] + 2 * padding - weight.shape[2]) // stride + 1,
                    (x.shape[3] + 2 * padding - weight.shape[3]) // stride + 1), float("nan"))
    if packed is None:
        wh, ww = (cfg["TH"] - 1) * stride + weight.shape[2], (cfg["TW"] - 1) * stride + weight.shape[3]
        packed = [t.to(x.device) for t in pack(weight.cpu(), cfg["G"], cfg["NZ"], cfg["CC"], wh, ww)]
    launch_gather(xp, packed, y, stride, weight.shape[2], weight.shape[3], **cfg)
    return y


def launch_gather(xp, packed, y, stride, r, s, G=8, NZ=4, TH=2, TW=4, CC=4, NB=32, num_warps=8):
    """xp: padded batch-innermost (C, Hp, Wp, N) float32; y: (N, K, P, Q) at any strides."""
    c, hp, wp, n = xp.shape
    _, _, p, q = y.shape
    wh, ww = (TH - 1) * stride + r, (TW - 1) * stride + s
    values, offsets, group_ptr, channel = packed
    grid = (channel.numel() // G, triton.cdiv(p, TH) * triton.cdiv(q, TW), n // NB)
    stride_n, stride_k, _, stride_pix = y.stride()
    _gather_kernel[grid](xp, values, offsets, group_ptr, channel, y, n, c, hp, wp, p, q,
                         -(-c // CC), stride, stride, stride_n, stride_k, stride_pix,
                         G=G, NZ=NZ, TH=TH, TW=TW, WH=wh, WW=ww, CC=CC,
                         WINP=triton.next_power_of_2(CC * wh * ww), NB=NB, num_warps=num_warps)


def check():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(4, 3, 5, 7, 3, 1, 1, 4), (2, 6, 9, 9, 3, 2, 1, 2), (4, 5, 3, 6, 1, 1, 0, 4)]
    for (n, c, k, h, r, stride, pad, nb) in shapes:
        x = torch.randn(n, c, h, h, device=device)
        weight = torch.randn(k, c, r, r, device=device) * (torch.rand(k, c, r, r, device=device) < 0.3)
        ref = F.conv2d(x.double(), weight.double(), stride=stride, padding=pad)
        y = gather_conv2d(x, weight, stride, pad, G=4, NZ=2, TH=2, TW=2, CC=2, NB=nb, num_warps=1)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        print((n, c, k, h, r, stride, pad), f"rel err {err:.2e}")
        assert err < 1e-6, err


CONFIGS = [dict(G=g, NZ=nz, TH=th, TW=tw, CC=cc, num_warps=wp)
           for (g, nz, th, tw, cc, wp) in [(8, 4, 2, 4, 4, 8), (16, 4, 2, 4, 4, 8), (16, 2, 2, 4, 2, 8),
                                           (8, 8, 2, 4, 8, 8), (32, 2, 2, 2, 2, 8), (16, 4, 4, 4, 4, 8)]]
LAYERS = [("pietron-vgg16", "vgg-256x56-256", 32), ("pietron-vgg16", "vgg-512x28-512", 32),
          ("pietron-vgg16", "vgg-128x112-128", 32), ("resnet50", "layer2.1.conv2", 32),
          ("resnet50", "layer3.1.conv2", 32), ("resnet50", "layer1.0.conv2", 32)]


def time_layers(path):
    from sparsecnn.autotune import benchmark
    from sparsecnn.backends import get_backend
    from sparsecnn.bench.env import environment
    from sparsecnn.bench.patterns import make_weight
    from sparsecnn.kernels.batch_inner import batch_inner_view
    from sparsecnn.kernels.reference import reference_conv, relative_error
    from sparsecnn.kernels.triton import direct_conv
    from sparsecnn.layers import get_suite

    torch.backends.cudnn.allow_tf32 = False
    env = {**environment("cuda"), "kind": "experiment", "experiment": "tl.gather staged direct (Triton)",
           "dtype": "fp32", "sparsity": 0.9}
    time_ms = lambda fn: round(benchmark(fn, torch.device("cuda"), warmup_ms=25, rep_ms=100,  # noqa: E731
                                         hide_launch=True)["median_ms"], 4)
    with open(path, "a") as out:
        for suite, name, batch in LAYERS:
            spec = {sp.name: sp.with_batch(batch) for sp in get_suite(suite)}[name]
            pattern = "dlmc-magnitude_pruning" if suite == "resnet50" else "random"
            weight, _ = make_weight(spec, 0.9, pattern, 0, "cpu")
            weight = weight.cuda()
            x = torch.randn(spec.input_shape, device="cuda")
            ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
            row = {"suite": suite, "layer": name, "N": batch, "pattern": pattern,
                   "cudnn_ms": time_ms(lambda: F.conv2d(x, weight, None, spec.stride, spec.padding))}
            xi = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
            oi = batch_inner_view(spec.output_shape, x.dtype, x.device)
            backend = get_backend("direct")
            direct = {}
            for config in backend.auto_configs(spec, torch.float32):
                if config.variant == "batch":
                    packed = backend.prepare(weight, config)
                    run = lambda: direct_conv.direct_conv2d(xi, packed, None, spec.stride, spec.padding,  # noqa: E731
                                                            config, out=oi)
                    direct[f"pix{config.block_pix}"] = time_ms(run)
            row["direct_batch_ms"] = min(direct.values()) if direct else None
            gathers = {}
            for cfg in CONFIGS:
                stride, pad = spec.stride[0], spec.padding[0]
                wh, ww = (cfg["TH"] - 1) * stride + spec.R, (cfg["TW"] - 1) * stride + spec.S
                packed = [t.cuda() for t in pack(weight.cpu(), cfg["G"], cfg["NZ"], cfg["CC"], wh, ww)]
                key = "G{G} NZ{NZ} {TH}x{TW} CC{CC} w{num_warps}".format(**cfg)
                try:
                    xp = F.pad(x, (pad,) * 4).permute(1, 2, 3, 0).contiguous()
                    oi.fill_(float("nan"))
                    run = lambda: launch_gather(xp, packed, oi, stride, spec.R, spec.S, **cfg)  # noqa: E731
                    run()
                    err = relative_error(oi, ref)
                    gathers[key] = dict(ms=time_ms(run), rel_err=err, groups=int(packed[2][-1]))
                except Exception as exc:  # noqa: BLE001 (an experiment: record why a config failed)
                    gathers[key] = dict(error=repr(exc)[:300])
                print(name, key, gathers[key], flush=True)
            timed = {k: v["ms"] for k, v in gathers.items() if "ms" in v}
            row["gather"] = gathers
            if timed:
                best = min(timed, key=timed.get)
                row.update(gather_best=best, gather_best_ms=timed[best],
                           gather_vs_cudnn=round(row["cudnn_ms"] / timed[best], 3))
                if row["direct_batch_ms"]:
                    row["gather_vs_direct"] = round(row["direct_batch_ms"] / timed[best], 3)
            print(json.dumps({k: v for k, v in row.items() if k != "gather"}), flush=True)
            out.write(json.dumps({**env, **row}) + "\n")


if __name__ == "__main__":
    check() if sys.argv[1] == "check" else time_layers(sys.argv[2])
