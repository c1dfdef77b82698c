"""One module per command of `dpo-inv` (see `dpo_inv.cli`): its `--help` text, its options, what it runs."""
