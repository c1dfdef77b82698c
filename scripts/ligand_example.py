"""The ligand example's pairs: sequences sampled from LigandMPNN around each structure's ligand, DNA and ions,
scored by the example oracle (`dpo_inv.tools.rewards`) and paired (`dpo-inv pairs`, 40 pairs per structure
with scores at least 0.05 apart).

    python scripts/ligand_example.py --output_dir data/ligand
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from dpo_inv import pairs, sample
from dpo_inv.tools.rewards import exposed_hydrophobic

STRUCTURES = Path(__file__).resolve().parents[1] / "data" / "structures"
# split -> (structure, designed chains, fixed chains)
TARGETS = {
    "train": [("1BC8.pdb.gz", ["C"], []), ("3mht.pdb.gz", ["A"], [])],
    "val": [("4GYT.pdb.gz", ["A"], ["B"])],
}


def sampled(model: str, structure: str, design: list[str], fixed: list[str], work: Path) -> list[dict]:
    """24 sequences of the designed chains at temperature 0.3, as records with their structure fields."""
    out = work / structure
    args = ["--model", model, "--structure", str(STRUCTURES / structure), "--output_dir", str(out)]
    args += ["--num_samples", "24", "--temperature", "0.3", "--seed", "7", "--design_chains", *design]
    sample.main(args + (["--fixed_chains", *fixed] if fixed else []))
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    fields = {"pdb_file": str(STRUCTURES / structure), "design_chains": design, "fixed_chains": fixed}
    return [{**fields, "sequence": record["sequence"]} for record in records]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output_dir", type=Path, default=Path("data/ligand"))
    parser.add_argument("--model", default="ligand/v_32_010_25")
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for split, targets in TARGETS.items():
            rows = [row for target in targets for row in sampled(args.model, *target, Path(tmp))]
            scored = Path(tmp) / f"{split}_scores.jsonl"
            with open(scored, "w") as handle:
                for row, score in zip(rows, exposed_hydrophobic(rows), strict=True):
                    row["pdb_file"] = os.path.relpath(row["pdb_file"], scored.parent)
                    handle.write(json.dumps({**row, "score": round(score, 4)}) + "\n")
            output = args.output_dir / f"{split}.jsonl"
            options = ["--strategy", "all", "--min_margin", "0.05", "--max_pairs_per_structure", "40"]
            pairs.main([str(scored), "--output", str(output), "--model", args.model, *options])


if __name__ == "__main__":
    main()
