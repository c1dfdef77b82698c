"""`python -m dpo_inv pairs SCORED_FILE --output PAIRS.jsonl`: preference pairs from scored sequences, or
sequences labelled desirable or undesirable (for KTO).

    python -m dpo_inv pairs scored.jsonl --output pairs.jsonl --strategy best_vs_worst --min_margin 0.5
    python -m dpo_inv pairs scored.jsonl --output labelled.jsonl --labels_from_quantile 0.5

Sequences with a score (any format the trainer reads) are grouped by (structure, designed chains, fixed
chains); a sequence found twice in a group counts once, with its first score. A pair needs a strictly better
preferred sequence: a score difference > 0 and >= `--min_margin`, whatever the strategy. The pairs file is
what the trainer reads; a summary JSON line goes to stdout. Bad records are reported together, one line
each, and the exit status is 2.
"""

from __future__ import annotations

import json

from dpo_inv.tools.pairs import PairsConfig, pairs_file

Config = PairsConfig
POSITIONAL = ("data", "SCORED_FILE", "scored sequences")


def run(config: PairsConfig) -> None:
    print(json.dumps(pairs_file(config)))
