"""`python -m dpo_inv.pairs SCORED_FILE --output PAIRS.jsonl`: preference pairs from scored sequences, or
sequences labelled desirable or undesirable (for KTO).

    python -m dpo_inv.pairs scored.jsonl --output pairs.jsonl --strategy best_vs_worst --min_margin 0.5
    python -m dpo_inv.pairs scored.jsonl --output labelled.jsonl --labels_from_quantile 0.5

Sequences with a score (any format the trainer reads) are grouped by (structure, designed chains, fixed
chains); a sequence found twice in a group counts once, with its first score. A pair needs a strictly better
preferred sequence: a score difference > 0 and >= `--min_margin`, whatever the strategy. The pairs file is
what the trainer reads; a summary JSON line goes to stdout. Bad records are reported together, one line
each, and the exit status is 2.
"""

from __future__ import annotations

import json
import sys
import traceback

import datasets

from dpo_inv.cli import parse_with_file
from dpo_inv.tools.pairs import PairsConfig, pairs_file


def parse_args(args: list[str] | None = None) -> PairsConfig:
    return parse_with_file(
        PairsConfig, args, "python -m dpo_inv.pairs", __doc__, "SCORED_FILE", "scored sequences"
    )


def main(args: list[str] | None = None) -> None:
    config = parse_args(args)
    datasets.disable_progress_bars()
    try:
        summary = pairs_file(config)
    except ValueError as err:  # DataError: one line per bad record, each naming the file, the record, the fix
        if config.debug:
            traceback.print_exc()
        print(err, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
