"""Scored sequences from the bundled example pairs: every distinct sequence of a pairs file with the example
oracle's score and per-residue scores (`dpo_inv.tools.rewards`), the input of `dpo-inv pairs`.

    python scripts/example_scores.py data/pairs/train.jsonl --output data/scores/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from dpo_inv.tools.rewards import exposed_hydrophobic, residue_scores

STRUCTURE_FIELDS = ("chain_id", "design_chains", "fixed_chains")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("pairs", type=Path, help="A pairs file (JSON lines).")
    parser.add_argument("--output", type=Path, required=True, help="The scored sequences (JSON lines).")
    args = parser.parse_args()
    rows, seen = [], set()
    for line in args.pairs.open():
        pair = json.loads(line)
        pdb_file = (args.pairs.parent / pair["pdb_file"]).resolve()
        structure = {name: pair[name] for name in STRUCTURE_FIELDS if name in pair}
        for sequence in (pair["preferred_seq"], pair["unpreferred_seq"]):
            if (str(pdb_file), sequence) not in seen:
                seen.add((str(pdb_file), sequence))
                rows.append({"pdb_file": str(pdb_file), **structure, "sequence": sequence})
    scores = exposed_hydrophobic(rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as handle:
        for row, score in zip(rows, scores, strict=True):
            out = {**row, "pdb_file": os.path.relpath(row["pdb_file"], args.output.resolve().parent)}
            out.update(score=round(score, 4), residue_scores=residue_scores(row))
            handle.write(json.dumps(out) + "\n")
    print(f"{len(rows)} scored sequences written to {args.output}")


if __name__ == "__main__":
    main()
