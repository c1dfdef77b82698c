"""Unpaired preferences: KTO and APO-zero on sequences labelled desirable or undesirable (TRL's formulas).

KTO compares each sequence's log-ratio log pi - log pi_ref with a reference point z0, the KL divergence of
the policy from the reference. TRL estimates z0 from mismatched (prompt, completion) pairs; a sequence cannot
be placed on a structure of another length, so here z0 is the exact KL of the two models' per-position
distributions, summed over the sequence's loss positions with its own residues as context (teacher forcing),
averaged over the batch and all processes, detached and clamped at 0 as TRL does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpo_inv.data.batches import structure_inputs
from dpo_inv.models.mpnn import sequence_log_probs

UNPAIRED_LOSS_TYPES = ("kto", "apo_zero_unpaired")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "kl")  # fmt: skip


@dataclass
class LabelledLogps:
    """Summed log p of each sequence over its loss positions, and its KL term; averaged over orders."""

    logps: torch.Tensor  # [B]
    kl: torch.Tensor  # [B], detached


def labelled_logps(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    precision: AbstractContextManager | None = None,
) -> tuple[LabelledLogps, torch.Tensor]:
    """The policy's log p and KL term of each labelled sequence (`batch["sequence"]`), and the reference's
    log p, its forward run in `precision` (the policy's autocast, `objective.policy_precision`). `ranks` is
    [B, K, L]."""
    num_orders = ranks.shape[1]
    sequences = batch["sequence"].unsqueeze(1).expand(-1, num_orders, -1)
    inputs = structure_inputs(batch)
    log_probs = model(**inputs, S=sequences, ranks=ranks).float()  # [B, K, L, 21]
    with torch.no_grad(), precision or nullcontext():
        ref_log_probs = reference(**inputs, S=sequences, ranks=ranks).float()
    mask = batch["loss_mask"].unsqueeze(1)  # [B, 1, L]

    def summed(values: torch.Tensor) -> torch.Tensor:
        return (values * mask).sum(-1).mean(-1)

    detached = log_probs.detach()
    kl = summed((detached.exp() * (detached - ref_log_probs)).sum(-1))
    policy = LabelledLogps(logps=summed(sequence_log_probs(log_probs, sequences)), kl=kl)
    return policy, summed(sequence_log_probs(ref_log_probs, sequences))


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence loss and reward beta * (log p - log p_ref); `desirable` is [B] bool.

    kto: 1 - sigmoid(beta (r - z0)) for a desirable sequence, 1 - sigmoid(beta (z0 - r)) for an undesirable
    one (KTO, Ethayarajh et al. 2024, eq. 7); apo_zero_unpaired: the same with z0 = 0 and sigmoid(beta r)
    for an undesirable sequence (APO, D'Oosterlinck et al. 2024).
    """
    ratio = policy_logps - reference_logps
    if loss_type == "kto":
        chosen = 1 - F.sigmoid(beta * (ratio - z0))
        rejected = 1 - F.sigmoid(beta * (z0 - ratio))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - F.sigmoid(beta * ratio)
        rejected = F.sigmoid(beta * ratio)
    else:
        raise ValueError(
            f"unknown unpaired loss_type {loss_type!r}; choose from {', '.join(UNPAIRED_LOSS_TYPES)}"
        )
    losses = torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
    return losses, beta * ratio.detach()


def columns(
    losses: torch.Tensor,
    rewards: torch.Tensor,
    policy: LabelledLogps,
    desirable: torch.Tensor,
    z0: torch.Tensor,
) -> torch.Tensor:
    """Per-sequence metrics by name, whose sums `summarize` turns into TRL's KTO metrics: the desirable
    sequences fill the chosen ones, the others the rejected ones."""
    chosen, logps = desirable.float(), policy.logps.detach()
    rejected = 1 - chosen
    return {
        "loss": losses.detach(),
        "desirable": chosen,
        "rewards/chosen": rewards * chosen,
        "rewards/rejected": rewards * rejected,
        "logps/chosen": logps * chosen,
        "logps/rejected": logps * rejected,
        "kl": z0.expand_as(chosen),
    }


def summarize(sums: dict[str, float], count: int) -> dict[str, float]:
    """TRL's KTO metrics from the sums of `columns` over `count` sequences: means over the desirable
    (chosen) and undesirable (rejected) sequences; the chosen or rejected ones are left out when no
    sequence had that label."""
    num_chosen, num_rejected = sums["desirable"], count - sums["desirable"]
    metrics = {"loss": sums["loss"] / count}
    if num_chosen:
        metrics["rewards/chosen"] = sums["rewards/chosen"] / num_chosen
        metrics["logps/chosen"] = sums["logps/chosen"] / num_chosen
    if num_rejected:
        metrics["rewards/rejected"] = sums["rewards/rejected"] / num_rejected
        metrics["logps/rejected"] = sums["logps/rejected"] / num_rejected
    if num_chosen and num_rejected:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["kl"] = sums["kl"] / count
    return metrics
