"""The message-passing layers of ProteinMPNN and the graph helpers they share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dpo_inv.models import fused

CHUNK_ENTRIES = 1 << 16  # context entries whose message activations a chunked pass writes at a time


@dataclass
class Encoding:
    """Encoder output: node and edge embeddings on the k-nearest-neighbour graph."""

    h_V: Tensor  # [B, L, H]
    h_E: Tensor  # [B, L, K, H]
    E_idx: Tensor  # [B, L, K]
    mask: Tensor  # [B, L]


@dataclass
class DecoderStates:
    """Decoder states below the last layer, for N sequences per structure."""

    h_V: Tensor  # [B, L, N, H]
    h_S: Tensor  # [B, L, N, H] token embeddings
    mask_bw: Tensor  # [B, L, K, N]: 1 where position i sees the token of neighbour j


def linear(W: nn.Module, x: Tensor) -> Tensor:
    """``W(x)``; with LoRA adapters on ``W`` and no dropout on their inputs, as one map of the merged weight,
    which keeps no activation of its own for the backward pass (peft's two-branch map keeps copies)."""
    if hasattr(W, "lora_A") and applies_merged(W):
        return F.linear(x, weight(W), W.bias)
    return W(x)


def applies_merged(W: nn.Module) -> bool:
    """Whether ``W`` is one map of :func:`weight`: no LoRA adapters, or adapters without dropout."""
    return not hasattr(W, "lora_A") or all(isinstance(d, nn.Identity) for d in W.lora_dropout.values())


def use_fused_kernels(model: nn.Module, on: bool) -> None:
    """Let the modules of ``model`` that have fused kernels (a class attribute ``fused``: the message-passing
    layers' message MLPs, the edges' distance features) run them where the device allows
    (:mod:`dpo_inv.models.fused`), or keep them on the plain path."""
    for module in model.modules():
        if hasattr(type(module), "fused"):
            module.fused = on


def use_activation_checkpointing(model: nn.Module, every_n_layers: int | None) -> None:
    """Recompute every ``every_n_layers``-th message-passing layer of ``model`` (in module order, the first
    included) in the backward pass instead of keeping its activations (activation checkpointing, as
    Transformers' ``activation_checkpointing_enable``); None: none."""
    layers = [module for module in model.modules() if isinstance(module, MessageLayer)]
    for i, layer in enumerate(layers):
        layer.checkpointed = every_n_layers is not None and i % every_n_layers == 0


def runs_fused(layer: nn.Module, x: Tensor) -> bool:
    """Whether ``layer``'s message MLP (its ``W2``) on ``x`` runs as a fused kernel: turned on
    (:func:`use_fused_kernels`), a device and dtype the kernels take, no LoRA dropout on ``W2``."""
    return layer.fused and fused.available(x) and applies_merged(layer.W2)


def weight(linear: nn.Module) -> Tensor:
    """The matrix a linear map applies, for the layers that use it in blocks instead of calling the map:
    its weight, plus the deltas of the active LoRA adapters (peft) where it carries them."""
    if not hasattr(linear, "lora_A"):
        return linear.weight
    matrix = linear.base_layer.weight
    if linear.disable_adapters or linear.merged:
        return matrix
    for name in linear.active_adapters:
        if name in linear.lora_A:
            matrix = matrix + linear.get_delta_weight(name).to(matrix.dtype)
    return matrix


def gather_nodes(nodes: Tensor, index: Tensor) -> Tensor:
    """Node features ``[B, L, *C]`` at positions ``[B, *I]`` (e.g. neighbours ``[B, L, K]``): ``[B, *I, *C]``.

    ``out[b, ...] = nodes[b, index[b, ...]]``: whole rows selected, which is several times faster than an
    element-wise gather, forward (a copy of rows) and backward (``index_add_``).
    """
    B, L = nodes.shape[:2]
    offset = torch.arange(0, B * L, L, device=index.device).view(B, *[1] * (index.dim() - 1))
    rows = nodes.reshape(B * L, -1).index_select(0, (index + offset).flatten())
    return rows.view(*index.shape, *nodes.shape[2:])


def flat_neighbors(E_idx: Tensor) -> Tensor:
    """Neighbour indices ``[B, L, K]`` as rows of the flattened nodes ``[B * L, K]``."""
    B, L, K = E_idx.shape
    offset = torch.arange(0, B * L, L, device=E_idx.device).view(B, 1, 1)
    return (E_idx + offset).view(B * L, K)


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


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout whose mask is drawn as 31-bit integers (the drop probability exact to 5e-10) from torch's
    generator: on a CPU about twice as fast as ``F.dropout``'s ``bernoulli_``, and as repeatable."""
    if not training or p == 0.0:
        return x
    keep = torch.empty(x.shape, dtype=torch.int32, device=x.device).random_() >= round(p * 2**31)
    return x * keep * (1.0 / (1.0 - p)) if p < 1.0 else x * 0.0


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the mask of :func:`dropout`."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout(input, self.p, self.training)


class AutocastLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` for the per-edge (and per-context-atom) states: under autocast it runs in the
    autocast dtype (bf16) and writes the edges in it. CUDA's autocast would run it in fp32 and write fp32
    edges, each of which every next linear map reads and rounds again; a CPU's autocast already keeps bf16
    inputs in bf16. The statistics are accumulated in fp32 either way; node states keep ``nn.LayerNorm``."""

    def forward(self, input: Tensor) -> Tensor:
        device = input.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(input)
        weight, bias = self.applied(input)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(input.to(dtype), self.normalized_shape, weight, bias, self.eps)

    def applied(self, input: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The weight and bias as :meth:`forward` applies them to ``input``: under autocast, rounded to its
        dtype where the device's layer norm takes them only in its input's dtype (as autocast rounds a linear
        map's)."""
        device = input.device.type
        if torch.is_autocast_enabled(device) and weights_in_input_dtype(device):
            dtype = torch.get_autocast_dtype(device)
            return tuple(None if x is None else x.to(dtype) for x in (self.weight, self.bias))
        return self.weight, self.bias


def weights_in_input_dtype(device: str) -> bool:
    """Whether ``device``'s layer norm takes its weights only in its input's dtype: a CPU's also takes fp32
    weights with bf16 input; CUDA's does not."""
    return device != "cpu"


@contextmanager
def cuda_layer_norm_policy() -> Iterator[None]:
    """Within: ``aten::layer_norm`` under a CPU's autocast runs in fp32 and writes fp32, as under CUDA's
    autocast; what the layers write on a GPU, checked and counted on a CPU (``tests/test_speed.py``,
    ``scripts/bytes_table.py``)."""
    library = torch.library.Library("aten", "IMPL")
    autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):  # noqa: ANN001, ANN202
        with torch._C._ExcludeDispatchKeyGuard(autocast):
            weight, bias = (None if x is None else x.float() for x in (weight, bias))
            return torch.ops.aten.layer_norm(input.float(), normalized_shape, weight, bias, eps, cudnn_enable)

    library.impl("layer_norm", layer_norm, "AutocastCPU")
    try:
        yield
    finally:
        library._destroy()


class PositionWiseFeedForward(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, num_hidden: int, num_ff: int) -> None:
        super().__init__()
        self.W_in = nn.Linear(num_hidden, num_ff, bias=True)
        self.W_out = nn.Linear(num_ff, num_hidden, bias=True)
        self.act = nn.GELU()

    def forward(self, h: Tensor) -> Tensor:
        return linear(self.W_out, self.act(linear(self.W_in, h)))


class MessageLayer(nn.Module):
    """A message-passing layer: the unit that activation checkpointing recomputes (:func:`run_layer`)."""

    checkpointed = False  # set by use_activation_checkpointing
    recomputed_whole = True  # whether run_layer recomputes the whole layer, or the layer the part it chooses

    def recomputed(self) -> bool:
        """Whether this call runs checkpointed: activations recomputed in the backward pass."""
        return self.checkpointed and self.training and torch.is_grad_enabled()


def run_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``layer(*args, **kwargs)``; a checkpointed layer (:func:`use_activation_checkpointing`) in a training
    forward pass keeps only its inputs for the backward pass, which runs it again, with the random state of
    its forward pass (the same dropout masks), for the activations its gradients need. Called on the module
    as the model holds it (compiled or not), so that a compiled layer runs compiled both times."""
    if layer.recomputed() and layer.recomputed_whole:
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)


class NodeLayer(MessageLayer):
    """The node update shared by the decoder and context layers: a three-layer message MLP ``W1``-``W3`` on
    ``[h_V_i, inputs_ij]`` summed over the neighbours, then a feed-forward block."""

    fused = False  # the message MLP as a fused kernel where the device allows (use_fused_kernels)

    def __init__(self, num_hidden: int, num_in: int, dropout: float = 0.1, scale: float = 30.0) -> None:
        super().__init__()
        self.scale = scale
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.norm1 = nn.LayerNorm(num_hidden)
        self.norm2 = nn.LayerNorm(num_hidden)
        self.W1 = nn.Linear(num_hidden + num_in, num_hidden, bias=True)
        self.W2 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.W3 = nn.Linear(num_hidden, num_hidden, bias=True)
        self.act = nn.GELU()
        self.dense = PositionWiseFeedForward(num_hidden, num_hidden * 4)

    def _update_nodes(self, h_V: Tensor, summed: Tensor, count: Tensor | int, mask_V: Tensor) -> Tensor:
        """New node states from ``summed``, the sum over ``count`` neighbours of the message MLP's hidden
        layer before ``W3`` (``W3`` is linear, so it is applied once, after the sum); zero where ``mask_V``
        is 0."""
        if isinstance(count, int):  # one count for all nodes: the bias goes into the linear map
            dh = F.linear(summed, weight(self.W3), count * self.W3.bias) / self.scale
        else:
            dh = (F.linear(summed, weight(self.W3)) + count * self.W3.bias) / self.scale
        h_V = self.norm1(h_V + self.dropout1(dh))
        h_V = self.norm2(h_V + self.dropout2(self.dense(h_V)))
        return mask_V.unsqueeze(-1) * h_V


class EncLayer(MessageLayer):
    """Encoder message-passing layer: updates nodes from edges and neighbours, then edges from nodes.

    The first linear layer of each message MLP, which acts on ``[h_V_i, h_E_ij, h_V_j]``, is applied block by
    block (node blocks per node, then gathered), and the last one after the sum over neighbours.
    """

    fused = False  # the message MLPs as fused kernels where the device allows (use_fused_kernels)

    def __init__(self, num_hidden: int, num_in: int, dropout: float = 0.1, scale: float = 30.0) -> None:
        super().__init__()  # parameters registered in the official order, which exports keep
        self.scale = scale
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.norm1 = nn.LayerNorm(num_hidden)
        self.norm2 = nn.LayerNorm(num_hidden)
        self.norm3 = AutocastLayerNorm(num_hidden)
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
        W_i, W_e, W_j = weight(W).split([h_V.shape[-1], h_E.shape[-1], h_V.shape[-1]], dim=1)
        node_i = F.linear(h_V, W_i, W.bias).unsqueeze(2)
        return F.linear(h_E, W_e).add_(gather_nodes(F.linear(h_V, W_j), E_idx)).add_(node_i)

    @staticmethod
    def _blocks(W: nn.Linear, h_V: Tensor, h_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The blocks of ``W(cat([h_V_i, h_E_ij, h_V_j]))`` for the fused kernels, which apply the edge block
        ``W_e`` edge by edge, nodes flattened: the node block with the bias ``[B * L, H]``, the neighbour
        block (to be gathered) ``[B * L, H]`` and ``W_e``."""
        W_i, W_e, W_j = weight(W).split([h_V.shape[-1], h_E.shape[-1], h_V.shape[-1]], dim=1)
        return F.linear(h_V, W_i, W.bias).flatten(0, 1), F.linear(h_V, W_j).flatten(0, 1), W_e

    def forward(
        self, h_V: Tensor, h_E: Tensor, E_idx: Tensor, mask_V: Tensor, mask_attend: Tensor
    ) -> tuple[Tensor, Tensor]:
        fuses = runs_fused(self, h_E)
        if fuses:
            node_i, node_j, W_e = self._blocks(self.W1, h_V, h_E)
            # the edges come back for the edge update below: the node sum's backward kernel adds the edge
            # update's gradient of them to its own
            summed, edges = fused.message_sum_and_edges(
                h_E.flatten(0, 1), node_i[:, None], weight(self.W2), self.W2.bias, table=node_j[:, None],
                index=flat_neighbors(E_idx), weight=mask_attend.flatten(0, 1)[..., None], W_e=W_e,
            )  # fmt: skip
            summed, h_E = summed.view_as(h_V), edges.view_as(h_E)
        else:
            hidden = self.act(linear(self.W2, self.act(self._first_linear(self.W1, h_V, h_E, E_idx))))
            summed = torch.einsum("blk,blkh->blh", mask_attend.to(hidden.dtype), hidden)
        messages = F.linear(summed, weight(self.W3))
        dh = (messages + mask_attend.sum(-1, keepdim=True) * self.W3.bias) / self.scale
        h_V = self.norm1(h_V + self.dropout1(dh))
        h_V = self.norm2(h_V + self.dropout2(self.dense(h_V)))
        h_V = mask_V.unsqueeze(-1) * h_V

        if fuses and applies_merged(self.W12) and applies_merged(self.W13):
            node_i, node_j, W_e = self._blocks(self.W11, h_V, h_E)
            mlp = (edges, node_i, node_j, flat_neighbors(E_idx), weight(self.W12), self.W12.bias)
            mlp += (weight(self.W13), self.W13.bias)
            if not (self.training and self.dropout3.p > 0):  # the residual and layer norm in the kernel
                norm = (edges, *self.norm3.applied(h_E), self.norm3.eps)
                return h_V, fused.edge_update(*mlp, *norm, W_e=W_e).view_as(h_E)
            h_message = fused.edge_messages(*mlp, W_e=W_e).view_as(h_E)
        else:
            hidden = self.act(self._first_linear(self.W11, h_V, h_E, E_idx))
            h_message = linear(self.W13, self.act(linear(self.W12, hidden)))
        h_E = self.norm3(h_E + self.dropout3(h_message))
        return h_V, h_E


class DecLayer(NodeLayer):
    """Decoder layer for N sequences per structure (nodes ``[B, L, N, H]``, edges ``[B, L, K, N, H]``).

    The first linear layer of the message MLP acts on ``[h_V_i, h_E_ij, h_S_j, h_V_j]`` for neighbours decoded
    before ``i`` and on ``[h_V_i, h_E_ij, 0, h_V_enc_j]`` for the others; it is applied block by block, with
    the structure-only blocks computed once for all N sequences. The last linear layer is applied after the
    sum over neighbours. A subset of positions can be updated alone, for incremental decoding.
    """

    def forward(
        self, h_V: Tensor, h_S: Tensor, enc: Encoding, mask_bw: Tensor, positions: Tensor | None = None
    ) -> Tensor:
        """Update the states ``h_V [B, L, N, H]`` from the token embeddings ``h_S [B, L, N, H]``.

        ``mask_bw [B, L, K, N]`` is 1 where ``i`` is present and sees the token of neighbour ``j``. Returns
        the new states of all positions, ``[B, L, N, H]``; with ``positions [B, Q, N]``, only those of
        sequence ``n`` at ``positions[b, q, n]``, ``[B, Q, N, H]`` (a step of incremental decoding).
        """
        if positions is None:
            H = h_V.shape[-1]
            W_i, W_e, W_s, W_j = weight(self.W1).split([H, enc.h_E.shape[-1], h_S.shape[-1], H], dim=1)
            neighbours = F.linear(enc.h_V, W_j)
            visible = F.linear(h_S, W_s) + F.linear(h_V - enc.h_V.unsqueeze(2), W_j)
            if runs_fused(self, enc.h_E):  # the edge block applied and the neighbours' gathered in the kernel
                summed = fused.message_sum(
                    enc.h_E.flatten(0, 1), F.linear(h_V, W_i, self.W1.bias).flatten(0, 1),
                    weight(self.W2), self.W2.bias, table=visible.flatten(0, 1),
                    index=flat_neighbors(enc.E_idx), scale=mask_bw.flatten(0, 1),
                    shared=neighbours.flatten(0, 1), W_e=W_e,
                ).view_as(h_V)  # fmt: skip
                return self._update_nodes(h_V, summed, enc.E_idx.shape[2], enc.mask.unsqueeze(-1))
            structure = F.linear(enc.h_E, W_e).add_(gather_nodes(neighbours, enc.E_idx))
            visible = gather_nodes(visible, enc.E_idx)
            pre = torch.addcmul(structure.unsqueeze(3), mask_bw.unsqueeze(-1).to(visible.dtype), visible)
            return self._update(h_V, pre, enc.mask.unsqueeze(-1))
        E_idx = gather_nodes(enc.E_idx, positions).transpose(2, 3)  # [B, Q, K, N]
        seen = mask_bw.gather(1, positions.unsqueeze(2).expand(-1, -1, E_idx.shape[2], -1)).unsqueeze(-1) > 0
        h_V_j = torch.where(seen, gather_sample_nodes(h_V, E_idx), gather_nodes(enc.h_V, E_idx))
        h_S_j = gather_sample_nodes(h_S, E_idx) * seen
        h_E = gather_nodes(enc.h_E, positions).transpose(2, 3)
        pre = self._gathered_blocks(h_E, h_S_j, h_V_j)
        return self._update(gather_sample_nodes(h_V, positions), pre, gather_nodes(enc.mask, positions))

    def update_residues(
        self, h_V: Tensor, h_S: Tensor, enc: Encoding, mask_bw: Tensor, residues: Tensor, sequences: Tensor
    ) -> Tensor:
        """:meth:`forward`'s new states ``[M, H]`` of M residues alone: residue ``residues[m]`` (a row of the
        flattened ``[B * L]``) of sequence ``sequences[m]``. ``W1``'s blocks are applied, as in the whole
        layer, once to each residue and each (neighbour, sequence) these see, then gathered onto the edges."""
        H, N = h_V.shape[-1], h_V.shape[2]
        _, W_e, W_s, W_j = weight(self.W1).split([H, enc.h_E.shape[-1], h_S.shape[-1], H], dim=1)
        E_idx, encoded = flat_neighbors(enc.E_idx), enc.h_V.flatten(0, 1)
        rows, row = torch.unique(residues, return_inverse=True)
        structure = F.linear(enc.h_E.flatten(0, 1)[rows], W_e).add_(F.linear(encoded, W_j)[E_idx[rows]])
        seen_by = E_idx[residues] * N + sequences.unsqueeze(1)  # [M, K] rows of the flattened [B * L * N]
        pairs, pair = torch.unique(seen_by, return_inverse=True)
        # indexed by (residue, sequence): the states and token embeddings may be expanded over the
        # sequences, and flattening them would copy them whole
        h_S, h_V, node, sequence = h_S.flatten(0, 1), h_V.flatten(0, 1), pairs // N, pairs % N
        visible = F.linear(h_S[node, sequence], W_s)
        visible = visible + F.linear(h_V[node, sequence] - encoded[node], W_j)
        seen = mask_bw.flatten(0, 1)[residues, :, sequences].unsqueeze(-1)  # [M, K, 1]
        pre = torch.addcmul(structure[row], seen.to(visible.dtype), visible[pair]).transpose(0, 1)  # K, M, H
        h_V = h_V[residues, sequences]
        mask = enc.mask.flatten()[residues]
        return self._update(h_V[None, None], pre[None, None], mask[None, None])[0, 0]

    def update_gathered(self, h_V: Tensor, h_E: Tensor, h_S_j: Tensor, h_V_j: Tensor, mask: Tensor) -> Tensor:
        """New states ``[N, H]`` of N nodes from their states ``h_V [N, H]``, edges ``h_E [N, K, H]`` and
        their neighbours' token embeddings ``h_S_j`` (zero where not seen) and states ``h_V_j`` (the
        encoder's where not seen), ``[N, K, H]``; ``mask [N]``."""
        pre = self._gathered_blocks(h_E, h_S_j, h_V_j).transpose(0, 1)
        return self._update(h_V[None, None], pre[None, None], mask[None, None])[0, 0]

    def _gathered_blocks(self, h_E: Tensor, h_S_j: Tensor, h_V_j: Tensor) -> Tensor:
        """``W1`` without bias on ``[0, h_E_ij, h_S_j, h_V_j]`` for neighbours already gathered."""
        H = h_V_j.shape[-1]
        _, W_e, W_s, W_j = weight(self.W1).split([H, h_E.shape[-1], h_S_j.shape[-1], H], dim=1)
        return F.linear(h_E, W_e) + F.linear(h_S_j, W_s) + F.linear(h_V_j, W_j)

    def _update(self, h_V: Tensor, pre: Tensor, mask: Tensor) -> Tensor:
        """New states from the states ``h_V [B, Q, N, H]`` and the neighbour blocks of the first linear layer.

        ``pre [B, Q, K, N, H]`` holds ``W1`` without bias applied to ``[0, h_E_ij, h_S_j, h_V_j]`` (to
        ``[0, h_E_ij, 0, h_V_enc_j]`` for neighbours not seen); ``mask`` is ``[B, Q, N]`` or ``[B, Q, 1]``.
        """
        pre = pre.add_(F.linear(h_V, weight(self.W1)[:, : h_V.shape[-1]], self.W1.bias).unsqueeze(2))
        hidden = self.act(linear(self.W2, self.act(pre))).sum(2)
        return self._update_nodes(h_V, hidden, pre.shape[2], mask)


class ContextLayer(NodeLayer):
    """LigandMPNN's context message-passing layer: each node ``h_V [..., H]`` is updated from messages over
    its own set of context entries ``h_E [..., M, C]`` (a residue's context atoms, or an atom's fellow atoms),
    where ``mask_attend [..., M]`` is 1. Checkpointed, it recomputes its message MLP chunk by chunk
    (:meth:`_message_sum_in_chunks`), not the whole layer: the entries outnumber the nodes M to 1."""

    recomputed_whole = False

    def forward(
        self,
        h_V: Tensor,
        h_E: Tensor,
        mask_V: Tensor,
        mask_attend: Tensor,
        edge_projection: nn.Linear | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The new nodes, and the entries again for their next use (where the kernel applies the edge block,
        its backward pass adds that use's gradient of them to its own). With ``edge_projection``, ``h_E``
        are the entries before that linear map, which is folded into the first layer of the message MLP.
        The last layer is applied after the sum over the entries."""
        W_v, W_e = weight(self.W1).split([h_V.shape[-1], self.W1.in_features - h_V.shape[-1]], dim=1)
        bias = self.W1.bias
        if edge_projection is not None:
            bias = bias + F.linear(edge_projection.bias, W_e)
            W_e = W_e @ weight(edge_projection)
        node_i = F.linear(h_V, W_v, bias)
        if runs_fused(self, h_E):
            # the kernels apply a square edge block edge by edge (the atom layers'); the residue layers'
            # entries, 2H wide, take it before
            mlp = (node_i.flatten(0, -2)[:, None], weight(self.W2), self.W2.bias)
            entries = mask_attend.flatten(0, -2)[..., None]
            if W_e.shape[0] == W_e.shape[1]:
                summed, edges = fused.message_sum_and_edges(h_E.flatten(0, -3), *mlp, weight=entries, W_e=W_e)
                summed, h_E = summed.view_as(node_i), edges.view_as(h_E)
            else:
                summed = fused.message_sum(F.linear(h_E, W_e).flatten(0, -3), *mlp, weight=entries)
                summed = summed.view_as(node_i)
        elif not torch.compiler.is_compiling() and (
            self.recomputed() or (not torch.is_grad_enabled() and h_E.device.type == "cpu")
        ):
            summed = self._message_sum_in_chunks(node_i, h_E, mask_attend, W_e)
        else:
            summed = self._message_sum(node_i, h_E, mask_attend, W_e)
        count = mask_attend.to(summed.dtype).sum(-1, keepdim=True)
        return self._update_nodes(h_V, summed, count, mask_V), h_E

    def _message_sum(self, node_i: Tensor, h_E: Tensor, mask_attend: Tensor, W_e: Tensor) -> Tensor:
        """The message MLP's first two layers on each entry, summed over the node's entries."""
        hidden = self.act(linear(self.W2, self.act(F.linear(h_E, W_e).add_(node_i.unsqueeze(-2)))))
        return torch.einsum("...m,...mh->...h", mask_attend.to(hidden.dtype), hidden)

    def _message_sum_in_chunks(self, node_i: Tensor, h_E: Tensor, mask_attend: Tensor, W_e: Tensor) -> Tensor:
        """:meth:`_message_sum` over chunks of about `CHUNK_ENTRIES` entries, each chunk's activations
        recomputed in the backward pass: a checkpointed layer keeps none of them, and its backward pass
        holds one chunk's, not every entry's (the atom layers': ``[B, L, 25, 25, H]``); a pass without
        gradients (on a CPU) writes one chunk at a time. Each node's sum is the unchunked one, to the bit."""
        nodes, entries, mask = node_i.flatten(0, -2), h_E.flatten(0, -3), mask_attend.flatten(0, -2)
        size = max(1, CHUNK_ENTRIES // entries.shape[1])
        sums = [
            checkpoint(self._message_sum, *chunk, W_e, use_reentrant=False)
            if torch.is_grad_enabled()
            else self._message_sum(*chunk, W_e)
            for chunk in zip(nodes.split(size), entries.split(size), mask.split(size), strict=True)
        ]
        return torch.cat(sums).view_as(node_i)
