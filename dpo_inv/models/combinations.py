"""Multi-mutants scored as combinations: the joint estimator.

A variant differs from its wild type at the positions M. Its mutated positions are decoded after every other
residue of the wild type, one after the other, each given those already placed:

    delta_logp = mean over orders π of M of  sum_t log p(v_{π_t} | wild type off M, v_{π_<t})
                                                  - log p(w_{π_t} | wild type off M, w_{π_<t})

The orders are the cyclic rotations of M's left-to-right order (at most `max_orders` of them, evenly
spread), so each position comes first and last equally often; the other residues are decoded in the base
order (left to right, or one random order per structure as the conditional estimator draws it). For a single
mutant this is the conditional estimator of `dpo_inv.models.variants`: one position decoded last.

It is computed without a decoder pass per variant. Residues off M are decoded before M, so their decoder
states do not depend on the variant: one decoder pass per (M, order) gives them, computed from one pass of
the wild type in the base order where M's move to the end changes them (`reordered_passes`). A mutated
position's states depend only on the mutations placed before it, so each distinct prefix is a *slot* — a
position decoded in a context — computed once, layer by layer, from its neighbours' states: a four-site
library of 160,000 variants needs about 8,400 slots per order, not 160,000 decoder passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dpo_inv.models.layers import Encoding, causal_neighbor_mask, gather_nodes
from dpo_inv.models.mpnn import ProteinMPNN

MAX_ORDERS = 4  # rotations of the mutated positions' order averaged by default
PATTERNS_PER_PASS = 8  # (positions, order) decoder passes batched together
SLOTS_PER_PASS = 2048  # slots whose neighbours' states are gathered at once


def base_order(length: int, seed: int | None) -> np.ndarray:
    """The order the residues off the mutated positions are decoded in: left to right (``seed=None``) or
    a permutation drawn from ``seed``."""
    return np.arange(length) if seed is None else np.random.default_rng(seed).permutation(length)


def rotations(m: int, max_orders: int) -> list[list[int]]:
    """Orders of ``m`` mutated positions (indices into their sorted list): cyclic rotations of left to
    right, at most ``max_orders``, evenly spread."""
    shifts = sorted({round(i * m / min(m, max_orders)) for i in range(min(m, max_orders))})
    return [[(s + t) % m for t in range(m)] for s in shifts]


@dataclass
class JointPlan:
    """The slots of one structure's variants and how each variant's `delta_logp` sums their log-probs.

    A pattern is a set of mutated positions in one order; a slot is the t-th position of a pattern given the
    tokens placed at its first t positions. ``changes`` maps slot log-probs ``[S * V]`` to the variants'
    `delta_logp` ``[R]`` (+w at the variant's token, -w at the wild type's, w = 1 / orders of its set).
    """

    base_order: np.ndarray  # [L] positions in the order the residues off a pattern are decoded
    patterns: list[np.ndarray]  # per pattern, its positions in decoding order
    slot_pattern: np.ndarray  # [S]
    slot_step: np.ndarray  # [S] t: how many of the pattern's positions are placed before the slot
    slot_prefix: np.ndarray  # [S, T] tokens placed at the pattern's first t positions (-1 beyond t)
    slot_parents: np.ndarray  # [S, T] the slot of each placed position (-1 beyond t)
    changes: Tensor  # sparse [R, S * V]


def joint_plan(
    wildtype: np.ndarray,
    variants: np.ndarray,
    base_order: np.ndarray,
    vocab: int,
    max_orders: int = MAX_ORDERS,
) -> JointPlan:
    """The slots that score ``variants [R, L]`` (tokens) against ``wildtype [L]``, the residues off each
    variant's mutated positions decoded in ``base_order``."""
    changed = variants != wildtype[None, :]
    sets: dict[bytes, list[int]] = {}
    for r, row in enumerate(changed):
        sets.setdefault(np.packbits(row).tobytes(), []).append(r)
    T = max(1, int(changed.sum(1).max(initial=0)))
    patterns: list[np.ndarray] = []
    slot_pattern, slot_step, slot_prefix, slot_parents = [], [], [], []
    rows, cols, values = [], [], []
    count = 0
    for members in sets.values():
        positions = np.flatnonzero(changed[members[0]])
        if len(positions) == 0:
            continue
        members = np.array(members)
        orders = rotations(len(positions), max_orders)
        weight = 1.0 / len(orders)
        for order in orders:
            p = len(patterns)
            ordered = positions[order]
            patterns.append(ordered)
            # the variants' tokens at the ordered positions, the wild type's as one more row
            tokens = np.vstack([variants[members][:, ordered], wildtype[ordered][None, :]]).astype(np.int64)
            parents = np.full((len(tokens), len(ordered)), -1)
            for t in range(len(ordered)):
                prefixes, first, inverse = np.unique(
                    tokens[:, :t], axis=0, return_index=True, return_inverse=True
                )
                inverse = inverse.reshape(-1)
                ids = count + np.arange(len(prefixes))
                prefix = np.full((len(prefixes), T), -1)
                prefix[:, :t] = prefixes
                parent = np.full((len(prefixes), T), -1)
                parent[:, :t] = parents[first, :t]
                slot_pattern.append(np.full(len(prefixes), p))
                slot_step.append(np.full(len(prefixes), t))
                slot_prefix.append(prefix)
                slot_parents.append(parent)
                parents[:, t] = ids[inverse]
                count += len(prefixes)
                slots = ids[inverse]
                rows += [members, members]
                cols += [slots[:-1] * vocab + tokens[:-1, t], np.full(len(members), slots[-1]) * vocab
                         + tokens[-1, t]]  # fmt: skip
                values += [np.full(len(members), weight), np.full(len(members), -weight)]
    index = torch.from_numpy(np.stack([np.concatenate(rows or [np.zeros(0, int)]),
                                       np.concatenate(cols or [np.zeros(0, int)])]))  # fmt: skip
    changes = torch.sparse_coo_tensor(
        index,
        torch.from_numpy(np.concatenate(values or [np.zeros(0)])).float(),
        (len(variants), count * vocab),
        check_invariants=False,
    ).coalesce()
    empty = np.zeros((0, T), dtype=np.int64)
    return JointPlan(
        base_order,
        patterns,
        np.concatenate(slot_pattern or [np.zeros(0, int)]),
        np.concatenate(slot_step or [np.zeros(0, int)]),
        np.concatenate(slot_prefix or [empty]),
        np.concatenate(slot_parents or [empty]),
        changes,
    )


