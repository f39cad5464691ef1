"""What the figure and table scripts (`dong_fig9.py`, `optprune_fig6.py`, `unsparse_table9.py`,
`optprune_partitioner.py`) share: their measuring options, the device and timing they imply, cuDNN
as `bench layers` runs its baselines, one measurement that leaves out what runs out of memory,
reading one run's rows back for --replot, and plotting that leaves the rows usable where matplotlib
is missing. Imported by those scripts from this folder."""
import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from sparsecnn.bench.layers import free_memory, is_out_of_memory, measure, precision
from sparsecnn.bench.schema import torch_dtype
from sparsecnn.core.spec import ConvSpec

HALF = (torch.float16, torch.bfloat16)


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_measuring_options(parser: argparse.ArgumentParser, budget_unit: str) -> None:
    """--device, --mode, --warmup-ms, --rep-ms, --max-rep, --seed, --budget-s (start no `budget_unit`
    after that many seconds), --plot, --smoke, --replot, --run."""
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--mode", choices=("gpu", "eager"), default="gpu",
                        help="gpu: GPU time alone (launch overhead hidden, as bench layers --mode gpu)")
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument("--max-rep", type=int, default=100,
                        help="most timed repeats per measurement (each follows a 256 MB L2 flush on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None, help=f"start no {budget_unit} after this many seconds")
    parser.add_argument("--plot", default=None, help="PNG of the figure (needs matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-checkable run (see the docstring)")
    parser.add_argument("--replot", action="store_true", help="no measuring: report (and --plot) OUT's rows")
    parser.add_argument("--run", default=None, help="with --replot: the run to show (default: the last one)")


def measuring_device(args: argparse.Namespace, dtypes: Optional[Sequence[str]] = None) -> torch.device:
    """args.device, else cuda when available; SystemExit for a half-precision or TF32 run off CUDA.
    dtypes: the dtype names the run measures (default: [args.dtype])."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = list(dtypes or [args.dtype])
    if device.type != "cuda" and dtypes != ["fp32"]:
        raise SystemExit(f"{','.join(dtypes)}: on CPU only fp32 runs (no TF32, no half-precision baseline)")
    return device


def cudnn_fn(x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec, dtype: str) -> Callable[[], torch.Tensor]:
    """cuDNN as `bench layers` runs its baselines: `F.conv2d` of x (N, C, H, W) and weight
    (K, C/groups, R, S), both cast to dtype name `dtype`'s storage type once, NCHW for fp32 and TF32,
    channels_last for half types."""
    stored = torch_dtype(dtype)
    layout = torch.channels_last if stored in HALF else torch.contiguous_format
    x = x.to(dtype=stored, memory_format=layout)
    weight = weight.to(dtype=stored, memory_format=layout)
    return lambda: F.conv2d(x, weight, None, spec.stride, spec.padding, spec.dilation, spec.groups)


def measure_or_none(make_fn: Callable[[], Callable[[], torch.Tensor]], ref: torch.Tensor, device: torch.device,
                    dtype: str, timing_kwargs: Dict[str, Any], what: str,
                    leave_out_failures: bool = False) -> Optional[Dict[str, float]]:
    """`measure` (median_ms, p20_ms, p80_ms, rel_err against `ref`) of make_fn()'s callable under
    dtype's precision flags, without autograd. None, with a note naming `what`, when it runs out of
    memory, or with leave_out_failures when it fails in any way (a candidate the kernel cannot run,
    left out as the tuner drops it); other errors propagate."""
    try:
        with precision(dtype), torch.no_grad():
            return measure(make_fn(), ref, device, timing_kwargs)
    except Exception as error:  # noqa: BLE001  (re-raised below unless it is one we leave out)
        if not (is_out_of_memory(error) or leave_out_failures):
            raise
        reason = "out of memory" if is_out_of_memory(error) else f"{type(error).__name__}: {error}"
    free_memory(device)
    note(f"{what} left out: {reason}")
    return None


def timing(args: argparse.Namespace) -> Dict[str, Any]:
    """`tuning.benchmark` keywords from the options (--smoke: one untimed-warm-up repeat)."""
    if args.smoke:
        return {"warmup_ms": 0.0, "rep_ms": 0.0, "min_rep": 1}
    return {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "max_rep": args.max_rep}


def run_rows(path: str, kind: str, run: str = None) -> List[dict]:
    """The rows of `kind` in the JSON-lines file `path` from run `run` (None: the file's last run)."""
    with open(path) as f:
        rows = [row for row in map(json.loads, filter(str.strip, f)) if row.get("kind") == kind]
    if not rows:
        raise SystemExit(f"{path}: no {kind} rows")
    run = run or rows[-1]["run"]
    return [row for row in rows if row["run"] == run]


def plot_or_note(plot: Callable[[List[dict], str], None], rows: List[dict], path: str) -> None:
    """plot(rows, path), or a note where matplotlib is missing (the rows are written: --replot later)."""
    try:
        plot(rows, path)
    except ImportError as error:
        note(f"no plot ({error}): run with --replot --plot where matplotlib is installed")
