"""How much of each DLMC ResNet-50 layer's weight re-pruning into tiles keeps (issue 32, item 6).

No ImageNet here, so no accuracy: per layer, the DLMC magnitude-pruning mask at SPARSITY with
values drawn as the layer benchmarks draw them (`bench.patterns.make_weight`, seed 0), re-pruned by
`prune.tiles.reprune_tiles` at the same kept count for each tile size, and the fraction of the
pruned weight's sum of w^2 the tiles keep ("l2_kept"). CPU only; needs the DLMC masks
(`SPARSECNN_DLMC`, `shared/data/dlmc-rn50` or `.carry/dlmc-rn50`).

Usage: PYTHONPATH=src python benchmarks/tiles_l2_dlmc.py OUT.jsonl [SPARSITY]
One row per (layer, tile): the environment fields, kind "tiles-l2", layer, shape, sparsity,
pattern, tile (16, 32, 64 or "auto" with the size it chose), l2_kept, seconds. Prints the median
and range of l2_kept per tile size.
"""
import json
import statistics
import sys
import time

from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.layers.suites import get_suite
from sparsecnn.prune.tiles import TileParams, reprune_tiles

OUT = sys.argv[1]
SPARSITY = float(sys.argv[2]) if len(sys.argv) > 2 else 0.9
PATTERN, SEED, TILES = "dlmc-magnitude_pruning", 0, (16, 32, 64, "auto")

run = dict(run=new_run_id(), **environment("cpu"))
rows = []
for spec in get_suite("resnet50", batch=32):
    weight, _ = make_weight(spec, SPARSITY, PATTERN, SEED, "cpu")
    for tile in TILES:
        start = time.perf_counter()
        decomposition = reprune_tiles(weight, weight != 0, TileParams(tile=tile))
        rows.append(dict(run, kind="tiles-l2", layer=spec.name, shape=list(weight.shape), sparsity=SPARSITY,
                         pattern=PATTERN, seed=SEED, tile=tile, chosen_tile=decomposition.tile,
                         l2_kept=decomposition.l2_kept, seconds=time.perf_counter() - start))
with open(OUT, "a") as out:
    out.writelines(json.dumps(row) + "\n" for row in rows)
for tile in TILES:
    kept = [row["l2_kept"] for row in rows if row["tile"] == tile]
    print(f"tile {tile!s:>4}: l2 kept median {statistics.median(kept):.3f}, min {min(kept):.3f}, "
          f"max {max(kept):.3f} over {len(kept)} layers")
print(f"{len(rows)} rows appended to {OUT}")
