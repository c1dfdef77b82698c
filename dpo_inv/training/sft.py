"""Supervised fine-tuning on structure records: ProteinMPNN's training objective (`loss_smoothed` of its
official training code), each record's sequence decoded in a random order given its structure."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from dpo_inv.data.batches import structure_inputs

METRICS = ("loss", "perplexity", "mean_token_accuracy")  # TRL's SFT names, and the perplexity


def smoothed_nll(log_probs: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Per-position negative log-likelihood of `target` [..., L] under `log_probs` [..., L, V] against a
    label-smoothed one-hot (`smoothing` spread over the V letters, then normalised), as the official
    `loss_smoothed` computes it."""
    onehot = torch.nn.functional.one_hot(target, log_probs.shape[-1]).to(log_probs.dtype)
    onehot = onehot + smoothing / log_probs.shape[-1]
    onehot = onehot / onehot.sum(-1, keepdim=True)
    return -(onehot * log_probs).sum(-1)


def sft_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    ranks: torch.Tensor,
    smoothing: float,
    accelerator: Accelerator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a batch of structure records — the smoothed NLL over its loss positions (designed,
    observed, mutable) divided by their number, each record's term scaled by its weight — and per-record
    sums by name: `loss` (smoothed), `nll`, `correct` (the target is the most likely letter) and
    `num_tokens`. `ranks` is [B, K, L]: the NLL is averaged over the K decoding orders.

    With `accelerator` (a collective: every rank calls it once per batch), the number of positions is
    that of every rank's batch together, each rank's loss scaled so that the gradients DDP averages are
    those of the one batch they make up."""
    num_orders = ranks.shape[1]
    target = batch["sequence"].unsqueeze(1).expand(-1, num_orders, -1)  # [B, K, L]
    log_probs = model(S=target, ranks=ranks, **structure_inputs(batch)).float()  # [B, K, L, 21]
    mask = batch["loss_mask"]
    smoothed = (smoothed_nll(log_probs, target, smoothing).mean(1) * mask).sum(-1)  # [B]
    detached = log_probs.detach()
    nll = -detached.gather(-1, target.unsqueeze(-1)).squeeze(-1).mean(1)
    correct = (detached.argmax(-1) == target).float().mean(1)
    tokens = mask.sum(-1)
    total, ranks_count = tokens.sum(), 1
    if accelerator is not None and accelerator.num_processes > 1:
        total, ranks_count = accelerator.gather(total.reshape(1)).sum(), accelerator.num_processes
    loss = (smoothed * batch["weight"]).sum() * ranks_count / total.clamp(min=1)
    rows = {
        "loss": smoothed.detach(),
        "nll": (nll * mask).sum(-1),
        "correct": (correct * mask).sum(-1),
        "num_tokens": tokens,
    }
    return loss, rows


def summarize(totals: dict[str, float]) -> dict[str, float]:
    """The metrics of records whose rows sum to `totals`, per token: the smoothed loss, the perplexity
    (exp of the NLL) and the fraction of tokens whose most likely letter is the target."""
    tokens = max(totals["num_tokens"], 1.0)
    return {
        "loss": totals["loss"] / tokens,
        "perplexity": math.exp(totals["nll"] / tokens),
        "mean_token_accuracy": totals["correct"] / tokens,
    }
