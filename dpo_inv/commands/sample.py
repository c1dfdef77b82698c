"""`python -m dpo_inv sample`: design sequences for backbone structures by autoregressive sampling.

    python -m dpo_inv sample --model outputs/example/final --structure data/structures/1eteA.pdb.gz \\
        --num_samples 8 --temperature 0.1 --output_dir designs

Each structure gets `<name>.fa`, as ProteinMPNN writes it: first the native sequence under the run's
settings (`>1eteA|native|chains=A|model=...|T=0.1|seed=0|num_samples=8`), then one record per sample,
headed `>1eteA|chains=A|sample=1|T=0.1|seed=0|log_likelihood=-0.912|recovery=0.463`, with `/` between
designed chains. `samples.jsonl` holds every sample (a relative structure path made relative to its
folder), the input of `score` and `pairs`; a second run into the same folder is refused
unless `--overwrite`. `log_likelihood` is the mean log p (untempered, unbiased) of the designed residues
(observed, not fixed), `recovery` the fraction of them that are the native residue.
"""

from __future__ import annotations

from dpo_inv.tools.sample import SampleConfig, sample_file

Config = SampleConfig


def run(config: SampleConfig) -> None:
    sample_file(config)
