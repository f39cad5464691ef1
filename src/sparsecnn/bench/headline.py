"""The README's headline table, rendered from `benchmarks/results/headline.json` (one row per entry).

`python -m sparsecnn.bench.headline [README.md [headline.json]]` rewrites the table between the
README's `<!-- headline table ... -->` and `<!-- end headline table -->` markers; a test checks that
the README holds exactly what this renders, so the two cannot drift apart.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List

START = "<!-- headline table: generated from benchmarks/results/headline.json -->"
END = "<!-- end headline table -->"
_BLOCK = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(entries: List[Dict[str, Any]]) -> str:
    """Markdown table of headline entries: what, dense baseline as it ran, times, ratio, GPU, date."""
    lines = ["| what | dense baseline (as it ran) | ours ms | dense ms | speedup | GPU, date |",
             "|---|---|---:|---:|---:|---|"]
    for entry in entries:
        gpu = entry["device"].replace("NVIDIA ", "").split(" ")[0]
        lines.append(f"| {entry['what']} | {entry['baseline']} | {_ms(entry['ours_ms'])} | "
                     f"{_ms(entry['baseline_ms'])} | **{entry['ratio']:.2f}x** | {gpu}, {entry['date']} |")
    return "\n".join(lines)


def readme_block(headline: Path) -> str:
    """The README block (markers included) for the entries of the headline file at `headline` that
    are marked for the README (`"readme": true`, the default; the others are in RESULTS.md)."""
    entries = [entry for entry in json.loads(Path(headline).read_text())["entries"] if entry.get("readme", True)]
    return f"{START}\n{render(entries)}\n{END}"


def update_readme(readme: Path, headline: Path) -> bool:
    """Replace the README's headline block; True if the text changed. ValueError without markers."""
    text = Path(readme).read_text()
    if not _BLOCK.search(text):
        raise ValueError(f"{readme} has no headline block: add the lines {START!r} and {END!r}")
    new = _BLOCK.sub(lambda _: readme_block(headline), text)
    Path(readme).write_text(new)
    return new != text


if __name__ == "__main__":
    args = sys.argv[1:] + ["README.md", "benchmarks/results/headline.json"][len(sys.argv[1:]):]
    print("updated" if update_readme(Path(args[0]), Path(args[1])) else "unchanged")
