"""Paired preference losses (TRL's DPO formulas and names, and residue-level ResiDPO); the log-probabilities
of sequences of one structure, and of preference pairs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpo_inv.data.batches import structure_inputs
from dpo_inv.models.mpnn import decoding_ranks, derive_seed

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "residpo", "sft")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
# rounding of a margin, relative to the summed log-probabilities it comes from: several of fp32's units in the
# last place (1.2e-7), as the same model scored in other batches or kernels differs by
ROUNDING = 1e-6


@dataclass
class SequenceLogps:
    """Summed log p of N sequences of each structure over the loss positions, averaged over decoding orders;
    `num_positions` per structure; the per-position terms of the sums (zero outside the loss positions)."""

    logps: torch.Tensor  # [B, N]
    num_positions: torch.Tensor  # [B]
    tokens: torch.Tensor | None = None  # [B, N, L]
    first_distributions: torch.Tensor | None = None  # [B, L, 21]: first sequence, first order, each letter


@dataclass
class PairLogps:
    """Summed log p over the loss positions, averaged over decoding orders; `num_positions` per pair;
    the per-position terms of the sums where they were kept (zero outside the loss positions)."""

    chosen: torch.Tensor  # [B]
    rejected: torch.Tensor  # [B]
    num_positions: torch.Tensor  # [B]
    chosen_tokens: torch.Tensor | None = None  # [B, L]
    rejected_tokens: torch.Tensor | None = None  # [B, L]
    chosen_distributions: torch.Tensor | None = None  # [B, L, 21]: log p of every amino acid, first order

    @classmethod
    def of(cls, scored: SequenceLogps) -> PairLogps:
        """The pairs of `scored`, the log p of their two sequences (`chosen`, `rejected`)."""
        tokens = scored.tokens
        return cls(
            chosen=scored.logps[:, 0],
            rejected=scored.logps[:, 1],
            num_positions=scored.num_positions,
            chosen_tokens=None if tokens is None else tokens[:, 0],
            rejected_tokens=None if tokens is None else tokens[:, 1],
            chosen_distributions=scored.first_distributions,
        )


def anchor_kl(policy: PairLogps, reference: PairLogps, positions: torch.Tensor) -> torch.Tensor:
    """Per pair, the mean over `positions [B, L]` of KL(reference || policy) between the per-residue
    distributions of the preferred sequence: how far the positions a pair does not score have moved."""
    ref = reference.chosen_distributions
    kl = (ref.exp() * (ref - policy.chosen_distributions)).sum(-1)  # [B, L]
    return (kl * positions).sum(-1) / positions.sum(-1).clamp(min=1)


@dataclass
class ResidueScores:
    """Per-position scores of the two sequences of each pair (higher is better), and ResiDPO's options."""

    chosen: torch.Tensor  # [B, L]
    rejected: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L]
    margin: float = 0.0
    constraint_threshold: float | None = None


@dataclass
class DPOOutput:
    """Per-pair loss (before example weights) and the implicit rewards beta * (log p - log p_ref)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def reward_accuracies(
    out: DPOOutput, policy: PairLogps, reference: PairLogps | None, beta: float
) -> torch.Tensor:
    """TRL's rewards/accuracies, but a pair counts as right only where its margin is above zero by more
    than rounding: ROUNDING times beta times the magnitudes of the summed log-probabilities it comes from.
    A policy that equals its reference, bit for bit or not, has accuracy 0."""
    scale = policy.chosen.abs() + policy.rejected.abs()
    if reference is not None:
        scale = scale + reference.chosen.abs() + reference.rejected.abs()
    margins = out.chosen_rewards - out.rejected_rewards
    return (margins > ROUNDING * beta * scale.detach()).float()


def example_seeds(seed: int, indices: torch.Tensor, epoch: int) -> list[int]:
    """A seed per example from (run seed, epoch, example index): orders do not depend on batching or rank."""
    return [derive_seed(seed, epoch, i) for i in indices.tolist()]


def batch_ranks(
    batch: dict[str, torch.Tensor], seed: int, num_orders: int, decoding_order: str, epoch: int = 0
) -> torch.Tensor:
    """Decoding ranks [B, K, L] of a batch: `random` (seeded per pair) or `left_to_right`."""
    seeds = None if decoding_order == "left_to_right" else example_seeds(seed, batch["index"], epoch)
    return decoding_ranks(batch["decode_mask"], batch["mask"], seeds, num_orders, batch["length"].tolist())


def sequence_logps(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    columns: Sequence[str] = ("sequence",),
) -> SequenceLogps:
    """Score N sequences of each example's structure, the `columns` named (one sequence, a variant and its
    wild type, the two of a pair), under each decoding order.

    `ranks` is [B, K, L] (K decoding orders); the structure is encoded once for all N x K sequences.
    """
    num_orders, count = ranks.shape[1], len(columns)
    sequences = torch.stack([batch[column] for column in columns], dim=1)  # [B, N, L]
    sequences = sequences.repeat_interleave(num_orders, dim=1)  # [B, NK, L]: each sequence K times
    log_probs = model(
        S=sequences, ranks=ranks.repeat(1, count, 1), **structure_inputs(batch)
    )  # [B, NK, L, 21]
    token = log_probs.float().gather(-1, sequences.unsqueeze(-1)).squeeze(-1)  # [B, NK, L]
    B, L = token.shape[0], token.shape[-1]
    per_position = (token * batch["loss_mask"].unsqueeze(1)).view(B, count, num_orders, L).mean(2)
    return SequenceLogps(
        logps=per_position.sum(-1),
        num_positions=batch["loss_mask"].sum(-1),
        tokens=per_position,
        first_distributions=log_probs[:, 0].float(),
    )


def pair_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], ranks: torch.Tensor) -> PairLogps:
    """Score the preferred and the dispreferred sequence of each pair under each decoding order (`ranks`
    [B, K, L]); the structure is encoded once for all 2K sequences."""
    return PairLogps.of(sequence_logps(model, batch, ranks, ("chosen", "rejected")))


def _log_ratios(policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log pi - log pi_ref of the chosen and the rejected sequence, [B, L] each."""
    if reference is None:
        return policy.chosen_tokens, policy.rejected_tokens
    return policy.chosen_tokens - reference.chosen_tokens, policy.rejected_tokens - reference.rejected_tokens


