"""ProteinMPNN as a Hugging Face ``PreTrainedModel`` that loads and writes the official checkpoints.

The encoder and the teacher-forced decoder are exposed separately so that a single encoder pass can score
several sequences and decoding orders. Numerics follow the reference ``protein_mpnn_utils.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

from dpo_inv.models.features import (
    CAProteinFeatures,
    GraphFeatures,
    LigandFeatures,
    MembraneFeatures,
    ProteinFeatures,
)
from dpo_inv.models.layers import (
    ContextLayer,
    DecLayer,
    DecoderStates,
    EncLayer,
    Encoding,
    causal_neighbor_mask,
    dropout,
    gather_neighbors,
    linear,
    run_layer,
)

OFFICIAL_CHECKPOINT_NAME = "proteinmpnn.pt"
# one small file per model: no "Loading weights" or "Writing model shards" bars
transformers_logging.disable_progress_bar()


class ProteinMPNNConfig(PretrainedConfig):
    """Hyper-parameters of ProteinMPNN and its LigandMPNN-family variants.

    ``augment_eps`` is the std (Å) of Gaussian backbone noise added in training mode; ``noise_level`` records
    the noise the official checkpoint was trained with and is informational only. ``atom_context_num`` > 0
    makes LigandMPNN (that many ligand context atoms per residue); ``membrane`` the membrane-label model.
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
    atom_context_num: int = 0
    membrane: bool = False

    @property
    def ligand_mpnn_family(self) -> bool:
        """Whether the model reads structures as LigandMPNN does (ligand and membrane models)."""
        return self.atom_context_num > 0 or self.membrane


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


