"""DPO training (and KTO, ResiDPO) of ProteinMPNN and LigandMPNN models.

    python -m dpo_inv.run --config configs/example.yaml [--field value ...]

`dpo-inv train` and `python -m dpo_inv train` are the same command. The exit statuses are listed below.
"""

from __future__ import annotations

from dpo_inv.training.config import EPILOG as EPILOG
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.trainer import train

Config = DPOConfig


def run(config: DPOConfig) -> None:
    train(config)
