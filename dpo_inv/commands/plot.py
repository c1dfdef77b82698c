"""`python -m dpo_inv plot OUTPUT_DIR`: training curves from metrics.jsonl as PNG files (needs matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpo_inv.training.plot import plot


@dataclass
class PlotConfig:
    output_dir: str | None = field(
        default=None, metadata={"help": "A training output_dir, with metrics.jsonl."}
    )


Config = PlotConfig
POSITIONAL = ("output_dir", "OUTPUT_DIR", "training output folder")


def run(config: PlotConfig) -> None:
    for path in plot(config.output_dir):
        print(path)