@dataclass
class Slots:
    """The last decoder layer's inputs at slots: each slot's state below it, its neighbours' states (the
    encoder's where not yet decoded) and token embeddings (zero where not yet decoded), its edges."""

    h_V: Tensor  # [S, H]
    h_E: Tensor  # [S, K, H]
    h_V_j: Tensor  # [S, K, H]
    h_S_j: Tensor  # [S, K, H]
    mask: Tensor  # [S]


def slot_head(model: ProteinMPNN, slots: Slots) -> Tensor:
    """Log-probabilities ``[S, V]`` at the slots from the last decoder layer and the output head."""
    h_V = model.decoder_layers[-1].update_gathered(slots.h_V, slots.h_E, slots.h_S_j, slots.h_V_j, slots.mask)
    return torch.log_softmax(model.W_out(h_V), dim=-1).float()


@dataclass
class WildtypePass:
    """The wild type decoded in O orders: each decoder layer's output below the last ``[1, L, O, H]``, its
    token embeddings ``[1, L, 1, H]`` and what each residue sees ``[1, L, K, O]``."""

    states: list[Tensor]
    h_S: Tensor
    mask_bw: Tensor


def wildtype_pass(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, ranks: Tensor) -> WildtypePass:
    """One decoder pass of ``wildtype [L]`` in each of the orders ``ranks [O, L]``."""
    h_S = model.W_s(wildtype).view(1, -1, 1, model.W_s.embedding_dim)
    mask_bw = enc.mask[:, :, None, None] * causal_neighbor_mask(ranks.unsqueeze(0), enc.E_idx)
    h_V = enc.h_V.unsqueeze(2).expand(-1, -1, ranks.shape[0], -1)
    states = []
    for layer in model.decoder_layers[:-1]:
        h_V = layer(h_V, h_S.expand_as(h_V), enc, mask_bw)
        states.append(h_V)
    return WildtypePass(states, h_S, mask_bw)


