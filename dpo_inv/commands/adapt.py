"""`python -m dpo_inv adapt LABELLED_FILE --output_dir OUT [--model ...]`: adapt a model to one protein's
labelled variants.

    python -m dpo_inv adapt my_variants.jsonl --output_dir outputs/my_protein

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

from accelerate import PartialState

from dpo_inv.tools.adapt import AdaptConfig, adapt_file, summary_lines

Config = AdaptConfig
POSITIONAL = ("data", "LABELLED_FILE", "labelled sequences")


def run(config: AdaptConfig) -> None:
    report = adapt_file(config)
    if PartialState().is_main_process:
        print("\n".join(summary_lines(report)))
