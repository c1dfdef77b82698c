"""Autoregressive sampling of sequences for a batch of structures, decoding one position (or one group of
tied positions) per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dpo_inv.data.batches import structure_inputs
from dpo_inv.errors import OptionError
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
    so it equals what the teacher-forced model gives the final sequence. ``ranks`` are the decoding orders
    (tied positions share a rank).
    """

    tokens: Tensor
    log_probs: Tensor
    ranks: Tensor


def allowed_tokens(omit_aas: str) -> Tensor:
    """Tokens that may be sampled: the 20 amino acids (never X) except the letters in ``omit_aas``."""
    unknown = sorted(set(omit_aas.upper()) - set(ALPHABET))
    if unknown:
        raise OptionError(f"omit_aas: unknown amino acid letters {''.join(unknown)!r} (use {AMINO_ACIDS})")
    allowed = torch.tensor([a in AMINO_ACIDS and a not in omit_aas.upper() for a in ALPHABET])
    if not allowed.any():
        raise OptionError("omit_aas: every amino acid is omitted")
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


def tie_groups(tied: Tensor, decoded: Tensor) -> tuple[Tensor, Tensor]:
    """Checks ``tied [B, L]`` (each position's group head) and returns the members ``[B, L, Q]`` of the
    group of each head, padded by repeating the head, and the group sizes ``[B, L]`` (0 at non-heads)."""
    if tied.shape != decoded.shape:
        raise ValueError(f"tied must have shape {tuple(decoded.shape)}, got {tuple(tied.shape)}")
    B, L = tied.shape
    if not ((tied >= 0) & (tied < L)).all():
        raise ValueError(f"tied: group heads must be positions in [0, {L})")
    if not torch.equal(tied.gather(1, tied), tied):
        raise ValueError("tied: a group head must be its own head")
    size = torch.zeros_like(tied).scatter_add_(1, tied, torch.ones_like(tied))
    if not (decoded | (size.gather(1, tied) == 1)).all():
        raise ValueError("tied: tied positions must be designed (decode_mask) and present (mask)")
    by_group = tied.argsort(stable=True)
    heads = tied.gather(1, by_group)
    slot = torch.arange(L, device=tied.device) - (size.cumsum(-1) - size).gather(1, heads)
    members = torch.arange(L, device=tied.device).view(1, L, 1).repeat(B, 1, int(size.max()))
    members.view(B, -1).scatter_(1, heads * members.shape[-1] + slot, by_group)
    return members, size


def tied_ranks(ranks: Tensor, tied: Tensor) -> Tensor:
    """Ranks ``[B, N, L]`` of the groups of ``tied [B, L]`` in the order of their heads in ``ranks``, shared
    by all members and numbered so that the last group has rank ``L - 1`` (``ranks`` itself without ties)."""
    heads = tied.unsqueeze(1).expand_as(ranks)
    in_order = (heads == torch.arange(ranks.shape[-1], device=ranks.device)).gather(-1, ranks.argsort(-1))
    heads_from = in_order.flip(-1).cumsum(-1).flip(-1)  # number of heads at this step or after
    return ranks.shape[-1] - heads_from.gather(-1, ranks.gather(-1, heads))


