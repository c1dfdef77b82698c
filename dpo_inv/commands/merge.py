"""`python -m dpo_inv merge ADAPTER --output DIR`: a LoRA adapter folder (a `use_peft` run's final/ or
best/) merged into its base model and written as a full model: config.json and model.safetensors, which
every command takes, and ProteinMPNN's own `proteinmpnn.pt`, which the official `protein_mpnn_run.py`
samples from (`--path_to_model_weights DIR --model_name proteinmpnn`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import adapter_base, is_adapter
from dpo_inv.models.weights import load_model


@dataclass
class MergeConfig:
    adapter: str | None = field(
        default=None, metadata={"help": "A LoRA adapter folder: a use_peft run's final/ or best/."}
    )
    output: str | None = field(
        default=None, metadata={"help": "The new folder the full model is written to."}
    )


Config = MergeConfig
POSITIONAL = ("adapter", "ADAPTER", "LoRA adapter folder")


def run(config: MergeConfig) -> None:
    if not config.adapter or not is_adapter(config.adapter):
        raise OptionError(
            f"{config.adapter}: not a LoRA adapter folder (no adapter_config.json); give a use_peft run's "
            "final/ or best/"
        )
    if not config.output:
        raise OptionError("--output: give the new folder to write the full model to")
    output = Path(config.output)
    if output.exists() and any(output.iterdir()):
        raise OptionError(f"--output {output}: exists and is not empty; give a new folder")
    load_model(config.adapter).save_pretrained(output)
    print(
        f"{config.adapter} merged into its base {adapter_base(config.adapter)}: full model in {output} "
        f"({output / 'proteinmpnn.pt'} for protein_mpnn_run.py)"
    )
