"""The k-nearest-neighbour graph features of a backbone (full-backbone and CA-only), and the node features
of LigandMPNN (ligand context atoms) and of the membrane-label models.

Numerics follow the reference ``protein_mpnn_utils.py`` and LigandMPNN's ``model_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpo_inv.models import fused
from dpo_inv.models.layers import (
    AutocastLayerNorm,
    applies_merged,
    flat_neighbors,
    gather_neighbors,
    gather_nodes,
    weight,
)
from dpo_inv.structures.context import periodic_group_and_period

_NUM_RBF = 16
_NUM_POSITIONAL = 16
_MAX_RELATIVE_FEATURE = 32
SEARCH_CHUNK_DISTANCES = 1 << 22  # distances a nearest-neighbour search holds at a time (~32 bytes each)

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


_RBF_MIN, _RBF_MAX = 2.0, 22.0  # Å: the first and last of the 16 centres
_RBF_SIGMA = (_RBF_MAX - _RBF_MIN) / _NUM_RBF


def _rbf_centres(device: torch.device) -> Tensor:
    return torch.linspace(_RBF_MIN, _RBF_MAX, _NUM_RBF, device=device)


def _rbf(D: Tensor) -> Tensor:
    """Gaussian radial basis expansion of distances (2-22 Å, 16 centres) along a new last axis.

    Exponents below -87 are raised to it (values under 2e-38, where ``exp`` is many times slower, none of
    which changes a sum it enters)."""
    return (
        (D.unsqueeze(-1) - _rbf_centres(D.device)).div_(_RBF_SIGMA).square_().neg_().clamp_(min=-87.0).exp_()
    )


def _neighbor_rbf(D_neighbors: Tensor, atoms: Tensor, E_idx: Tensor, pairs: Tensor) -> Tensor:
    """RBF of the neighbour distances ``D_neighbors [B, L, K]``, then of the distances between atom ``a`` of
    residue ``i`` and atom ``b`` of each neighbour ``j`` for each pair ``(a, b)`` of ``pairs [2, P]``, from
    ``atoms [B, L, A, 3]``: ``[B, L, K, (1 + P) * 16]``."""
    B, L, A, _ = atoms.shape
    neighbors = gather_nodes(atoms.reshape(B, L, A * 3), E_idx).view(*E_idx.shape, A, 3)
    diff = atoms[:, :, None].index_select(3, pairs[0]) - neighbors.index_select(3, pairs[1])
    D = torch.cat((D_neighbors.unsqueeze(-1), torch.sqrt(torch.sum(diff**2, -1) + 1e-6)), -1)
    return _rbf(D).flatten(-2)


def _embedded_rbf(
    D_neighbors: Tensor,
    atoms: Tensor,
    E_idx: Tensor,
    pairs: Tensor,
    embedding: tuple[Tensor, ...],
    norm: AutocastLayerNorm,
    fuse: bool,
) -> Tensor:
    """``norm`` of the edge embedding of :func:`_neighbor_rbf`'s features and the positional encodings, in
    ``embedding``'s parts (:meth:`GraphFeatures._edge_embedding_parts`). With ``fuse``, where the device
    allows, one kernel that applies both edge by edge without writing the features or the embedding
    (:func:`fused.embedded_rbf`)."""
    if fuse and fused.available(D_neighbors) and not atoms.requires_grad:
        rows = flat_neighbors(E_idx)
        centres = _rbf_centres(atoms.device)
        return fused.embedded_rbf(
            D_neighbors, atoms, rows, pairs, centres, _RBF_SIGMA, *embedding, *norm.applied(atoms), norm.eps
        )
    return norm(_embedded(_neighbor_rbf(D_neighbors, atoms, E_idx, pairs), *embedding))


def _embedded(rest: Tensor, classes: Tensor, table: Tensor, W_rest: Tensor) -> Tensor:
    """The edge embedding of the features ``rest`` and the positional classes' encodings ``table``."""
    return F.linear(rest, W_rest).add_(F.embedding(classes, table))


class PositionalEncodings(nn.Module):
    """Embedded one-hot residue offset, clipped to ±32, with one extra class for residues on other chains."""

    def __init__(self, num_embeddings: int, max_relative_feature: int = _MAX_RELATIVE_FEATURE) -> None:
        super().__init__()
        self.max_relative_feature = max_relative_feature
        self.linear = nn.Linear(2 * max_relative_feature + 1 + 1, num_embeddings)

    def classes(self, offset: Tensor, same_chain: Tensor) -> Tensor:
        """The class of each offset: ``offset + 32`` clipped to 0..64, or 65 across chains."""
        m = self.max_relative_feature
        return torch.clip(offset + m, 0, 2 * m) * same_chain + (1 - same_chain) * (2 * m + 1)

    def table(self) -> Tensor:
        """The encoding of every class, ``[66, num_embeddings]`` (the linear map of its one-hot)."""
        return weight(self.linear).T + self.linear.bias


