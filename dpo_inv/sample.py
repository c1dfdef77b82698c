"""`python -m dpo_inv.sample`: design sequences for backbone structures by autoregressive sampling.

    python -m dpo_inv.sample --model outputs/example/final --structure data/structures/1eteA.pdb.gz \\
        --num_samples 8 --temperature 0.1 --output_dir designs

Each structure gets `<name>.fa` with one record per sample, headed
`>1eteA|chains=A|sample=1|T=0.1|seed=0|log_likelihood=-0.912|recovery=0.463`; `samples.jsonl` holds every
sample. `log_likelihood` is the mean log p (untempered, unbiased) of the designed residues (observed, not
fixed), `recovery` the fraction of them that are the native residue.
"""

from __future__ import annotations

import sys

from transformers import HfArgumentParser

from dpo_inv.tools.sample import SampleConfig, sample_file


def main(args: list[str] | None = None) -> None:
    parser = HfArgumentParser(SampleConfig)
    try:
        (config,) = parser.parse_args_into_dataclasses(args)
        sample_file(config)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
