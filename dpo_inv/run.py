"""`python -m dpo_inv.run --config CONFIG.yaml [--field value ...]`: DPO training (also `dpo-inv train`)."""

from __future__ import annotations

from dpo_inv.config import parse_config
from dpo_inv.train import train


def main(args: list[str] | None = None) -> None:
    train(parse_config(args))


if __name__ == "__main__":
    main()
