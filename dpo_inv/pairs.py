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

import argparse
import json
import sys
import traceback

import datasets
from transformers import HfArgumentParser

from dpo_inv.tools.pairs import PairsConfig, make_pairs


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(args: list[str] | None = None) -> PairsConfig:
    parser = HfArgumentParser(
        PairsConfig, prog="python -m dpo_inv.pairs", description=__doc__, formatter_class=_HelpFormatter
    )
    parser.add_argument("scored_file", nargs="?", metavar="SCORED_FILE", help="The scored sequences.")
    config, *extra, remaining = parser.parse_args_into_dataclasses(args, return_remaining_strings=True)
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    scored_file = extra[0].scored_file if extra else None
    if (scored_file is None) == (config.data is None):
        parser.error("give the scored sequences file once: SCORED_FILE or --data")
    config.data = config.data or scored_file
    return config


def main(args: list[str] | None = None) -> None:
    config = parse_args(args)
    datasets.disable_progress_bars()
    try:
        summary = make_pairs(config)
    except ValueError as err:  # DataError: one line per bad record, each naming the file, the record, the fix
        if config.debug:
            traceback.print_exc()
        print(err, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
