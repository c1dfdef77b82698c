"""Evaluation during training: the eval pairs' DPO metrics, greedy recovery, the eval variants' Spearman
correlations, and the choice of the best model."""

from __future__ import annotations

import math

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dpo_inv.data.batches import PreferenceDataset, collate
from dpo_inv.data.dataset import PairDataset
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.sampling import sample_sequences
from dpo_inv.models.variants import LabelledVariants, evaluate_variants
from dpo_inv.training.checkpoints import TrainerState
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loss import example_seeds
from dpo_inv.training.objective import metric_columns, step_metrics, summarize


@torch.no_grad()
def evaluate(accelerator, config, model, reference, loader, structures) -> dict[str, float]:
    """Metrics over the whole eval set, every pair counted once across ranks, and the native sequence
    recovery of greedy decoding on the eval structures (`structures`: this rank's share, one batch)."""
    model.eval()
    totals, count = torch.zeros(len(metric_columns(config)), dtype=torch.float64), 0
    for batch in loader:
        _, per_pair = step_metrics(config, model, reference, batch, 0, accelerator)
        gathered = accelerator.gather_for_metrics(per_pair).double().cpu()
        totals += gathered.sum(0)
        count += len(gathered)
    recovered = torch.zeros(2, device=accelerator.device)  # recovered, designed residues
    if structures is not None:
        batch = {k: v.to(accelerator.device) for k, v in structures.items()}
        seeds = example_seeds(config.seed, batch["index"], epoch=0)
        tokens = sample_sequences(
            accelerator.unwrap_model(model, keep_torch_compile=False), batch, 1, 0.0, seeds
        ).tokens[:, 0]
        designed = (batch["decode_mask"] * batch["mask"]) > 0
        recovered += torch.stack([((tokens == batch["native"]) & designed).sum(), designed.sum()]).float()
    recovered = accelerator.reduce(recovered, "sum")
    model.train()
    metrics = {f"eval_{name}": value for name, value in summarize(config, totals, count).items()}
    return {**metrics, "eval_recovery": float(recovered[0] / recovered[1])}


def eval_structures(accelerator: Accelerator, data: PairDataset) -> dict[str, torch.Tensor] | None:
    """One example per distinct eval structure, this rank's share, as one batch (None if it has none)."""
    _, first = np.unique(np.asarray(data.pairs["structure_id"]), return_index=True)
    dataset = PreferenceDataset(data)
    examples = [
        dataset[int(i)] for i in sorted(first)[accelerator.process_index :: accelerator.num_processes]
    ]
    return collate(examples) if examples else None


def run_evaluation(
    accelerator: Accelerator,
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN | None,
    eval_loader: DataLoader | None,
    recovery_structures: dict[str, torch.Tensor] | None,
    variants: LabelledVariants | None,
) -> dict[str, float]:
    """The eval pairs' metrics and greedy recovery, and the eval variants' Spearman correlations."""
    metrics: dict[str, float] = {}
    if eval_loader is not None:
        metrics.update(evaluate(accelerator, config, model, reference, eval_loader, recovery_structures))
    if variants is not None:
        model.eval()
        policy = accelerator.unwrap_model(model, keep_torch_compile=False)
        metrics.update(
            evaluate_variants(
                accelerator, policy, variants.data, variants.labels, config.decoding_order, config.seed
            )
        )
        model.train()
    return metrics


EVAL_SUMMARY = (("eval_loss", "eval loss", 4), ("eval_rewards/accuracies", "reward accuracy", 3),
                ("eval_rewards/margins", "margin", 3), ("eval_recovery", "greedy recovery", 3),
                ("eval_kl", "KL", 3), ("eval_spearman", "mean Spearman per structure", 3))  # fmt: skip


def describe(metrics: dict[str, float]) -> str:
    """The eval metrics a person reads first, in one line."""
    return ", ".join(
        f"{label} {metrics[name]:.{digits}f}" for name, label, digits in EVAL_SUMMARY if name in metrics
    )


def improved(config: DPOConfig, metrics: dict[str, float], state: TrainerState) -> bool:
    """Is `metric_for_best_model` better than at the model in best/? Records it in `state` if so."""
    value = metrics.get(config.metric_for_best_model, math.nan)  # kto: some may be missing
    if not math.isfinite(value):
        return False
    best = state.best_metric
    if best is not None and (value <= best if config.greater_is_better else value >= best):
        return False
    state.best_metric, state.best_step = value, state.global_step
    return True
