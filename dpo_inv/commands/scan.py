"""`python -m dpo_inv scan --structure PDB --output_dir D`: every single substitution scored, the map.

    python -m dpo_inv scan --model outputs/my_protein/final --structure my.pdb --chain_id A \\
        --ridge outputs/my_protein/augmented_ridge.json --output_dir outputs/my_protein/scan

Every amino acid at each position of `--positions` (default: every observed residue of the designed
chains) is scored as `score` scores a single mutant (`delta_logp`: the position decoded last given every
other residue), and with `--ridge` (an adapt run's predictor, with its `--model`) predicted in the label's
units. `D/scan.csv` holds one row per substitution in ProteinGym's columns (`mutant` in the structure's
author numbering, `K23G`, as `propose` writes mutations; `mutated_sequence`, the designed chains; the
scores); `D/positions.csv` per position: the wild type's log p, the entropy there, the mean `delta_logp` of
its substitutions (the more negative, the less change is tolerated) and its best substitution;
`D/heatmap.png` the map (needs matplotlib); `D/conditional_probs.npz` ProteinMPNN's
`--conditional_probs_only` output (`log_p`, `S`, `mask`, `design_mask`). A summary JSON line goes to stdout.
"""

from __future__ import annotations

import json

from dpo_inv.tools.scan import ScanConfig, scan_file

Config = ScanConfig


def run(config: ScanConfig) -> None:
    print(json.dumps(scan_file(config)))