class ProteinMPNN(PreTrainedModel):
    """ProteinMPNN with parameter names identical to the official checkpoints.

    Inputs: ``X`` backbone coordinates ``[B, L, 4, 3]`` (N, CA, C, O; CA-only models also take ``[B, L, 3]``),
    ``mask [B, L]`` (1 = residue present), ``residue_idx [B, L]`` and ``chain_encoding [B, L]`` as produced by
    the reference ``tied_featurize``, ``S [B, L]`` token indices into :data:`ALPHABET`, and ``ranks [B, L]``,
    the decoding step of each position. LigandMPNN also takes the structure's context atoms: ``context_xyz
    [B, A, 3]``, ``context_element [B, A]`` (atomic numbers) and ``context_mask [B, A]`` (none: empty
    context); the membrane model ``membrane_labels [B, L]`` (none: all 0).
    """

    config_class = ProteinMPNNConfig
    base_model_prefix = "proteinmpnn"

    def __init__(self, config: ProteinMPNNConfig) -> None:
        super().__init__(config)
        H = config.hidden_dim
        if config.ca_only:
            self.features: nn.Module = CAProteinFeatures(H, H, top_k=config.k_neighbors)
            self.W_v = nn.Linear(H, H, bias=True)  # present in the checkpoints, unused
        elif config.atom_context_num:
            self.features = LigandFeatures(H, H, config.k_neighbors, config.atom_context_num)
            self.W_v = nn.Linear(H, H, bias=True)
            self.W_c = nn.Linear(H, H, bias=True)
            self.W_nodes_y = nn.Linear(H, H, bias=True)
            self.W_edges_y = nn.Linear(H, H, bias=True)
            self.V_C = nn.Linear(H, H, bias=False)
            self.V_C_norm = nn.LayerNorm(H)
            self.context_encoder_layers = nn.ModuleList(
                [ContextLayer(H, 2 * H, config.dropout) for _ in range(2)]
            )
            self.y_context_encoder_layers = nn.ModuleList(
                [ContextLayer(H, H, config.dropout) for _ in range(2)]
            )
        elif config.membrane:
            self.features = MembraneFeatures(H, H, top_k=config.k_neighbors)
            self.W_v = nn.Linear(H, H, bias=True)
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
        if isinstance(module, GraphFeatures):  # its constant buffers, which loading leaves unset
            module.init_buffers()

    def encode(
        self,
        X: Tensor,
        mask: Tensor,
        residue_idx: Tensor,
        chain_encoding: Tensor,
        context_xyz: Tensor | None = None,
        context_element: Tensor | None = None,
        context_mask: Tensor | None = None,
        membrane_labels: Tensor | None = None,
    ) -> Encoding:
        """Run the structure encoder; noise (``augment_eps``) is added to the backbone and the context atoms
        only in training mode."""
        if self.config.ca_only:
            if X.dim() == 4:
                X = X[:, :, 1]
        elif X.dim() != 4:
            raise ValueError(f"full-backbone ProteinMPNN expects X as [B, L, 4, 3], got {tuple(X.shape)}")
        noisy = self.training and self.config.augment_eps > 0
        if noisy:
            X = X + self.config.augment_eps * torch.randn_like(X)
        E, E_idx = self.features(X, mask, residue_idx, chain_encoding)
        h_E = self.W_e(E)
        if self.config.membrane:
            labels = (
                mask.new_zeros(mask.shape, dtype=torch.long) if membrane_labels is None else membrane_labels
            )
            h_V = self.W_v(self.features.nodes(labels))
        else:
            # requiring a gradient as the edges do, the zeros enter the first layer as every later layer's
            # nodes do: torch.compile builds one graph for all the layers, not a second for the first
            h_V = E.new_zeros(E.shape[0], E.shape[1], E.shape[-1]).requires_grad_(h_E.requires_grad)
        mask_attend = mask.unsqueeze(-1) * gather_neighbors(mask, E_idx)
        for layer in self.encoder_layers:
            h_V, h_E = run_layer(layer, h_V, h_E, E_idx, mask, mask_attend)
        if self.config.atom_context_num:
            if context_xyz is None or context_element is None or context_mask is None:
                context_xyz, context_element, context_mask = (
                    X.new_zeros(len(X), 1, 3),
                    mask[:, :1] * 0,
                    mask[:, :1] * 0,
                )
            elif noisy:
                context_xyz = context_xyz + self.config.augment_eps * torch.randn_like(context_xyz)
            h_V = h_V + self._ligand_context(h_V, X, mask, context_xyz, context_element, context_mask)
        return Encoding(h_V=h_V, h_E=h_E, E_idx=E_idx, mask=mask)

    def _ligand_context(
        self, h_V: Tensor, X: Tensor, mask: Tensor, xyz: Tensor, element: Tensor, atom_mask: Tensor
    ) -> Tensor:
        """LigandMPNN's update of the encoded residues from their nearest context atoms."""
        Y, Y_t, Y_m = self.features.nearest_atoms(X, mask, xyz, element, atom_mask)
        V, Y_nodes, Y_edges = self.features.context(X, Y, Y_t)
        h_E_context = self.W_v(V)
        h_V_C = self.W_c(h_V)
        Y_m_edges = Y_m[:, :, :, None] * Y_m[:, :, None, :]
        Y_nodes = self.W_nodes_y(Y_nodes)
        for atom_layer, residue_layer in zip(
            self.y_context_encoder_layers, self.context_encoder_layers, strict=True
        ):
            Y_nodes, Y_edges = run_layer(
                atom_layer, Y_nodes, Y_edges, Y_m, Y_m_edges, edge_projection=self.W_edges_y
            )
            h_V_C, _ = run_layer(residue_layer, h_V_C, torch.cat((h_E_context, Y_nodes), -1), mask, Y_m)
        h_V_C = dropout(self.V_C(h_V_C), self.config.dropout, self.training)
        return self.V_C_norm(h_V_C)

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
        return self.decode_last(enc, self.decode_below_last(enc, S, ranks), positions)

    def decode_below_last(self, enc: Encoding, S: Tensor, ranks: Tensor) -> DecoderStates:
        """The decoder up to its last layer, for ``S`` and ``ranks`` ``[B, N, L]`` (see :meth:`decode`)."""
        mask_bw = enc.mask[:, :, None, None] * causal_neighbor_mask(ranks, enc.E_idx)
        h_S = self.W_s(S.transpose(1, 2))
        # a copy, not an expanded view: matrix products of views can round differently with and without
        # gradients, and a policy must score as its frozen reference does
        h_V = enc.h_V.unsqueeze(2).expand_as(h_S).contiguous()
        for layer in self.decoder_layers[:-1]:
            h_V = run_layer(layer, h_V, h_S, enc, mask_bw)
        return DecoderStates(h_V=h_V, h_S=h_S, mask_bw=mask_bw)

    def decode_last(self, enc: Encoding, states: DecoderStates, positions: Tensor | None = None) -> Tensor:
        """The last decoder layer and the output head on ``states`` (see :meth:`decode`)."""
        h_V = run_layer(self.decoder_layers[-1], states.h_V, states.h_S, enc, states.mask_bw, positions)
        h_V = h_V if positions is not None else h_V.transpose(1, 2)
        return F.log_softmax(linear(self.W_out, h_V).float(), dim=-1)  # log-probabilities in fp32

    def forward(
        self,
        X: Tensor,
        S: Tensor,
        mask: Tensor,
        residue_idx: Tensor,
        chain_encoding: Tensor,
        ranks: Tensor,
        **structure: Tensor,
    ) -> Tensor:
        """Log-probabilities of sequences ``S`` decoded in the order given by ``ranks``.

        ``S`` and ``ranks`` are ``[B, L]``, or ``[B, N, L]`` for N sequences/orders per structure, which share
        one encoder pass; the result is ``[B, L, V]`` or ``[B, N, L, V]``. ``structure`` holds the optional
        inputs of :meth:`encode` (ligand context atoms, membrane labels).
        """
        return self.decode(self.encode(X, mask, residue_idx, chain_encoding, **structure), S, ranks)

    def official_checkpoint(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Any]:
        """The weights in the official format read by ``protein_mpnn_run.py --path_to_model_weights``."""
        state_dict = self.state_dict() if state_dict is None else state_dict
        return {
            "model_state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
            "num_edges": int(self.config.k_neighbors),
            "noise_level": float(self.config.noise_level or 0.0),
            **({"atom_context_num": self.config.atom_context_num} if self.config.atom_context_num else {}),
        }

    def save_pretrained(
        self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """Write ``config.json`` + ``model.safetensors`` and the official-format ``proteinmpnn.pt``."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            checkpoint = self.official_checkpoint(kwargs.get("state_dict"))
            torch.save(checkpoint, Path(save_directory) / OFFICIAL_CHECKPOINT_NAME)
