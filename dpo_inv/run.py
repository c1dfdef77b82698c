"""`python -m dpo_inv.run --config CONFIG.yaml [--field value ...]`: DPO training (also `dpo-inv train`).
The exit statuses are listed by `--help`."""

from __future__ import annotations

from dpo_inv.training.config import parse_config
from dpo_inv.training.stopping import run_job
from dpo_inv.training.trainer import train


def main(args: list[str] | None = None) -> None:
    config = parse_config(args)
    run_job(lambda: train(config), config.debug)


if __name__ == "__main__":
    main()
