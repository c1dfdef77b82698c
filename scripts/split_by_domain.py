"""Split a scored variants file by domain, homologues kept on one side.

    python scripts/split_by_domain.py ../shared/stability/train.jsonl --output_dir outputs/stability/data \\
        --held_out 0.2 --seed 0

writes `train.jsonl` and `held_out.jsonl` (structure paths rewritten to resolve from `output_dir`). Domains
are the values of `--domain_field` (default `domain`; else the structure file); two domains are homologues
when their PDB codes (first four characters) match or their wild-type sequences share at least
`--max_identity` identity over a local alignment (matches / shorter length). Whole clusters of homologues are
drawn, seeded, into the held-out side until it holds `--held_out` of the domains.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from Bio import Align


def local_identity(a: str, b: str) -> float:
    aligner = Align.PairwiseAligner(
        mode="local", match_score=1, mismatch_score=0, open_gap_score=-1, extend_gap_score=-0.5
    )
    return aligner.score(a, b) / min(len(a), len(b))


def clusters(wildtypes: dict[str, str], max_identity: float) -> list[list[str]]:
    """Connected components of the homology graph, each sorted, in order of their first domain."""
    parent = {name: name for name in wildtypes}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    names = sorted(wildtypes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a[:4].lower() == b[:4].lower() or local_identity(wildtypes[a], wildtypes[b]) >= max_identity:
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(root(name), []).append(name)
    return list(groups.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("data", type=Path)
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--held_out", type=float, default=0.2, help="fraction of domains held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domain_field", default="domain")
    parser.add_argument("--max_identity", type=float, default=0.4)
    args = parser.parse_args()

    records = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    domain = [str(r.get(args.domain_field) or r["pdb_file"]) for r in records]
    wildtypes = {d: r.get("wildtype_seq") or r["sequence"] for d, r in zip(domain, records, strict=True)}
    groups = clusters(wildtypes, args.max_identity)
    random.Random(args.seed).shuffle(groups)
    held_out: set[str] = set()
    for group in groups:
        if len(held_out) >= args.held_out * len(wildtypes):
            break
        held_out.update(group)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    source = args.data.resolve().parent
    sides = {"train.jsonl": [], "held_out.jsonl": []}
    for d, record in zip(domain, records, strict=True):
        path = (source / record["pdb_file"]).resolve()
        record = {**record, "pdb_file": os.path.relpath(path, args.output_dir.resolve())}
        sides["held_out.jsonl" if d in held_out else "train.jsonl"].append(record)
    for name, rows in sides.items():
        with open(args.output_dir / name, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    print(
        json.dumps(
            {
                "domains": len(wildtypes),
                "clusters": len(groups),
                "train_domains": len(wildtypes) - len(held_out),
                "held_out_domains": len(held_out),
                "train_records": len(sides["train.jsonl"]),
                "held_out_records": len(sides["held_out.jsonl"]),
            }
        )
    )


if __name__ == "__main__":
    main()
