"""One small layer per backend and dtype, run once each, for scripts/sanitize.sh (compute-sanitizer's
memcheck, racecheck and initcheck watch the kernels). Also a check of its own: every output is
finite and close to the fp64 reference, else the process exits 1.

The layer: N=2 (32 for backends that need a multiple of 32, staged), C=8, K=16, H=W=9, 3x3,
padding 1, 90% sparse (one output channel fully pruned), with a bias, built as a SparseConv2d with each backend through the public API, in fp32 and in fp16
where the backend offers it on CUDA. Each is run twice: plain, then with a residual and ReLU (the
epilogue's other path), each time into memory poisoned with NaN (0xFF bytes freed to PyTorch's
caching allocator, which the output then reuses, unless PYTORCH_NO_CUDA_MEMORY_CACHING=1, under
which memcheck sees each tensor as its own allocation and initcheck sees unwritten outputs read).

Besides each backend's default config, the configs in `OTHER_PATHS` run too: kernels a default
config does not reach (backend `tensorcore`'s TMA kernel and its unrolled loop); for `tensorcore`, also
a layer with a projection shortcut folded into its kernel (`shortcut_run`).

Usage: python3 scripts/sanitize_layers.py [BACKEND...]   (default: every registered backend)
"""
import sys
import time
import warnings

import torch

from sparsecnn import SparseConv2d
from sparsecnn.backends import backend_names, get_backend
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}  # loose: numerics are the tests' job, this catches garbage
BATCHES = (2, 32)  # the first one the backend runs
C, K, H, W, R, SPARSITY = 8, 16, 9, 9, 3, 0.9

if not torch.cuda.is_available():
    sys.exit("sanitize_layers.py needs a CUDA GPU")


def _tensorcore_tma():
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig

    return TensorCoreConfig(group=16, chunk=16, block_m=64, order="index", loads="tma")


def _tensorcore_unrolled():
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig

    return TensorCoreConfig(group=16, chunk=16, block_m=64, order="index", unroll=4)


OTHER_PATHS = {"tensorcore": [("tensorcore-tma", _tensorcore_tma),  # backend -> [(label, config maker)]
                              ("tensorcore-unrolled", _tensorcore_unrolled)]}
