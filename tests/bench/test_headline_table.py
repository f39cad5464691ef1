"""The README's headline table is exactly what `bench.headline` renders from headline.json."""
import json

import pytest
from helpers.common import ROOT

from sparsecnn.bench.headline import END, START, readme_block, update_readme


def test_readme_holds_the_table_rendered_from_headline_json():
    readme = (ROOT / "README.md").read_text()
    assert readme_block(ROOT / "benchmarks" / "results" / "headline.json") in readme


def test_update_rewrites_a_stale_table_and_refuses_a_readme_without_markers(tmp_path):
    entry = {"what": "m", "baseline": "b", "ours_ms": 1.0, "baseline_ms": 2.0, "ratio": 2.0,
             "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26"}
    headline = tmp_path / "headline.json"
    headline.write_text(json.dumps({"entries": [entry]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{START}\nold\n{END}\nrest\n")
    assert update_readme(readme, headline)
    assert "| m | b | 1.000 | 2.000 | **2.00x** | H100, 2026-11-26 |" in readme.read_text()
    assert "old" not in readme.read_text() and readme.read_text().endswith("rest\n")
    assert not update_readme(readme, headline)
    headline.write_text(json.dumps({"entries": [entry, {**entry, "what": "hidden", "readme": False}]}))
    assert not update_readme(readme, headline) and "hidden" not in readme.read_text()
    (tmp_path / "bare.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="no headline block"):
        update_readme(tmp_path / "bare.md", headline)