class GraphFeatures(nn.Module):
    """k-nearest-neighbour graph on CA atoms plus relative positional edge features.

    Constant index tables are buffers on the model's device (an index from a Python list would be copied
    to the device at every step, which a CUDA graph cannot capture), filled by :meth:`init_buffers`."""

    ATOM_PAIRS: tuple[tuple[int, int], ...]  # the pairs of atoms whose distances are edge features
    fused = False  # the distance features as one kernel where the device allows (use_fused_kernels)

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.embeddings = PositionalEncodings(_NUM_POSITIONAL)
        self.register_buffer("atom_pairs", self._atom_pair_table(), persistent=False)

    def _atom_pair_table(self) -> Tensor:
        """``ATOM_PAIRS`` as ``[2, P]``: the centre atoms, then the neighbour atoms."""
        return torch.tensor(self.ATOM_PAIRS).T.contiguous()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the constant buffers, which a checkpoint does not hold."""
        self.atom_pairs.copy_(self._atom_pair_table())

    def _dist(self, Ca: Tensor, mask: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
        """Distances to and indices of the ``top_k`` nearest residues (missing residues pushed last)."""
        k = min(self.top_k, Ca.shape[1])

        def nearest(Ca_i: Tensor, mask_i: Tensor) -> tuple[Tensor, Tensor]:
            mask_2D = mask.unsqueeze(1) * mask_i.unsqueeze(2)
            dX = Ca.unsqueeze(1) - Ca_i.unsqueeze(2)
            D = mask_2D * torch.sqrt(torch.sum(dX**2, 3) + eps)
            D_max, _ = torch.max(D, -1, keepdim=True)
            D_adjust = D + (1.0 - mask_2D) * D_max
            return tuple(torch.topk(D_adjust, k, dim=-1, largest=False))

        return in_row_chunks(nearest, (Ca, mask), Ca.shape[1])

    def _edge_embedding_parts(
        self, E_idx: Tensor, residue_idx: Tensor, chain_labels: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``edge_embedding`` of ``[positional encoding, rest]`` in parts: each edge's positional class ``[B,
        L, K]``, the encodings of the 66 classes with the map's block applied ``[66, H]`` (looked up per
        edge: an edge-sized product less, and none on ``rest``'s gradient, which is not needed), and the
        map's block for ``rest``."""
        offset = residue_idx.unsqueeze(-1) - gather_neighbors(residue_idx, E_idx)
        same_chain = (chain_labels.unsqueeze(-1) == gather_neighbors(chain_labels, E_idx)).long()
        classes = self.embeddings.classes(offset.long(), same_chain)
        W = weight(self.edge_embedding)
        W_positional, W_rest = W.split([_NUM_POSITIONAL, W.shape[1] - _NUM_POSITIONAL], dim=1)
        return classes, F.linear(self.embeddings.table(), W_positional), W_rest


