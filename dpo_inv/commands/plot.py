"""`python -m dpo_inv plot DIR`: training curves from a training output_dir's metrics.jsonl as PNG files, or
a campaign folder's picture, `campaign.png` (needs matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpo_inv.campaign.folder import CampaignFolder
from dpo_inv.campaign.propose import plot_campaign_folder
from dpo_inv.training.plot import plot


@dataclass
class PlotConfig:
    output_dir: str | None = field(
        default=None,
        metadata={"help": "A training output_dir, with metrics.jsonl, or a campaign folder (campaign.json)."},
    )


Config = PlotConfig
POSITIONAL = ("output_dir", "OUTPUT_DIR", "training output folder or campaign folder")


def run(config: PlotConfig) -> None:
    if CampaignFolder(Path(config.output_dir)).settings_file.exists():
        print(plot_campaign_folder(config.output_dir))
        return
    for path in plot(config.output_dir):
        print(path)