def reordered_passes(model: ProteinMPNN, enc: Encoding, base: WildtypePass, ranks: Tensor,
                     order: Tensor) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """N decoder passes of the wild type in ``ranks [N, L]``, pass n a reordering of the base pass's order
    ``order[n]``: each decoder layer's input ``[1, L, N, H]``, the encoder's states first, and what each
    residue sees ``[1, L, K, N]``.

    A pass differs from the base pass only where a residue's view changed (a residue moved later sees the
    neighbours it did not, those decoded after it in the base order no longer see it) and, a layer further
    each time, where a residue's own state or one it sees changed. Layer by layer only those (residue, pass)
    pairs are computed (:meth:`DecLayer.update_residues`: on 1BD2, 22 and 57 of its 815 residues in the first
    two layers, a position moved last, on average over positions); the others keep the base pass's states.
    The layers' work per pass is about the same in any structure; its masks and the copies of the base
    pass's states grow with the length.
    """
    mask_bw = enc.mask[:, :, None, None] * causal_neighbor_mask(ranks.unsqueeze(0), enc.E_idx)
    changed = (mask_bw != base.mask_bw[..., order]).any(2)  # [1, L, N]
    h_V = enc.h_V.unsqueeze(2).expand(-1, -1, len(order), -1)  # the encoder's: the same in every order
    h_S = base.h_S.expand_as(h_V)
    states = [h_V]
    for layer, below in zip(model.decoder_layers[:-1], base.states, strict=True):
        residues, sequences = changed[0].nonzero(as_tuple=True)
        out = below[:, :, order].contiguous()
        out[0, residues, sequences] = layer.update_residues(h_V, h_S, enc, mask_bw, residues, sequences)
        h_V = out
        states.append(h_V)
        changed = changed | ((mask_bw > 0) & gather_nodes(changed, enc.E_idx)).any(2)
    return states, mask_bw


def pattern_ranks(plan: JointPlan, patterns: np.ndarray, L: int) -> Tensor:
    """Decoding ranks ``[P, L]``: the residues off each pattern in the base order, then the pattern's."""
    ranks = np.empty((len(patterns), L), dtype=np.int64)
    for row, p in enumerate(patterns):
        order = plan.patterns[p]
        rest = plan.base_order[~np.isin(plan.base_order, order)]
        ranks[row, np.concatenate([rest, order])] = np.arange(L)
    return torch.from_numpy(ranks)


