"""The model card (README.md) of a trained model's folder, as TRL writes one: what was trained on what (the
base, the data, the losses, the steps) and its final metrics, how to use it, versions and citations."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from dpo_inv.training.config import DPOConfig

METHODS = {"pairs": "DPO", "labelled": "KTO", "structures": "SFT"}
PACKAGES = ("dpo_inv", "torch", "accelerate", "transformers", "trl", "peft")
CITATIONS = {
    "DPO": """@inproceedings{rafailov2023direct,
    title     = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},
    author    = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and
                 Stefano Ermon and Chelsea Finn},
    year      = 2023,
    booktitle = {Advances in Neural Information Processing Systems 36 (NeurIPS 2023)}
}""",
    "KTO": """@article{ethayarajh2024kto,
    title   = {{KTO: Model Alignment as Prospect Theoretic Optimization}},
    author  = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe Kiela},
    year    = 2024,
    journal = {arXiv preprint arXiv:2402.01306}
}""",
    "ProteinMPNN": """@article{dauparas2022robust,
    title   = {{Robust deep learning-based protein sequence design using ProteinMPNN}},
    author  = {Justas Dauparas and Ivan Anishchenko and Nathaniel Bennett and others},
    year    = 2022,
    journal = {Science},
    volume  = 378,
    pages   = {49--56}
}""",
    "LigandMPNN": """@article{dauparas2025atomic,
    title   = {{Atomic context-conditioned protein sequence design using LigandMPNN}},
    author  = {Justas Dauparas and Gyu Rie Lee and Robert Pecoraro and others},
    year    = 2025,
    journal = {Nature Methods},
    volume  = 22,
    pages   = {717--723}
}""",
}


@dataclass
class Trained:
    """What a run trained: its examples and structures, eval examples, steps and epochs, the model in the
    folder (the last, or the best eval's), and the metrics of the last log line and evaluation."""

    examples: int
    structures: int
    eval_examples: int
    steps: int
    epochs: float
    chosen: str  # which model the folder holds: the last step's, or the best eval's
    metrics: dict[str, float]
    ligand: bool  # a model of LigandMPNN's family


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def model_card(config: DPOConfig, trained: Trained, folder: Path) -> str:
    """The card's text (YAML front matter, then Markdown)."""
    method = METHODS[config.record_kind]
    ligand = config.model_name_or_path.startswith("ligand/")
    tags = [
        "dpo_inv",
        method.lower(),
        "protein-design",
        "inverse-folding",
        "ligandmpnn" if ligand else "proteinmpnn",
    ]
    front = {
        "base_model": config.model_name_or_path,
        "library_name": "peft" if config.use_peft else "dpo_inv",
        "model_name": folder.name,
        "tags": tags + (["lora"] if config.use_peft else []),
    }
    unit = {"pairs": "preference pairs", "labelled": "labelled sequences", "structures": "structure records"}
    unit = unit[config.record_kind]
    evals = f", evaluated on {trained.eval_examples} {unit}" if trained.eval_examples else ""
    losses = ", ".join(f"{t} ({w:g})" for t, w in zip(config.loss_type, config.loss_weights, strict=True))
    adapter = f"a LoRA adapter (r {config.lora_r}, alpha {config.lora_alpha}) of " if config.use_peft else ""
    reference = "none" if config.reference_free else config.ref_model_name_or_path or "the starting weights"
    batch = (
        f"{config.per_device_train_batch_residues} residues"
        if config.per_device_train_batch_residues
        else f"{config.per_device_train_batch_size} examples"
    )
    settings = {
        "loss_type (loss_weights)": losses,
        "beta": f"{config.beta:g}",
        "reference": reference,
        "optimizer steps (epochs)": f"{trained.steps} ({trained.epochs:.2f})",
        "batch per device, gradient accumulation": f"{batch}, {config.gradient_accumulation_steps}",
        "learning rate, schedule": f"{config.learning_rate:g}, {config.lr_scheduler_type}",
        "precision": config.mixed_precision,
        "seed": str(config.seed),
    }
    rows = "\n".join(f"| {name} | {value} |" for name, value in settings.items())
    results = "\n".join(f"| {name} | {value:.4g} |" for name, value in sorted(trained.metrics.items()))
    versions = "\n".join(f"- {name}: {package_version(name)}" for name in PACKAGES)
    cited = [method if method in CITATIONS else "DPO", "LigandMPNN" if ligand else "ProteinMPNN"]
    citations = "\n\n".join(f"Cite {name} as:\n\n```bibtex\n{CITATIONS[name]}\n```" for name in cited)
    return f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---

# Model card for {folder.name}

This model is {adapter}`{config.model_name_or_path}` fine-tuned by {method} with dpo_inv on \
{trained.examples} {unit} of {trained.structures} structure{"s" * (trained.structures != 1)} \
(`{config.train_file}`){evals}: \
{trained.chosen}.

## Quick start

```bash
python -m dpo_inv score --model {folder} --data PAIRS.jsonl --output scores.jsonl
python -m dpo_inv sample --model {folder} --structure STRUCTURE.pdb --num_samples 8 --output_dir designs
```

```python
import dpo_inv

model = dpo_inv.load_model("{folder}")
```

## Training procedure

| setting | value |
|---|---|
{rows}

The whole configuration is the run's `config.yaml`, beside this folder; the metrics of every step are in its
`metrics.jsonl`.

## Results

| metric | value |
|---|---|
{results}

## Framework versions

{versions}

## Citations

{citations}
"""


def write_model_card(config: DPOConfig, trained: Trained, folder: Path) -> None:
    """Write README.md into a model's folder (over peft's template in an adapter's)."""
    (folder / "README.md").write_text(model_card(config, trained, folder))
