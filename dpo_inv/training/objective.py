"""The objective of one batch: policy and reference log-probabilities, the loss, per-example metric rows,
and the metrics they sum to — for pairs (DPO and its relatives), labelled sequences (KTO) and structure
records (SFT)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from accelerate import Accelerator

from dpo_inv.data.batches import REFERENCE_COLUMNS
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.training import kto, sft
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loss import (
    METRICS,
    PairLogps,
    ResidueScores,
    anchor_kl,
    batch_ranks,
    pair_logps,
    preference_loss,
    reward_accuracies,
)

Rows = dict[str, torch.Tensor]  # per-example metric values by name, each [B]


def add_rows(totals: dict[str, float], rows: Rows) -> None:
    """Add each metric's sum over the examples of ``rows`` to ``totals``, by name."""
    for name, values in rows.items():
        totals[name] = totals.get(name, 0.0) + float(values.double().sum())


def summarize(config: DPOConfig, totals: dict[str, float], count: int) -> dict[str, float]:
    """The metrics of `count` examples whose rows sum to `totals`: TRL's names (`METRICS`, KTO's, SFT's)."""
    if config.record_kind == "structures":
        return sft.summarize(totals)
    if config.unpaired:
        return kto.summarize(totals, count)
    return {name: totals[name] / count for name in METRICS}


def policy_precision(accelerator: Accelerator | None) -> AbstractContextManager:
    """The precision the policy's forward runs in: the autocast that `Accelerator.prepare` wraps it in
    (bf16, or fp16 on a GPU), nothing in fp32 or without `accelerator`. The reference, which is not
    prepared, runs its forward in it too, live, precomputed and in evaluation: with the policy's weights
    its log-probs are then the policy's, and the rewards of the starting model exactly 0."""
    return accelerator.autocast() if accelerator is not None else nullcontext()


def reference_logps(
    config: DPOConfig,
    reference: ProteinMPNN | None,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    accelerator: Accelerator | None = None,
) -> PairLogps | None:
    """The reference's log-probs of a batch's pairs: none when reference-free, the precomputed ones the
    batch carries, or the reference's forward in the policy's precision."""
    if config.reference_free:
        return None
    if REFERENCE_COLUMNS[0] in batch:
        return PairLogps(*(batch[name] for name in REFERENCE_COLUMNS), batch["loss_mask"].sum(-1))
    with torch.no_grad(), policy_precision(accelerator):
        return pair_logps(reference, batch, ranks)


def step_metrics(
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN | None,
    batch: dict[str, torch.Tensor],
    epoch: int,
    accelerator: Accelerator | None = None,
) -> tuple[torch.Tensor, Rows]:
    """Mean loss of a batch (what is back-propagated) and its per-example metrics by name.

    With `accelerator`, a collective for KTO (z0 is averaged over all processes): every rank calls it
    once per batch; without, z0 is this batch's."""
    ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
    return batch_objective(config, model, reference, batch, ranks, accelerator)


def batch_objective(
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN | None,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    accelerator: Accelerator | None = None,
) -> tuple[torch.Tensor, Rows]:
    """:func:`step_metrics` under given decoding ranks ``[B, K, L]``: device work alone, no value read
    on the host (what a CUDA graph captures)."""
    if config.record_kind == "structures":
        return sft.sft_step(model, batch, ranks, config.label_smoothing_factor, accelerator)
    if config.unpaired:
        return unpaired_step(config, model, reference, batch, ranks, accelerator)
    policy = pair_logps(model, batch, ranks)
    scores = None
    if "chosen_scores" in batch:
        scores = ResidueScores(
            batch["chosen_scores"],
            batch["rejected_scores"],
            batch["loss_mask"],
            config.residue_margin,
            config.residue_constraint_threshold,
        )
    ref = reference_logps(config, reference, batch, ranks, accelerator)
    losses, out = preference_loss(
        policy,
        ref,
        batch["weight"],
        beta=config.beta,
        loss_types=config.loss_type,
        loss_weights=config.loss_weights,
        label_smoothing=config.label_smoothing,
        residue_scores=scores,
        residue_constraint_weight=config.residue_constraint_weight,
    )
    if config.anchor_weight:  # the residues the pair does not score stay where the reference has them
        losses = losses + config.anchor_weight * anchor_kl(policy, ref, batch["mask"] - batch["loss_mask"])
    per_pair = {
        "loss": losses.detach(),
        "rewards/chosen": out.chosen_rewards,
        "rewards/rejected": out.rejected_rewards,
        "rewards/accuracies": reward_accuracies(out, policy, ref, config.beta),
        "rewards/margins": out.chosen_rewards - out.rejected_rewards,
        "logps/chosen": policy.chosen.detach(),
        "logps/rejected": policy.rejected.detach(),
    }
    return losses.mean(), per_pair


def unpaired_step(
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    accelerator: Accelerator | None,
) -> tuple[torch.Tensor, Rows]:
    """KTO or APO-zero on labelled sequences, z0 the batch's KL term averaged over all processes."""
    policy, ref_logps = kto.labelled_logps(model, reference, batch, ranks, policy_precision(accelerator))
    kl = accelerator.gather(policy.kl) if accelerator is not None else policy.kl
    z0 = kl.mean().clamp(min=0)
    desirable = batch["label"] > 0
    losses, rewards = kto.kto_loss(
        policy.logps,
        ref_logps,
        desirable,
        z0,
        config.beta,
        config.loss_type[0],
        config.desirable_weight,
        config.undesirable_weight,
    )
    losses = losses * batch["weight"]
    return losses.mean(), kto.columns(losses, rewards, policy, desirable, z0)