def residue_better(scores: ResidueScores) -> torch.Tensor:
    """[B, L] bool: loss positions where the chosen sequence's score beats the rejected one's by > margin."""
    return (scores.chosen - scores.rejected > scores.margin) & (scores.loss_mask > 0)


def residue_margins(policy: PairLogps, reference: PairLogps | None, scores: ResidueScores) -> torch.Tensor:
    """ResiDPO's margin of each pair: the mean, over the positions where the chosen sequence is better, of
    the chosen-minus-rejected log-ratio; the summed (sequence-level) margin where no position is."""
    chosen, rejected = _log_ratios(policy, reference)
    difference = chosen - rejected
    better = residue_better(scores)
    count = better.sum(-1)
    mean_better = (difference * better).sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, mean_better, difference.sum(-1))


def residue_constraint(policy: PairLogps, reference: PairLogps | None, scores: ResidueScores) -> torch.Tensor:
    """Mean squared log-ratio of the chosen sequence over the positions outside the better ones whose score
    is at least `constraint_threshold` (all of them when it is None): keeps good positions where they are."""
    chosen, _ = _log_ratios(policy, reference)
    keep = (scores.loss_mask > 0) & ~residue_better(scores)
    if scores.constraint_threshold is not None:
        keep &= scores.chosen >= scores.constraint_threshold
    return (chosen.square() * keep).sum(-1) / keep.sum(-1).clamp(min=1)


def dpo_loss(
    policy: PairLogps,
    reference: PairLogps | None,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    residue_scores: ResidueScores | None = None,
) -> DPOOutput:
    """One DPO loss per pair. `reference=None` is the reference-free variant (log p_ref = 0).

    `ipo` uses log-probabilities averaged over positions, as TRL does; `residpo` ResiDPO's margin over the
    positions where the chosen sequence scores better (needs `residue_scores`); `sft` the negative log p of
    the chosen sequence per position; the others use sums.
    """
    ref_chosen = reference.chosen if reference is not None else torch.zeros_like(policy.chosen)
    ref_rejected = reference.rejected if reference is not None else torch.zeros_like(policy.rejected)
    chosen_ratio = policy.chosen - ref_chosen
    rejected_ratio = policy.rejected - ref_rejected
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "robust":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            + F.logsigmoid(-beta * logits) * label_smoothing
        ) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits / policy.num_positions.clamp(min=1) - 1 / (2 * beta)) ** 2
    elif loss_type == "residpo":
        if residue_scores is None:
            raise ValueError("loss_type residpo needs per-residue scores of both sequences of every pair")
        losses = -F.logsigmoid(beta * residue_margins(policy, reference, residue_scores))
    elif loss_type == "sft":
        losses = -policy.chosen / policy.num_positions.clamp(min=1)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose from {', '.join(LOSS_TYPES)}")
    return DPOOutput(
        losses=losses,
        chosen_rewards=beta * chosen_ratio.detach(),
        rejected_rewards=beta * rejected_ratio.detach(),
    )


def preference_loss(
    policy: PairLogps,
    reference: PairLogps | None,
    weight: torch.Tensor,
    beta: float,
    loss_types: list[str],
    loss_weights: list[float],
    label_smoothing: float = 0.0,
    residue_scores: ResidueScores | None = None,
    residue_constraint_weight: float = 0.0,
) -> tuple[torch.Tensor, DPOOutput]:
    """Per-pair weighted sum of the chosen losses, plus `residue_constraint_weight` x ResiDPO's constraint;
    each pair's total is scaled by its example `weight`. Returns (per-pair loss, rewards)."""
    total = torch.zeros_like(policy.chosen)
    output = None
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        output = dpo_loss(policy, reference, beta, loss_type, label_smoothing, residue_scores)
        total = total + loss_weight * output.losses
    if residue_constraint_weight:
        total = total + residue_constraint_weight * residue_constraint(policy, reference, residue_scores)
    return total * weight, output
