"""`python -m dpo_inv score`: log-probabilities of preference pairs or of sequences under a model.

    python -m dpo_inv score --model outputs/example/final --reference vanilla/v_48_020 \\
        --data data/pairs/val.jsonl --output scores.jsonl

Pairs get `preferred_logp`, `unpreferred_logp` (and, with a reference, `preferred_reward`,
`unpreferred_reward`). Sequences (`sequence`, optional `label`, `wildtype_seq`) get `delta_logp` (variant
minus wild type) when they have a wild type, from one encoder pass per structure (`--variant_scoring
conditional`, the default) or from two full-sequence passes per record (`full`, which also gives `logp` and
`logp_per_residue`); without a wild type, `logp` and `logp_per_residue`. With labels, Spearman's rank
correlation is reported pooled and per structure (mean and median over structures, as ProteinGym reports
it). `--ridge OUT/augmented_ridge.json` (with `--model OUT/final`, both from `python -m dpo_inv adapt`) adds
`predicted_<label field>`, the augmented ridge model on `delta_logp`, and reports its Spearman. A summary
JSON line goes to stdout.
"""

from __future__ import annotations

import json

from dpo_inv.tools.score import ScoreConfig, score_file

Config = ScoreConfig


def run(config: ScoreConfig) -> None:
    print(json.dumps(score_file(config)))