def _pass(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, base: WildtypePass, plan: JointPlan,
          patterns: np.ndarray, keep_inputs: bool) -> Slots | Tensor:  # fmt: skip
    """The slots of ``patterns`` (in slot order): their last-layer inputs (``keep_inputs``) or log-probs;
    ``base``: the wild type decoded in the plan's base order."""
    device, L = enc.h_V.device, enc.h_V.shape[1]
    order = torch.zeros(len(patterns), dtype=torch.long, device=device)
    passes, _ = reordered_passes(model, enc, base, pattern_ranks(plan, patterns, L).to(device), order)
    states = [h_V[0].flatten(0, 1) for h_V in passes]  # row j * P + p
    slots = np.flatnonzero(np.isin(plan.slot_pattern, patterns))
    local = np.searchsorted(patterns, plan.slot_pattern[slots])
    step = plan.slot_step[slots]
    node = np.array([plan.patterns[p][t] for p, t in zip(plan.slot_pattern[slots], step, strict=True)])
    E_idx = enc.E_idx[0].cpu().numpy()
    neighbours = E_idx[node]  # [S, K]
    where = np.full((len(patterns), L), -1)
    for row, p in enumerate(patterns):
        where[row, plan.patterns[p]] = np.arange(len(plan.patterns[p]))
    u = where[local[:, None], neighbours]  # each neighbour's place in its slot's pattern order (-1: off it)
    placed = (u >= 0) & (u < step[:, None])
    pending = (u >= 0) & ~placed
    rows = np.arange(len(slots))[:, None]
    u = np.clip(u, 0, None)
    parent = np.searchsorted(slots, np.where(placed, plan.slot_parents[slots][rows, u], slots[0]))
    vocab = model.config.vocab_size
    token = np.where(placed, plan.slot_prefix[slots][rows, u], wildtype.cpu().numpy()[neighbours])
    token = np.where(pending, vocab, token)  # an embedding of zeros: not yet decoded
    t = {name: torch.from_numpy(value).to(device) for name, value in (
        ("node", node), ("base", neighbours * len(patterns) + local[:, None]), ("neighbours", neighbours),
        ("placed", placed), ("pending", pending), ("parent", parent), ("token", token))}  # fmt: skip
    embeddings = torch.cat([model.W_s.weight, model.W_s.weight.new_zeros(1, model.W_s.weight.shape[1])])
    h_E = enc.h_E[0][t["node"]]
    mask = enc.mask[0][t["node"]]
    h_S_j = embeddings[t["token"]]
    encoder = enc.h_V[0]
    h_V = encoder[t["node"]]

    def neighbour_states(layer: int, h_V: Tensor, rows: slice) -> Tensor:
        out = states[layer][t["base"][rows]]
        out = torch.where(t["pending"][rows].unsqueeze(-1), encoder[t["neighbours"][rows]], out)
        return torch.where(t["placed"][rows].unsqueeze(-1), h_V[t["parent"][rows]], out)

    chunks = [slice(i, i + SLOTS_PER_PASS) for i in range(0, len(slots), SLOTS_PER_PASS)]
    for layer, module in enumerate(model.decoder_layers[:-1]):
        h_V = torch.cat([module.update_gathered(h_V[rows], h_E[rows], h_S_j[rows],
                                                neighbour_states(layer, h_V, rows), mask[rows])
                         for rows in chunks])  # fmt: skip
    last = len(model.decoder_layers) - 1
    if keep_inputs:
        return Slots(h_V, h_E, neighbour_states(last, h_V, slice(None)), h_S_j, mask)
    return torch.cat(
        [
            slot_head(model, Slots(h_V[r], h_E[r], neighbour_states(last, h_V, r), h_S_j[r], mask[r]))
            for r in chunks
        ]
    )


def _passes(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, plan: JointPlan,
            keep_inputs: bool) -> list[Slots | Tensor]:  # fmt: skip
    """`_pass` over the plan's patterns, `PATTERNS_PER_PASS` at a time."""
    if not plan.patterns:
        return []
    ranks = np.empty((1, len(plan.base_order)), dtype=np.int64)
    ranks[0, plan.base_order] = np.arange(len(plan.base_order))
    starts = range(0, len(plan.patterns), PATTERNS_PER_PASS)
    with torch.no_grad():
        base = wildtype_pass(model, enc, wildtype, torch.from_numpy(ranks).to(wildtype.device))
        return [_pass(model, enc, wildtype, base, plan, np.arange(start, min(start + PATTERNS_PER_PASS,
                      len(plan.patterns))), keep_inputs) for start in starts]  # fmt: skip


def joint_slots(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, plan: JointPlan) -> Slots:
    """The last decoder layer's inputs at every slot of ``plan``, in slot order: `slot_head` on them is
    differentiable in that layer and the output head (what `dpo-inv adapt` trains)."""
    parts = _passes(model, enc, wildtype, plan, keep_inputs=True)
    names = ("h_V", "h_E", "h_V_j", "h_S_j", "mask")
    if not parts:
        edges = enc.h_E.new_zeros(0, *enc.h_E.shape[2:])
        return Slots(enc.h_V.new_zeros(0, enc.h_V.shape[-1]), edges, edges, edges, enc.mask.new_zeros(0))
    return Slots(*(torch.cat([getattr(p, n) for p in parts]) for n in names))


def joint_log_probs(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, plan: JointPlan) -> Tensor:
    """Log-probabilities ``[S, V]`` at every slot of ``plan``, in slot order (no gradient)."""
    parts = _passes(model, enc, wildtype, plan, keep_inputs=False)
    vocab = model.config.vocab_size
    return torch.cat(parts) if parts else enc.h_V.new_zeros(0, vocab)


def joint_deltas(model: ProteinMPNN, enc: Encoding, wildtype: Tensor, plan: JointPlan) -> Tensor:
    """`delta_logp` ``[R]`` of the plan's variants."""
    table = joint_log_probs(model, enc, wildtype, plan).reshape(-1, 1).cpu()
    return torch.sparse.mm(plan.changes, table).squeeze(1)
