"""`python -m dpo_inv propose --campaign DIR ...`: the next batch of variants to make.

    python -m dpo_inv propose --campaign campaigns/trpb --structure 5DVZ_A.pdb.gz --chain_id A \\
        --positions "A:182,183,226,227" --max_mutations 4 --num_proposals 96

The first call starts the campaign: DIR/campaign.json keeps its design space and model, and DIR/round_1
gets the batch, `proposals.csv` (rank, mutations such as `V39F:D40W` in author numbering, sequence,
predicted value, uncertainty, the model's zero-shot joint delta_logp, what picked it) and
`proposals.fasta`. Put what the lab measured in DIR/round_1/measurements.csv (`mutations,value`, or
ProteinGym's `mutant,DMS_score`; controls that were not proposed are welcome) and call again with
`--campaign DIR` alone: the ensemble predictor is fitted on every measurement so far and round_2 is written.
Measurements made before the campaign: `--measurements FILE` (kept as DIR/round_0/measurements.csv).
With `--reward file.py:function` (or `--reward_command`, as `rounds` takes them) the proposals are
measured by it and written as the round's measurements; `--rounds N` runs N rounds so. A summary JSON line
per round goes to stdout.
"""

from __future__ import annotations

import json

from dpo_inv.campaign.propose import ProposeConfig, run_campaign

Config = ProposeConfig


def run(config: ProposeConfig) -> None:
    for summary in run_campaign(config):
        print(json.dumps(summary), flush=True)
