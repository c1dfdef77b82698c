"""Autoregressive sampling of sequences for a batch of structures, decoding one position per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dpo_inv.data.batches import structure_inputs
from dpo_inv.models.layers import (
    causal_neighbor_mask,
    gather_nodes,
    gather_sample_nodes,
    scatter_sample_nodes,
)
from dpo_inv.models.mpnn import ProteinMPNN, decoding_ranks, sequence_log_probs
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS


@dataclass(frozen=True)
class Samples:
    """N sampled sequences per structure, ``[B, N, L]`` each.

    ``tokens`` are ALPHABET indices (the native residue wherever a position is not designed).
    ``log_probs`` is log p of each token under the model itself: untempered, without bias or omitted amino
    acids, given the tokens decoded before it in the sample's order (0 at missing and padding positions),
    so it equals what the teacher-forced model gives the final sequence. ``ranks`` are the decoding orders.
    """

    tokens: Tensor
    log_probs: Tensor
    ranks: Tensor


def allowed_tokens(omit_aas: str) -> Tensor:
    """Tokens that may be sampled: the 20 amino acids (never X) except the letters in ``omit_aas``."""
    unknown = sorted(set(omit_aas.upper()) - set(ALPHABET))
    if unknown:
        raise ValueError(f"omit_aas: unknown amino acid letters {''.join(unknown)!r} (use {AMINO_ACIDS})")
    allowed = torch.tensor([a in AMINO_ACIDS and a not in omit_aas.upper() for a in ALPHABET])
    if not allowed.any():
        raise ValueError("omit_aas: every amino acid is omitted")
    return allowed


def gumbel_noise(seeds: Sequence[int], lengths: Sequence[int], num_samples: int, L: int) -> Tensor:
    """Gumbel noise ``[B, L, N, V]``, drawn per structure on CPU from a generator seeded by its seed."""
    noise = torch.zeros(len(seeds), num_samples, L, len(ALPHABET))
    for b, (seed, n) in enumerate(zip(seeds, lengths, strict=True)):
        generator = torch.Generator().manual_seed(int(seed))
        uniform = torch.rand(num_samples, int(n), len(ALPHABET), generator=generator, dtype=torch.float64)
        noise[b, :, : int(n)] = -torch.log(-torch.log(uniform))
    return noise.transpose(1, 2).contiguous()


def choose_tokens(logits: Tensor, bias: Tensor, allowed: Tensor, noise: Tensor, temperature: float) -> Tensor:
    """Draws from ``softmax((logits + bias) / temperature)`` over allowed tokens (Gumbel-max); 0: argmax."""
    scores = (logits + bias).masked_fill(~allowed, float("-inf"))
    if temperature == 0:
        return scores.argmax(-1)
    return (scores / temperature + noise).argmax(-1)


@torch.no_grad()
def sample_sequences(
    model: ProteinMPNN,
    batch: dict[str, Tensor],
    num_samples: int,
    temperature: float,
    seeds: Sequence[int],
    omit_aas: str = "",
    bias: Tensor | None = None,
) -> Samples:
    """Sample ``num_samples`` sequences per structure of a ``collate`` batch, decoding incrementally.

    Positions in ``batch["decode_mask"]`` (and present) are designed, one per step in a random order per
    sample drawn from ``seeds`` (one per structure); every other position keeps its native residue and is
    decoded first, as context, in one teacher-forced pass. Each step then updates only the decoded position
    in every decoder layer, on one encoder pass per structure; ``model`` is used as given (``load_model``
    returns it in eval mode). Tokens are drawn from ``softmax((logits + bias) / temperature)`` with X and
    ``omit_aas`` excluded (``bias [21]`` is added to the logits); ``temperature == 0`` takes the argmax.
    Samples depend on the seed, not on the batch (for structures of at least ``k_neighbors`` residues;
    shorter ones also see padding as neighbours, as in the reference).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if len(seeds) != len(batch["mask"]):
        raise ValueError(f"need one seed per structure: {len(seeds)} seeds for {len(batch['mask'])}")
    device = model.device
    bias = torch.zeros(len(ALPHABET)) if bias is None else bias
    if bias.shape != (len(ALPHABET),):
        raise ValueError(f"bias must have shape ({len(ALPHABET)},), got {tuple(bias.shape)}")
    bias, allowed = bias.to(device), allowed_tokens(omit_aas).to(device)
    mask, native = batch["mask"].to(device), batch["native"].to(device)
    decoded = (batch["decode_mask"].to(device) * mask) > 0
    lengths = batch["length"].tolist()
    ranks = decoding_ranks(decoded.float(), mask, seeds, num_orders=num_samples, lengths=lengths)
    noise = gumbel_noise(seeds, lengths, num_samples, mask.shape[1]).to(device)
    enc = model.encode(**{name: value.to(device) for name, value in structure_inputs(batch).items()})
    mask_bw = mask[:, :, None, None] * causal_neighbor_mask(ranks, enc.E_idx)
    tokens = native.unsqueeze(-1).repeat(1, 1, num_samples)  # [B, L, N]
    h_S = model.W_s(tokens)
    context = bool((mask.bool() & ~decoded).any())
    states = [enc.h_V.unsqueeze(2).expand_as(h_S).contiguous()]
    for layer in model.decoder_layers:
        states.append(layer(states[-1], h_S, enc, mask_bw) if context else torch.zeros_like(states[0]))
    order = ranks.argsort(-1).transpose(1, 2)  # [B, step, N]
    L, num_steps = mask.shape[1], int(decoded.sum(-1).max())
    for step in range(L - num_steps, L):
        positions = order[:, step : step + 1]
        for layer, h_in, h_out in zip(model.decoder_layers, states[:-1], states[1:], strict=True):
            h = layer(h_in, h_S, enc, mask_bw, positions)
            scatter_sample_nodes(h_out, positions, h)
        choice = choose_tokens(
            model.W_out(h), bias, allowed, gather_sample_nodes(noise, positions), temperature
        )
        token = torch.where(gather_nodes(decoded, positions), choice, gather_nodes(native, positions))
        scatter_sample_nodes(tokens, positions, token)
        scatter_sample_nodes(h_S, positions, model.W_s(token))
    log_probs = sequence_log_probs(F.log_softmax(model.W_out(states[-1]), -1), tokens) * mask.unsqueeze(-1)
    return Samples(tokens=tokens.transpose(1, 2), log_probs=log_probs.transpose(1, 2), ranks=ranks)
