"""Evaluation during training: the eval pairs' DPO metrics, greedy recovery, the eval variants' Spearman
correlations and their backbones' native recovery and log-likelihood, and the choice of the best model."""

from __future__ import annotations

import math

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import RecordSet, column
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.sampling import sample_sequences
from dpo_inv.models.variants import LabelledVariants, evaluate_variants
from dpo_inv.training.checkpoints import TrainerState
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loss import batch_ranks, example_seeds, sequence_logps
from dpo_inv.training.objective import add_rows, step_metrics, summarize


@torch.no_grad()
def design_metrics(
    accelerator: Accelerator,
    config: DPOConfig,
    model: torch.nn.Module,
    structures: list[dict],
    native_logp: bool = True,
) -> tuple[float, float]:
    """Over the designed residues of `structures` (this rank's share) on every rank: the native recovery of
    greedy decoding, and (with `native_logp`, else NaN) the native sequence's mean log p per residue. Each
    structure is decoded alone, so neither depends on the batch or the number of processes."""
    policy = accelerator.unwrap_model(model, keep_torch_compile=False)
    totals = torch.zeros(4, device=accelerator.device)  # recovered, designed, native log p, its positions
    for example in structures:
        batch = {k: v.to(accelerator.device) for k, v in collate([example]).items()}
        seeds = example_seeds(config.seed, batch["index"], epoch=0)
        tokens = sample_sequences(policy, batch, 1, 0.0, seeds).tokens[:, 0]
        designed = (batch["decode_mask"] * batch["mask"]) > 0
        totals[:2] += torch.stack([((tokens == batch["native"]) & designed).sum(), designed.sum()])
        if native_logp:
            ranks = batch_ranks(batch, config.seed, 1, config.decoding_order)
            native = sequence_logps(policy, batch, ranks, ("native",))
            totals[2:] += torch.stack([native.logps.sum(), native.num_positions.sum()])
    recovered, designed, logp, positions = accelerator.reduce(totals, "sum").tolist()
    return (recovered / designed if designed else math.nan, logp / positions if positions else math.nan)


@torch.no_grad()
def evaluate(accelerator, config, model, reference, loader, structures) -> dict[str, float]:
    """Metrics over the whole eval set, every pair counted once across ranks, and the native sequence
    recovery of greedy decoding on the eval structures (`structures`: this rank's share)."""
    model.eval()
    totals: dict[str, float] = {}
    count = 0
    for batch in loader:
        _, per_pair = step_metrics(config, model, reference, batch, 0, accelerator)
        gathered = accelerator.gather_for_metrics(per_pair)
        add_rows(totals, gathered)
        count += len(gathered["loss"])
    recovery, _ = design_metrics(accelerator, config, model, structures, native_logp=False)
    model.train()
    metrics = {f"eval_{name}": value for name, value in summarize(config, totals, count).items()}
    return {**metrics, "eval_recovery": recovery}


def eval_structures(accelerator: Accelerator, data: RecordSet) -> list[dict]:
    """One example per distinct eval structure, this rank's share."""
    _, first = np.unique(column(data.records, "structure_id"), return_index=True)
    dataset = ExampleDataset(data)
    return [dataset[int(i)] for i in sorted(first)[accelerator.process_index :: accelerator.num_processes]]


def run_evaluation(
    accelerator: Accelerator,
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN | None,
    eval_loader: DataLoader | None,
    recovery_structures: list[dict],
    variants: LabelledVariants | None,
) -> dict[str, float]:
    """The eval pairs' metrics and greedy recovery; the eval variants' Spearman correlations, and the native
    recovery and log-likelihood of their backbones."""
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
        recovery, logp = design_metrics(
            accelerator, config, model, eval_structures(accelerator, variants.data)
        )
        metrics.update({"eval_native_recovery": recovery, "eval_native_logp": logp})
        model.train()
    return metrics


EVAL_SUMMARY = (("eval_loss", "eval loss", 4), ("eval_rewards/accuracies", "reward accuracy", 3),
                ("eval_rewards/margins", "margin", 3), ("eval_recovery", "greedy recovery", 3),
                ("eval_kl", "KL", 3), ("eval_spearman", "mean Spearman per structure", 3),
                ("eval_native_recovery", "native recovery", 3),
                ("eval_native_logp", "native log p per residue", 3))  # fmt: skip


def describe(metrics: dict[str, float]) -> str:
    """The eval metrics a person reads first, in one line."""
    return ", ".join(
        f"{label} {metrics[name]:.{digits}f}" for name, label, digits in EVAL_SUMMARY if name in metrics
    )


def update_best(config: DPOConfig, metrics: dict[str, float], state: TrainerState) -> bool:
    """Record an evaluation in `state`'s best-model record: the starting model's native recovery (at step
    0), and this step as the best where `metric_for_best_model` beats the model in best/ with native
    recovery within `recovery_tolerance` of the start. True when this step is the new best."""
    value = metrics.get(config.metric_for_best_model, math.nan)  # kto: some may be missing
    recovery = metrics.get("eval_native_recovery")
    if state.global_step == 0 and recovery is not None:
        state.start_recovery = recovery
    tolerance, start = config.recovery_tolerance, state.start_recovery
    if tolerance is not None and start is not None and recovery < start - tolerance:
        return False
    if not math.isfinite(value):
        return False
    best = state.best_metric
    if best is not None and (value <= best if config.greater_is_better else value >= best):
        return False
    state.best_metric, state.best_step = value, state.global_step
    return True