@torch.no_grad()
def sample_sequences(
    model: ProteinMPNN,
    batch: dict[str, Tensor],
    num_samples: int,
    temperature: float,
    seeds: Sequence[int],
    omit_aas: str = "",
    bias: Tensor | None = None,
    tied: Tensor | None = None,
    decoding_order: str = "random",
    max_mutations: int | None = None,
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

    ``tied [B, L]`` ties designed positions, as ProteinMPNN's ``tied_sample`` (e.g. a homo-oligomer's chains):
    each position gives the first position (head) of its group, a lone position its own index. A group is
    decoded at one step, at its head's place in the random order (its members share one rank and do not see
    each other), and all members get one token drawn with the mean of their logits (``tied_beta`` = 1), the
    bias and the head's noise. Tied positions must be designed. With ``decoding_order="left_to_right"``
    every sample decodes its (groups of) positions in file order instead.

    With ``max_mutations`` a sample differs from ``batch["native"]`` (the parent) at most there: once a
    sample holds that many substitutions, each later step keeps the parent's residue (a tied group counts
    its members).
    """
    if temperature < 0:
        raise OptionError(f"temperature must be >= 0, got {temperature}")
    if num_samples < 1:
        raise OptionError(f"num_samples must be >= 1, got {num_samples}")
    if max_mutations is not None and max_mutations < 0:
        raise OptionError(f"max_mutations must be >= 0, got {max_mutations}")
    if len(seeds) != len(batch["mask"]):
        raise ValueError(f"need one seed per structure: {len(seeds)} seeds for {len(batch['mask'])}")
    device = model.device
    bias = torch.zeros(len(ALPHABET)) if bias is None else bias
    if bias.shape != (len(ALPHABET),):
        raise ValueError(f"bias must have shape ({len(ALPHABET)},), got {tuple(bias.shape)}")
    bias, allowed = bias.to(device), allowed_tokens(omit_aas).to(device)
    mask, native = batch["mask"].to(device), batch["native"].to(device)
    decoded = (batch["decode_mask"].to(device) * mask) > 0
    L = mask.shape[1]
    tied = torch.arange(L, device=device).expand_as(mask) if tied is None else tied.to(device, torch.long)
    members, size = tie_groups(tied, decoded)
    lengths = batch["length"].tolist()
    if decoding_order not in ("random", "left_to_right"):
        raise OptionError(f"decoding_order must be random or left_to_right, got {decoding_order!r}")
    order_seeds = seeds if decoding_order == "random" else None
    ranks = decoding_ranks(decoded.float(), mask, order_seeds, num_orders=num_samples, lengths=lengths)
    ranks = tied_ranks(ranks, tied)
    noise = gumbel_noise(seeds, lengths, num_samples, L).to(device)
    enc = model.encode(**{name: value.to(device) for name, value in structure_inputs(batch).items()})
    mask_bw = mask[:, :, None, None] * causal_neighbor_mask(ranks, enc.E_idx)
    tokens = native.unsqueeze(-1).repeat(1, 1, num_samples)  # [B, L, N]
    h_S = model.W_s(tokens)
    context = bool((mask.bool() & ~decoded).any())
    states = [enc.h_V.unsqueeze(2).expand_as(h_S).contiguous()]
    for layer in model.decoder_layers:
        states.append(layer(states[-1], h_S, enc, mask_bw) if context else torch.zeros_like(states[0]))
    # the head of the group of each rank [B, N, L]; steps before a structure's first group decode that group
    # (which sees no other position), as its own step does again
    head_at = torch.empty_like(ranks).scatter_(-1, ranks, tied.unsqueeze(1).expand_as(ranks))
    first_rank = L - (size > 0).sum(-1).view(-1, 1, 1)
    head_at = head_at.gather(-1, torch.arange(L, device=device).clamp(min=first_rank).expand_as(ranks))
    num_steps = int(((size > 0) & decoded).sum(-1).max())
    for step in range(L - num_steps, L):
        head = head_at[:, :, step]
        positions = gather_nodes(members, head).transpose(1, 2)  # [B, Q, N]
        for layer, h_in, h_out in zip(model.decoder_layers, states[:-1], states[1:], strict=True):
            h = layer(h_in, h_S, enc, mask_bw, positions)
            scatter_sample_nodes(h_out, positions, h)
        count = gather_nodes(size, head).unsqueeze(1)  # [B, 1, N]
        counted = torch.arange(positions.shape[1], device=device).view(1, -1, 1) < count
        logits = (model.W_out(h) * counted.unsqueeze(-1)).sum(1, keepdim=True) / count.unsqueeze(-1)
        choice = choose_tokens(
            logits, bias, allowed, gather_sample_nodes(noise, head.unsqueeze(1)), temperature
        )
        parent = gather_nodes(native, positions)
        if max_mutations is not None:  # room for the group beside the substitutions placed off it
            own = ((gather_sample_nodes(tokens, positions) != parent) & counted).sum(1, keepdim=True)
            placed = (tokens != native.unsqueeze(-1)).sum(1, keepdim=True) - own  # [B, 1, N]
            choice = torch.where(placed + count <= max_mutations, choice, parent)
        token = torch.where(gather_nodes(decoded, positions), choice, parent)
        scatter_sample_nodes(tokens, positions, token)
        scatter_sample_nodes(h_S, positions, model.W_s(token))
    log_probs = sequence_log_probs(F.log_softmax(model.W_out(states[-1]), -1), tokens) * mask.unsqueeze(-1)
    return Samples(tokens=tokens.transpose(1, 2), log_probs=log_probs.transpose(1, 2), ranks=ranks)