device = torch.device("cuda")
generator = torch.Generator().manual_seed(0)
weight = torch.randn(K, C, R, R, generator=generator)
weight *= torch.rand(weight.shape, generator=generator) >= SPARSITY
weight[K // 2] = 0  # a fully pruned output channel: its output is the bias alone
bias = torch.randn(K, generator=generator)
x_all = torch.randn(max(BATCHES), C, H, W, generator=generator)
residual_all = torch.randn(max(BATCHES), K, H, W, generator=generator)
plain_all = reference_conv(x_all, weight, bias, stride=1, padding=1, fp64=True)
epilogue_all = (plain_all + residual_all.double()).relu()


def poison(nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
    torch.cuda.synchronize()


failures = []
names = sys.argv[1:] or list(backend_names())
runs = [(name, name, None) for name in names]  # (label, backend, config maker: None for the default)
runs += [(label, name, make) for name in names for label, make in OTHER_PATHS.get(name, [])]
print(f"layer N={'/'.join(map(str, BATCHES))} C={C} K={K} H=W={H} {R}x{R} pad 1, {SPARSITY:.0%} sparse, nnz={int((weight != 0).sum())}; "
      f"runs: {', '.join(label for label, _, _ in runs)}", flush=True)
for run_label, name, make_config in runs:
    offered = get_backend(name).dtypes.get("cuda", ())
    for label, dtype in DTYPES.items():
        if dtype not in offered:
            continue
        start = time.perf_counter()
        N = next((n for n in BATCHES if get_backend(name).unsupported_reason(
            ConvSpec(n, C, K, H, W, R, R, stride=1, padding=1), dtype, "cuda") is None), BATCHES[0])
        x, residual, plain_ref, epilogue_ref = x_all[:N], residual_all[:N], plain_all[:N], epilogue_all[:N]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a fallback to dense would not run the backend at all
                layer = SparseConv2d(weight.to(device, dtype), bias.to(device, dtype), padding=1, backend=name,
                                     config=make_config() if make_config else None)
                xd, rd = x.to(device, dtype), residual.to(device, dtype)
                with torch.no_grad():
                    poison(4 * N * K * H * W)
                    plain = layer(xd)
                    torch.cuda.synchronize()
                    layer.activation = "relu"
                    poison(4 * N * K * H * W)
                    fused = layer(xd, rd)
                    torch.cuda.synchronize()
            # Compared on the GPU: a kernel reads every output element (initcheck: none left unwritten).
            errors = (relative_error(plain, plain_ref.to(device)), relative_error(fused, epilogue_ref.to(device)))
            ok = all(error < TOLERANCE[label] for error in errors)
            status = "ok" if ok else "WRONG"
            detail = f"rel err {errors[0]:.1e} (plain), {errors[1]:.1e} (residual+relu)"
        except Exception as error:  # one broken backend must not hide the others
            ok, status, detail = False, "ERROR", f"{type(error).__name__}: {str(error)[:300]}"
        if not ok:
            failures.append(f"{run_label} {label}")
        print(f"{run_label:22s} {label} N={N:<2d}: {status:5s} {detail} ({time.perf_counter() - start:.1f} s)", flush=True)



def shortcut_run(label: str, dtype: torch.dtype) -> str:
    """Backend `tensorcore` with a projection shortcut folded in (`nn.shortcut`): a 1x1 conv of
    C=16 plus a 1x1 stride-2 shortcut from 8 channels of 17x17, bias and ReLU; returns the detail."""
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig

    main_weight = torch.randn(K, 16, 1, 1, generator=generator) * (torch.rand(K, 16, 1, 1, generator=generator) > 0.5)
    short_weight = torch.randn(K, 8, 1, 1, generator=generator) * (torch.rand(K, 8, 1, 1, generator=generator) > 0.5)
    y, x2 = torch.randn(2, 16, H, W, generator=generator), torch.randn(2, 8, 2 * H - 1, 2 * W - 1, generator=generator)
    ref = (reference_conv(y, main_weight, bias, fp64=True)
           + reference_conv(x2, short_weight, None, stride=2, fp64=True)).relu()
    config = TensorCoreConfig(group=16, chunk=16, block_m=64, order="index")
    layer = SparseConv2d(main_weight.to(device, dtype), bias.to(device, dtype), backend="tensorcore", config=config,
                         activation="relu")
    layer.shortcut = SparseConv2d(short_weight.to(device, dtype), stride=2, backend="tensorcore", config=config)
    with torch.no_grad():
        poison(4 * 2 * K * H * W)
        out = layer(y.to(device, dtype).contiguous(memory_format=torch.channels_last),
                    shortcut_input=x2.to(device, dtype).contiguous(memory_format=torch.channels_last))
        torch.cuda.synchronize()
    if layer.shortcut_binding.call is None:
        raise RuntimeError("the shortcut was not folded into one kernel")
    error = relative_error(out, ref.to(device))
    if error >= TOLERANCE[label]:
        raise ValueError(f"rel err {error:.1e}")
    return f"rel err {error:.1e} (one kernel, shortcut + relu)"


if "tensorcore" in names:
    for label, dtype in DTYPES.items():
        start = time.perf_counter()
        try:
            status, detail = "ok", shortcut_run(label, dtype)
        except Exception as error:  # noqa: BLE001  (reported as the other runs are)
            status, detail = "ERROR", f"{type(error).__name__}: {str(error)[:300]}"
            failures.append(f"tensorcore-shortcut {label}")
        print(f"{'tensorcore-shortcut':22s} {label} N=2 : {status:5s} {detail} ({time.perf_counter() - start:.1f} s)",
              flush=True)

print(f"sanitize_layers: {len(failures)} failed{': ' + ', '.join(failures) if failures else ''}", flush=True)
sys.exit(1 if failures else 0)
