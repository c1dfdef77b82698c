"""`python -m dpo_inv.adapt LABELLED_FILE --output_dir OUT [--model ...]`: adapt a model to one protein's
labelled variants (also `dpo-inv adapt`).

    python -m dpo_inv.adapt my_variants.jsonl --output_dir outputs/my_protein

Each record is a labelled sequence with its wild type: `pdb_file`, chains, `sequence`, `wildtype_seq` and a
number in `label` (or the field `--score_field` names; higher = better unless `--lower_is_better`). The
number of DPO steps and the learning rate are chosen by cross-validation over the labelled sequences (folds
grouped by position, so no position is on both sides); the model trained on every label is saved in
`OUT/final` unless it ranks held-out sequences no better than the starting model, which is then kept.
`OUT/adapt.json` holds the cross-validated Spearman of the starting model, the adapted model and the
augmented ridge baseline (one-hot + the starting model's score), per structure. Under `accelerate launch`
the folds are shared out over the processes.
"""

from __future__ import annotations

import sys
import traceback

import datasets
from accelerate import PartialState

from dpo_inv.cli import parse_with_file
from dpo_inv.data.records import DataError
from dpo_inv.structures.parse import StructureError
from dpo_inv.tools.adapt import AdaptConfig, adapt_file, summary_lines


def parse_args(args: list[str] | None = None) -> AdaptConfig:
    return parse_with_file(
        AdaptConfig, args, "python -m dpo_inv.adapt", __doc__, "LABELLED_FILE", "labelled sequences"
    )


def main(args: list[str] | None = None) -> None:
    config = parse_args(args)
    datasets.disable_progress_bars()
    try:
        report = adapt_file(config)
    except (DataError, StructureError, FileNotFoundError, ValueError) as err:
        if config.debug:
            traceback.print_exc()
        if PartialState().is_main_process:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if PartialState().is_main_process:
        print("\n".join(summary_lines(report)))


if __name__ == "__main__":
    main()
