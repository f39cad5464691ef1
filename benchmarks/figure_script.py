"""What the figure scripts (`dong_fig9.py`, `optprune_fig6.py`) share: their measuring options, the
device and timing they imply, reading one run's rows back for --replot, and plotting that leaves the
rows usable where matplotlib is missing. Imported by those scripts from this folder."""
import argparse
import json
import sys
from typing import Any, Callable, Dict, List

import torch


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


def measuring_device(args: argparse.Namespace) -> torch.device:
    """args.device, else cuda when available; SystemExit for a half-precision or TF32 run off CUDA."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and args.dtype != "fp32":
        raise SystemExit("on CPU only fp32 runs (no TF32, no half-precision baseline)")
    return device


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
