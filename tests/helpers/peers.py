"""What the peer adapters' tests share: bench_layers rows of a peer, checked against the schema."""
from typing import List, Sequence

from sparsecnn.bench import bench_layers, validate_row
from sparsecnn.bench.peers import PEER_PREFIX, Peer
from sparsecnn.core.spec import ConvSpec

FAST = dict(warmup_ms=1, rep_ms=5, min_rep=3)  # timing keywords: a few calls, the numbers unused


def peer_rows(peer: Peer, specs: Sequence[ConvSpec], device: str, dtype: str = "fp32", sparsity: float = 0.7,
              **options) -> List[dict]:
    """The rows of `peer`'s variants from `bench_layers` on `specs` at dtype name `dtype` (no backend of
    ours), every row of the run valid; options go to bench_layers (e.g. baselines=False)."""
    rows = bench_layers(list(specs), suite="tiny", sparsity=sparsity, pattern="random", dtype=dtype, backends=[],
                        device=device, progress=False, timing=FAST, peers=[peer], **options)
    for row in rows:
        validate_row(row)
    return [row for row in rows if row["backend"].startswith(PEER_PREFIX)]


def assert_one_row_per_variant(rows: List[dict], layers: Sequence[str], variants: Sequence[str], dtype: str = "fp32",
                               max_rel_err: float = 1e-5) -> None:
    """Rows in order: every layer in `layers`, each variant once; all of `dtype`, within max_rel_err of fp64."""
    assert [(row["layer"], row["backend"]) for row in rows] == [
        (layer, PEER_PREFIX + variant) for layer in layers for variant in variants]
    assert all(row["rel_err"] < max_rel_err and row["dtype"] == dtype for row in rows)
