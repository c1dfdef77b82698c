"""The DPO objective of one batch: policy and reference log-probabilities, loss, per-pair metrics."""

from __future__ import annotations

import torch

from dpo_inv.config import DPOConfig
from dpo_inv.loss import PairLogps, batch_ranks, pair_logps, preference_loss
from dpo_inv.model import ProteinMPNN


def reference_logps(
    config: DPOConfig, reference: ProteinMPNN | None, batch: dict[str, torch.Tensor], ranks: torch.Tensor
) -> PairLogps | None:
    if config.reference_free:
        return None
    if config.precompute_ref_log_probs:
        return PairLogps(batch["ref_chosen_logps"], batch["ref_rejected_logps"], batch["loss_mask"].sum(-1))
    with torch.no_grad():
        return pair_logps(reference, batch, ranks)


def step_metrics(
    config: DPOConfig,
    model: torch.nn.Module,
    reference: ProteinMPNN | None,
    batch: dict[str, torch.Tensor],
    epoch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss of a batch (what is back-propagated) and per-pair metrics [B, len(METRICS)]."""
    ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
    policy = pair_logps(model, batch, ranks)
    losses, out = preference_loss(
        policy,
        reference_logps(config, reference, batch, ranks),
        batch["weight"],
        beta=config.beta,
        loss_types=config.loss_type,
        loss_weights=config.loss_weights or [1.0] * len(config.loss_type),
        label_smoothing=config.label_smoothing,
        rpo_alpha=config.rpo_alpha,
    )
    per_pair = torch.stack(
        [
            losses.detach(),
            out.chosen_rewards,
            out.rejected_rewards,
            (out.chosen_rewards > out.rejected_rewards).float(),
            out.chosen_rewards - out.rejected_rewards,
            policy.chosen.detach(),
            policy.rejected.detach(),
        ],
        dim=-1,
    )
    return losses.mean(), per_pair