def in_row_chunks(
    search: Callable[..., tuple[Tensor, ...]], rows: tuple[Tensor, ...], columns: int
) -> tuple[Tensor, ...]:
    """``search(*rows)``, a nearest-neighbour search of each row (dim 1 of ``rows``, each ``[B, L, ...]``)
    among ``columns`` candidates, over chunks of rows of at most ``SEARCH_CHUNK_DISTANCES`` distances, its
    outputs concatenated along dim 1: each row's result to the bit, holding one chunk's distances at a time,
    not all ``B x L x columns`` (the compiler takes the search whole)."""
    if torch.compiler.is_compiling():
        return search(*rows)
    B, L = rows[0].shape[:2]
    size = max(1, SEARCH_CHUNK_DISTANCES // max(1, B * columns))
    if size >= L:
        return search(*rows)
    parts = [search(*chunk) for chunk in zip(*(x.split(size, dim=1) for x in rows), strict=True)]
    return tuple(torch.cat(outputs, dim=1) for outputs in zip(*parts, strict=True))


def virtual_cb(X: Tensor) -> Tensor:
    """The ideal C-beta position ``[..., 3]`` from the backbone ``X [..., 4, 3]`` (N, CA, C, O)."""
    N, Ca, C, _ = X.unbind(-2)
    b = Ca - N
    c = C - Ca
    a = torch.cross(b, c, dim=-1)
    return -0.58273431 * a + 0.56802827 * b - 0.54067466 * c + Ca


class ProteinFeatures(GraphFeatures):
    """Edge features of the full-backbone model: 25 inter-atomic RBF distances (N, CA, C, O, virtual Cb)."""

    ATOM_PAIRS = _BACKBONE_PAIRS

    def __init__(self, edge_features: int, top_k: int) -> None:
        super().__init__(top_k)
        self.edge_embedding = nn.Linear(_NUM_POSITIONAL + _NUM_RBF * 25, edge_features, bias=False)
        self.norm_edges = AutocastLayerNorm(edge_features)

    def forward(
        self, X: Tensor, mask: Tensor, residue_idx: Tensor, chain_labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        N, Ca, C, O = X.unbind(2)
        Cb = virtual_cb(X)
        D_neighbors, E_idx = self._dist(Ca, mask)
        atoms = torch.stack((N, Ca, C, O, Cb), dim=2)
        embedding = self._edge_embedding_parts(E_idx, residue_idx, chain_labels)
        E = _embedded_rbf(D_neighbors, atoms, E_idx, self.atom_pairs, embedding, self.norm_edges, self.fused)
        return E, E_idx


class CAProteinFeatures(GraphFeatures):
    """Edge features of the CA-only model: RBF distances among neighbouring CA triplets and local frames."""

    ATOM_PAIRS = _CA_PAIRS

    def __init__(self, node_features: int, edge_features: int, top_k: int) -> None:
        super().__init__(top_k)
        self.node_embedding = nn.Linear(3, node_features, bias=False)  # present in the checkpoints, unused
        self.edge_embedding = nn.Linear(_NUM_POSITIONAL + _NUM_RBF * 9 + 7, edge_features, bias=False)
        self.norm_nodes = nn.LayerNorm(node_features)  # present in the checkpoints, unused
        self.norm_edges = AutocastLayerNorm(edge_features)

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
        rest = torch.cat(
            (_neighbor_rbf(D_neighbors, atoms, E_idx, self.atom_pairs), self._orientations(Ca, E_idx)), -1
        )
        E = _embedded(rest, *self._edge_embedding_parts(E_idx, residue_idx, chain_labels))
        return self.norm_edges(E), E_idx


_NUM_ELEMENTS, _NUM_GROUPS, _NUM_PERIODS = 120, 19, 8  # one-hot sizes of atomic number, group, period


def _groups_and_periods() -> Tensor:
    """The periodic-table group and period of each atomic number, ``[120, 2]``."""
    return torch.tensor([periodic_group_and_period(z) for z in range(_NUM_ELEMENTS)])


class LigandFeatures(ProteinFeatures):
    """LigandMPNN's features: the backbone edges, plus for each residue its ``atom_context_num`` context atoms
    nearest to its virtual Cb: residue-atom node features (RBF distances to N, CA, C, O, Cb, the element, the
    direction in the residue's frame), atom embeddings and atom-atom edges."""

    def __init__(self, node_features: int, edge_features: int, top_k: int, atom_context_num: int) -> None:
        super().__init__(edge_features, top_k)
        self.atom_context_num = atom_context_num
        element_features = _NUM_ELEMENTS + _NUM_GROUPS + _NUM_PERIODS
        self.node_project_down = nn.Linear(5 * _NUM_RBF + 64 + 4, node_features, bias=True)
        self.norm_nodes = AutocastLayerNorm(node_features)
        self.type_linear = nn.Linear(element_features, 64)
        self.y_nodes = nn.Linear(element_features, node_features, bias=False)
        self.y_edges = nn.Linear(_NUM_RBF, node_features, bias=False)
        self.norm_y_edges = AutocastLayerNorm(node_features)
        self.norm_y_nodes = AutocastLayerNorm(node_features)
        self.register_buffer("groups_and_periods", _groups_and_periods(), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the constant buffers: the atom pairs, and each element's group and period."""
        super().init_buffers()
        self.groups_and_periods.copy_(_groups_and_periods())

    def nearest_atoms(
        self, X: Tensor, mask: Tensor, xyz: Tensor, element: Tensor, atom_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Each residue's context atoms nearest to its virtual Cb: coordinates ``[B, L, M, 3]``, atomic
        numbers and mask ``[B, L, M]``, from the structure's ``xyz [B, A, 3]``, ``element``, ``atom_mask``."""
        k = min(self.atom_context_num, xyz.shape[1])

        def nearest(X_i: Tensor, mask_i: Tensor) -> tuple[Tensor]:
            d2 = torch.sum((virtual_cb(X_i)[:, :, None] - xyz[:, None]) ** 2, -1)
            d2 = d2.masked_fill(~(mask_i[:, :, None] * atom_mask[:, None]).bool(), float("inf"))
            return (torch.topk(d2, k, dim=-1, largest=False).indices,)

        (idx,) = in_row_chunks(nearest, (X, mask), xyz.shape[1])
        Y = gather_nodes(xyz, idx)
        return Y, gather_neighbors(element, idx), gather_neighbors(atom_mask, idx)

    def _element_one_hot(self, element: Tensor) -> Tensor:
        """One-hot atomic number, group and period side by side ``[..., 147]``, written once in the weights'
        dtype (not three int64 one-hots, concatenated, then cast)."""
        group, period = self.groups_and_periods[element].unbind(-1)
        hot = torch.stack((element, _NUM_ELEMENTS + group, _NUM_ELEMENTS + _NUM_GROUPS + period), -1)
        size = _NUM_ELEMENTS + _NUM_GROUPS + _NUM_PERIODS
        zeros = torch.zeros(*element.shape, size, dtype=self.type_linear.weight.dtype, device=element.device)
        return zeros.scatter_(-1, hot, 1.0)

    @staticmethod
    def _local_directions(X: Tensor, Y: Tensor) -> Tensor:
        """Direction of each atom ``Y [B, L, M, 3]`` in its residue's (N, CA, C) frame: ``[B, L, M, 4]``."""
        N, Ca, C, _ = X.unbind(2)
        e1 = F.normalize(N - Ca, dim=-1)
        v2 = C - Ca
        e2 = F.normalize(v2 - e1 * (e1 * v2).sum(-1, keepdim=True), dim=-1)
        frame = torch.stack((e1, e2, torch.cross(e1, e2, dim=-1)), dim=-1)
        local = torch.einsum("blqp,blyq->blyp", frame, Y - Ca[:, :, None])
        rxy = torch.sqrt(local[..., 0] ** 2 + local[..., 1] ** 2 + 1e-8)
        rxyz = torch.norm(local, dim=-1) + 1e-8
        return torch.stack((local[..., 0] / rxy, local[..., 1] / rxy, rxy / rxyz, local[..., 2] / rxyz), -1)

    def context(self, X: Tensor, Y: Tensor, element: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Residue-atom node features ``[B, L, M, H]``, atom nodes ``[B, L, M, H]`` and atom-atom edges
        ``[B, L, M, M, H]`` for the atoms ``Y`` of each residue."""
        atoms = torch.stack((*X.unbind(2)[:3], X[:, :, 3], virtual_cb(X)), dim=2)  # N, CA, C, O, Cb
        D = torch.sqrt(torch.sum((atoms[:, :, :, None] - Y[:, :, None]) ** 2, -1) + 1e-6)  # [B, L, 5, M]
        types = self._element_one_hot(element.long())
        V = torch.cat(
            (_rbf(D).transpose(2, 3).flatten(-2), self.type_linear(types), self._local_directions(X, Y)), -1
        )
        D_atoms = torch.sqrt(torch.sum((Y[:, :, :, None] - Y[:, :, None]) ** 2, -1) + 1e-6)
        return (
            self.norm_nodes(self.node_project_down(V)),
            self.norm_y_nodes(self.y_nodes(types)),
            self._atom_edges(D_atoms, Y),
        )

    def _atom_edges(self, D: Tensor, Y: Tensor) -> Tensor:
        """``norm_y_edges`` of ``y_edges`` of the RBF of the atom-atom distances ``D [B, L, M, M]`` (of the
        atoms ``Y [B, L, M, 3]``); where the device allows, one kernel that writes neither the features nor
        the embedding (each residue's atoms the nodes of a graph, their fellow atoms the neighbours:
        :func:`fused.embedded_rbf`)."""
        if not (self.fused and fused.available(D) and not Y.requires_grad and applies_merged(self.y_edges)):
            return self.norm_y_edges(self.y_edges(_rbf(D)))
        B, L, M, _ = D.shape
        centres, no_pairs = _rbf_centres(D.device), self.atom_pairs[:, :0]
        atoms = Y.reshape(B, L * M, 1, 3)
        norm = self.norm_y_edges
        edges = fused.embedded_rbf(
            D.view(B, L * M, M), atoms, None, no_pairs, centres, _RBF_SIGMA, None, None, weight(self.y_edges),
            *norm.applied(D), norm.eps,
        )  # fmt: skip
        return edges.view(B, L, M, M, -1)


class MembraneFeatures(ProteinFeatures):
    """Backbone edges plus embedded per-residue membrane labels (0 none/soluble, 1 interface or
    transmembrane, 2 buried), as in LigandMPNN's membrane-label ProteinMPNN models."""

    NUM_LABELS = 3

    def __init__(self, node_features: int, edge_features: int, top_k: int) -> None:
        super().__init__(edge_features, top_k)
        self.node_embedding = nn.Linear(self.NUM_LABELS, node_features, bias=False)
        self.norm_nodes = nn.LayerNorm(node_features)

    def nodes(self, labels: Tensor) -> Tensor:
        """Node features ``[B, L, H]`` of the labels ``[B, L]``."""
        one_hot = F.one_hot(labels.long(), self.NUM_LABELS).to(self.node_embedding.weight.dtype)
        return self.norm_nodes(self.node_embedding(one_hot))
