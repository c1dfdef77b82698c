"""A lab in a function: the TrpB four-site landscape of `../shared/campaign/trpb` as `propose`'s measurement.

    python -m dpo_inv propose ... --reward data/campaign/trpb_oracle.py:fitness --rounds 3

`fitness` reads each proposal's residues at the landscape's four sites and returns their measured fitness
(the best variant is 1); the 871 combinations the library did not measure come back as 0.
"""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

LANDSCAPE = Path(__file__).resolve().parents[2].parent / "shared" / "campaign" / "trpb"


@functools.cache
def landscape() -> tuple[list[int], dict[str, float]]:
    """The sites (0-based in the chain's sequence) and each combination's fitness."""
    sites = json.loads((LANDSCAPE / "landscape.json").read_text())["site_indices"]
    with open(LANDSCAPE / "variants.csv") as handle:
        return sites, {row["variant"]: float(row["fitness"]) for row in csv.DictReader(handle)}


def fitness(records: list[dict]) -> list[float]:
    """The measured fitness of each record's sequence (chain A of 5DVZ), 0 where the library has none."""
    sites, values = landscape()
    return [values.get("".join(r["sequence"].split("/")[0][i] for i in sites), 0.0) for r in records]
