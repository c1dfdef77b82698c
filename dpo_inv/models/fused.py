"""Message MLPs as fused Triton kernels that keep no per-edge activation in memory.

Every message-passing layer applies, edge by edge, ``GELU -> linear -> GELU`` to ``pre``, the first linear
map of ``[h_i, h_e, h_j]`` applied block by block. The plain layers write each of these per-edge tensors to
memory and keep them for the backward pass: at large batches they are what the step spends its time on (it
is bandwidth-bound). The kernels here assemble ``pre`` per edge from its blocks (the edge block, applied to
the edge's state in the kernel or given; a node block; gathered neighbour blocks, one of them scaled by a
visibility mask), run the MLP in registers, and write only

- :func:`message_sum`: the (masked) sum of the messages over each node's edges (node updates: the encoder,
  the decoder, LigandMPNN's context layers); :func:`message_sum_and_edges` also returns the edges for a
  later use, whose gradient of them its backward kernel adds to its own;
- :func:`edge_messages`: the last linear map of the MLP applied per edge (the encoder's edge update);
  :func:`edge_update` also adds them to the edges and normalises the sums (its residual and layer norm).

Their backward passes recompute the MLP from the same blocks. :func:`embedded_rbf` likewise applies the edge
embedding and its layer norm to the edges' distance features as it computes them from the atoms, writing
neither the features nor the embedding; its backward pass recomputes both. The
kernels run on CUDA devices where Triton is installed, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), where the tests compare them with the plain layers; elsewhere the layers take the
plain path.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of PyTorch without Triton: the plain path
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: Tensor) -> bool:
    """Whether the fused kernels run on ``x``: per-edge tensors in bf16 or fp16 on a CUDA device (in fp32 the
    backward kernel needs more shared memory than a multiprocessor has: the plain path runs), or any dtype
    on the CPU under Triton's interpreter."""
    if triton is None:
        return False
    if INTERPRET:
        return x.device.type == "cpu"
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return x.is_cuda and dtype in (torch.bfloat16, torch.float16)


def message_sum(
    edges: Tensor,
    nodes: Tensor,
    W2: Tensor,
    b2: Tensor,
    table: Tensor | None = None,
    index: Tensor | None = None,
    scale: Tensor | None = None,
    weight: Tensor | None = None,
    shared: Tensor | None = None,
    W_e: Tensor | None = None,
) -> Tensor:
    """``out[r, n] = sum_k weight[r, k, n] * GELU(W2 GELU(pre[r, k, n]) + b2)``, where
    ``pre[r, k, n] = W_e edges[r, k] + nodes[r, n] + scale[r, k, n] * table[index[r, k], n] +
    shared[index[r, k]]``.

    ``edges [R, K, H]``, the edges' states (with ``W_e [H, H]``, the first linear map's edge block, which
    the kernels apply edge by edge) or that block already applied (``W_e`` None); ``nodes [R, N, H]``;
    ``index [R, K]`` with ``table [T, N, H]`` and (the same for every n) ``shared [T, H]``, each optional;
    ``scale`` and ``weight`` ``[R, K, N]`` (optional: 1). Returns ``[R, N, H]`` in ``edges``' dtype; matrix
    products run in ``edges``' dtype (bf16 under bf16 autocast), everything else in fp32.
    """
    blocks = _blocks(edges, nodes, table, index, scale, weight, shared)
    return message_mlp(*blocks, W2, b2, None, None, W_e)


def message_sum_and_edges(
    edges: Tensor,
    nodes: Tensor,
    W2: Tensor,
    b2: Tensor,
    table: Tensor | None = None,
    index: Tensor | None = None,
    scale: Tensor | None = None,
    weight: Tensor | None = None,
    shared: Tensor | None = None,
    W_e: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`message_sum`, and ``edges`` again for their next use: the backward kernel adds that use's
    gradient of the edges to the one it writes, where autograd would sum the two in a pass of its own (which
    reads two values and writes one, where the kernel reads one more). Where the kernels read the edges in
    another dtype or layout than ``edges``', the sum and ``edges`` themselves."""
    blocks = _blocks(edges, nodes, table, index, scale, weight, shared)
    if blocks[0] is not edges:
        return message_mlp(*blocks, W2, b2, None, None, W_e), edges
    return _SumAndEdges.apply(*blocks, W2, b2, None, None, W_e)


def edge_messages(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor,
    index: Tensor,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor,
    b3: Tensor,
    W_e: Tensor | None = None,
) -> Tensor:
    """``out[r, k] = W3 GELU(W2 GELU(pre[r, k]) + b2) + b3`` with ``pre[r, k] = W_e edges[r, k] + nodes[r] +
    table[index[r, k]]``; ``edges [R, K, H]`` (as in :func:`message_sum`), ``nodes [R, H]``, ``table [T, H]``,
    ``index [R, K]``."""
    blocks = _blocks(edges, nodes[:, None], table[:, None], index, None, None, None)
    return message_mlp(*blocks, W2, b2, W3, b3, W_e)


def edge_update(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor,
    index: Tensor,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor,
    b3: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    W_e: Tensor | None = None,
) -> Tensor:
    """``layer_norm(residual + edge_messages(...))`` over the last dimension: the edge update with its
    residual and layer norm in the kernel, which writes the normalised edges instead of the messages (and,
    where autograd will need them, the sums and their mean and reciprocal deviation, which the layer norm's
    backward pass reads). The messages and the sums are rounded to ``edges``' dtype, as the plain layer
    rounds them; ``residual [R, K, H]`` (the layers': the edges themselves, whose two gradients the backward
    pass then sums in one product), ``norm_weight`` and ``norm_bias [H]``."""
    blocks = _blocks(edges, nodes[:, None], table[:, None], index, None, None, None)
    norm = (None if residual is edges else residual.contiguous(), norm_weight, norm_bias)
    return normed_edge_messages(*blocks[:4], W2, b2, W3, b3, *norm, eps, torch.is_grad_enabled(), W_e)[0]


def _blocks(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor | None,
    index: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    shared: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The blocks of ``pre`` as the kernels read them: contiguous, the edges in the autocast dtype (as the
    linear map of their block takes them), the index in int64, scale and weight in fp32."""
    device = edges.device.type
    if torch.is_autocast_enabled(device):
        edges = edges.to(torch.get_autocast_dtype(device))
    index = None if index is None else index.to(torch.int64)
    scale, weight = (None if x is None else x.to(torch.float32) for x in (scale, weight))
    blocks = (edges, nodes, table, index, scale, weight, shared)
    return tuple(None if x is None else x.contiguous() for x in blocks)


def _dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Matrix products in bf16 or fp16 where the blocks are, else fp32 (also under the interpreter, whose
    half-precision products are wrong). The kernels take the weights in this dtype, as autocast's linear
    maps round them."""
    return dtype if dtype in (torch.bfloat16, torch.float16) and not INTERPRET else torch.float32


def _weights(
    dtype: torch.dtype, W2: Tensor, b2: Tensor, W3: Tensor | None, b3: Tensor | None, W_e: Tensor | None
) -> list[Tensor]:
    """The kernels' ``W2, b2, W3, b3, W_e``: the matrices in the products' dtype, stand-ins for those None
    (the kernels' ``EDGE_OUT`` or ``HAS_EDGE_WEIGHT`` off)."""
    W2 = W2.to(dtype)
    W3, W_e = (W2 if x is None else x.to(dtype).contiguous() for x in (W3, W_e))
    return [W2, b2, W3, b2 if b3 is None else b3, W_e]


def _pointers(edges: Tensor, *optional: Tensor | None) -> tuple[Tensor, ...]:
    """The kernels' block arguments, ``edges`` standing in for those absent."""
    return (edges, *(edges if x is None else x for x in optional))


def _flags(*blocks: Tensor | None) -> dict[str, bool]:
    """The kernels' flags for the optional blocks ``table, scale, weight, shared`` and the edge block's
    weight ``W_e``."""
    return {name: x is not None for name, x in zip(_OPTIONAL, blocks, strict=True)}


_OPTIONAL = ("HAS_TABLE", "HAS_SCALE", "HAS_WEIGHT", "HAS_SHARED", "HAS_EDGE_WEIGHT")


# The kernels as operators: autograd, torch.compile (which keeps them whole, without a graph break) and
# dispatch modes (FLOP and byte counts) see one operator each for the forward and the backward pass.


@torch.library.custom_op("dpo_inv::message_mlp", mutates_args=())
def message_mlp(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor | None,
    index: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    shared: Tensor | None,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor | None,
    b3: Tensor | None,
    W_e: Tensor | None = None,
) -> Tensor:
    """Both kernels' forward pass on blocks from :func:`_blocks`: ``W3`` None, the summed messages
    ``[R, N, H]`` (:func:`message_sum`), else the per-edge ones ``[R, K, H]`` (:func:`edge_messages`)."""
    out = edges.new_empty(_messages_shape(edges, nodes, W3))
    _forward(edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e, out)
    return out


def _forward(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor | None,
    index: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    shared: Tensor | None,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor | None,
    b3: Tensor | None,
    W_e: Tensor | None,
    out: Tensor,
    norm: tuple[Tensor, ...] = (),
    eps: float = 0.0,
) -> None:
    """The forward kernel into ``out``; with ``norm`` (residual, weight, bias, then, to keep them, the sums
    and their means and reciprocal deviations), the edge update's residual and layer norm in its epilogue."""
    weights = _weights(_dot_dtype(edges.dtype), W2, b2, W3, b3, W_e)
    M = edges.shape[0] * nodes.shape[1]
    _forward_kernel[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),)](
        *_pointers(edges, nodes, table, index, scale, weight, shared), *weights, out,
        *(norm + (edges,) * (6 - len(norm))), eps,
        M, edges.shape[1], N=nodes.shape[1], H=edges.shape[2], **_flags(table, scale, weight, shared, W_e),
        EDGE_OUT=W3 is not None, NORM=bool(norm), KEEP=len(norm) == 6, DOT_DTYPE=_TL_DTYPE[weights[0].dtype],
    )  # fmt: skip


def _messages_shape(edges: Tensor, nodes: Tensor, W3: Tensor | None) -> tuple[int, int, int]:
    R, K, H = edges.shape
    return (R, nodes.shape[1], H) if W3 is None else (R, K, H)


@message_mlp.register_fake
def _(edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e=None) -> Tensor:  # noqa: ANN001
    return edges.new_empty(_messages_shape(edges, nodes, W3))


@torch.library.custom_op("dpo_inv::message_mlp_backward", mutates_args=())
def message_mlp_backward(
    d_out: Tensor,
    edges: Tensor,
    nodes: Tensor,
    table: Tensor | None,
    index: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    shared: Tensor | None,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor | None,
    b3: Tensor | None,
    W_e: Tensor | None = None,
    added: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`message_mlp`'s blocks and weights: ``edges, nodes, table, shared, W2, b2,
    W3, b3, W_e`` (empty for a block or weight that is None); those of the edges and the neighbours' blocks
    as the kernel wrote them (:func:`_gradients_out`; autograd rounds them to their inputs' dtype), the
    others in their inputs' dtype. With ``W_e`` the kernel computes the edges' and ``W_e``'s through the
    edge block ``W_e edges`` (:func:`_edge_gradients_in_kernel`), or writes the block's as the edges' and
    an empty one for ``W_e``: autograd then takes both from it. ``added``: a gradient of the edges from a
    later use, which the kernel adds to the one it computes through the edge block. The MLP is recomputed
    from the blocks, edge by edge."""
    W2k, b2k, W3k, b3k, W_ek = _weights(_dot_dtype(edges.dtype), W2, b2, W3, b3, W_e)
    edge_out = W3 is not None
    edge_gradients = _edge_gradients_in_kernel(edge_out, W_e is not None)
    if added is not None and not edge_gradients:
        raise ValueError("the backward kernel adds a gradient of the edges where it computes theirs")
    R, K, H = edges.shape
    N = nodes.shape[1]
    programs = _num_programs(edges.device)
    f32 = {"device": edges.device, "dtype": torch.float32}
    d_edges, d_nodes = _gradients_out(edges, nodes)
    d_table, d_shared = (
        edges.new_empty(0) if x is None else torch.zeros(x.shape, **f32) for x in (table, shared)
    )
    d_weights = torch.empty(programs, 2 if edge_out or edge_gradients else 1, H, H, **f32)
    d_biases = torch.empty(programs, 2 if edge_out else 1, H, **f32)
    _backward_kernel[(programs,)](
        *_pointers(edges, nodes, table, index, scale, weight, shared), W2k, b2k, W3k, b3k, W_ek,
        d_out.contiguous(), edges if added is None else added.contiguous(), d_edges, d_nodes, d_table,
        d_shared, d_weights, d_biases, R, K, N=N, N_BLOCK=triton.next_power_of_2(N), H=H,
        **_flags(table, scale, weight, shared, W_e), EDGE_OUT=edge_out, EDGE_GRADIENTS=edge_gradients,
        HAS_ADDED=added is not None, DOT_DTYPE=_TL_DTYPE[W2k.dtype],
    )  # fmt: skip
    d_weights, d_biases = d_weights.sum(0), d_biases.sum(0)
    absent = edges.new_empty  # each absent gradient a tensor of its own: an operator's outputs share nothing
    return (
        d_edges,
        d_nodes,
        d_table,
        d_shared,
        d_weights[0].to(W2.dtype, copy=True),
        d_biases[0].to(b2.dtype, copy=True),
        d_weights[1].to(W3.dtype, copy=True) if edge_out else absent(0),
        d_biases[1].to(b3.dtype, copy=True) if edge_out else absent(0),
        d_weights[1].to(W_e.dtype, copy=True) if edge_gradients else absent(0),
    )


def _edge_gradients_in_kernel(edge_out: bool, edge_weight: bool) -> bool:
    """Whether the backward kernel computes the edges' and ``W_e``'s gradients through the edge block itself:
    where it holds one weight gradient beside ``W_e``'s (the node sums' forms). The edge update's kernel
    (``edge_out``) holds ``W2``'s and ``W3``'s, and a third would not fit its registers: it writes the
    block's gradient."""
    return edge_weight and not edge_out


def _gradients_out(edges: Tensor, nodes: Tensor) -> tuple[Tensor, Tensor]:
    """The backward kernel's outputs for the gradients of ``edges`` and ``nodes``, in their dtype: it writes
    each value once, the edges' summed over the sequences in registers. (The neighbours' blocks' gradients,
    summed over the edges with atomic adds, are in fp32.)"""
    return torch.empty_like(edges), torch.empty_like(nodes)


@message_mlp_backward.register_fake
def _(
    d_out, edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e=None, added=None
) -> tuple[Tensor, ...]:  # noqa: ANN001
    d_edges, d_nodes = _gradients_out(edges, nodes)
    d_tables = (
        edges.new_empty(0) if x is None else x.new_empty(x.shape, dtype=torch.float32)
        for x in (table, shared)
    )
    d_weights = (edges.new_empty(0) if x is None else torch.empty_like(x) for x in (W2, b2, W3, b3))
    in_kernel = _edge_gradients_in_kernel(W3 is not None, W_e is not None)
    d_W_e = torch.empty_like(W_e) if in_kernel else edges.new_empty(0)
    return d_edges, d_nodes, *d_tables, *d_weights, d_W_e


def _save_blocks(ctx, inputs: tuple, output: Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _gradients(ctx, d_out: Tensor, added: Tensor | None = None) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    """The gradients of :func:`message_mlp`'s inputs; ``added``, a gradient of the edges from a later use,
    summed into theirs by the backward kernel where it computes theirs through the edge block."""
    edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e = ctx.saved_tensors
    in_kernel = _edge_gradients_in_kernel(W3 is not None, W_e is not None)
    d_edges, d_nodes, d_table, d_shared, d_W2, d_b2, d_W3, d_b3, d_W_e = message_mlp_backward(
        d_out, edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e,
        added if in_kernel else None,
    )  # fmt: skip
    d_edges, d_W_e = _edge_gradients(d_edges, d_W_e, edges, W_e, None if in_kernel else added)
    present = W3 is not None
    return (
        d_edges, d_nodes, d_table.to(table.dtype) if table is not None else None, None, None,
        None, d_shared.to(shared.dtype) if shared is not None else None, d_W2, d_b2,
        d_W3 if present else None, d_b3 if present else None, d_W_e,
    )  # fmt: skip


def _edge_gradients(
    d_edges: Tensor, d_W_e: Tensor, edges: Tensor, W_e: Tensor | None, added: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``edges`` (in their dtype) and ``W_e`` from :func:`message_mlp_backward`'s: as the
    kernel computed them, or, where it wrote the edge block's instead (``d_W_e`` empty), from that block's;
    the block's where ``W_e`` is None (the edges are the block). ``added``: a gradient of the edges from
    elsewhere, summed in (by the product through ``W_e``, which then reads it instead of writing a sum)."""
    d_edges = d_edges.to(edges.dtype)
    if W_e is None or d_W_e.numel():
        return d_edges if added is None else d_edges + added, d_W_e if W_e is not None else None
    rows, through = d_edges.flatten(0, 1), W_e.to(edges.dtype)
    d_W_e = (rows.T @ edges.flatten(0, 1)).to(W_e.dtype)
    d_edges = rows @ through if added is None else torch.addmm(added.flatten(0, 1), rows, through)
    return d_edges.view_as(edges), d_W_e


message_mlp.register_autograd(_gradients, setup_context=_save_blocks)


class _SumAndEdges(torch.autograd.Function):
    """:func:`message_mlp`'s node sums and its edges again, for a later use of them, whose gradient of the
    edges then reaches this backward pass: the kernel adds it to the one it writes."""

    @staticmethod
    def forward(ctx, *inputs: Tensor | None) -> tuple[Tensor, Tensor]:  # noqa: ANN001
        ctx.set_materialize_grads(False)  # no later use: no gradient to add
        ctx.save_for_backward(*inputs)
        edges = inputs[0]
        return message_mlp(*inputs), edges.view_as(edges)

    @staticmethod
    def backward(ctx, d_out: Tensor, d_edges: Tensor | None) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        return _gradients(ctx, d_out, d_edges)


@torch.library.custom_op("dpo_inv::edge_update", mutates_args=())
def normed_edge_messages(
    edges: Tensor,
    nodes: Tensor,
    table: Tensor,
    index: Tensor,
    W2: Tensor,
    b2: Tensor,
    W3: Tensor,
    b3: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    keep: bool,
    W_e: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`edge_update` on blocks from :func:`_blocks` (``residual`` None: the edges): the normalised
    edges ``[R, K, H]``; with ``keep`` the sums ``[R, K, H]`` and their means and reciprocal deviations
    ``[R, K, 1]`` (fp32) for the backward pass, else empty tensors."""
    out, *kept = _normed_outputs(edges, keep)
    norm = (edges if residual is None else residual, norm_weight, norm_bias)
    norm += tuple(kept) if keep else ()
    _forward(edges, nodes, table, index, None, None, None, W2, b2, W3, b3, W_e, out, norm, eps)
    return out, *kept


def _normed_outputs(edges: Tensor, keep: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`normed_edge_messages`' outputs, unwritten: those kept for the backward pass empty without
    ``keep``."""
    if not keep:
        return edges.new_empty(edges.shape), *(edges.new_empty(0) for _ in range(3))
    statistics = (edges.new_empty((*edges.shape[:2], 1), dtype=torch.float32) for _ in range(2))
    return edges.new_empty(edges.shape), edges.new_empty(edges.shape), *statistics


@normed_edge_messages.register_fake
def _(
    edges, nodes, table, index, W2, b2, W3, b3, residual, norm_weight, norm_bias, eps, keep, W_e=None
) -> tuple:  # noqa: ANN001
    return _normed_outputs(edges, keep)


def _save_normed(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    ctx.set_materialize_grads(False)  # the kept outputs take no gradient: none to fill with zeros
    *blocks, eps, keep, W_e = inputs
    ctx.save_for_backward(*blocks, W_e, *output[1:])


def _normed_gradients(ctx, d_out: Tensor, *unused: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    """The layer norm's backward pass on the sums the kernel kept, then the edge update's kernel on the
    gradient of the sums, which is also the residual's (where the residual is the edges, summed with theirs
    in the product that takes it through the edge block)."""
    edges, nodes, table, index, W2, b2, W3, b3, residual, norm_weight, norm_bias, W_e, *kept = (
        ctx.saved_tensors
    )
    sums, mean, rstd = kept
    if sums.device.type == "cpu":  # a CPU's layer norm reads them in its weight's dtype, CUDA's in fp32
        mean, rstd = mean.to(norm_weight.dtype), rstd.to(norm_weight.dtype)
    d_sums, d_norm_weight, d_norm_bias = torch.ops.aten.native_layer_norm_backward(
        d_out, sums, sums.shape[-1:], mean, rstd, norm_weight, norm_bias, [True, True, True]
    )
    d_edges, d_nodes, d_table, _, d_W2, d_b2, d_W3, d_b3, d_W_e = message_mlp_backward(
        d_sums, edges, nodes, table, index, None, None, None, W2, b2, W3, b3, W_e
    )
    d_residual = None if residual is None else d_sums.to(residual.dtype)
    d_edges, d_W_e = _edge_gradients(d_edges, d_W_e, edges, W_e, d_sums if residual is None else None)
    return (
        d_edges, d_nodes, d_table.to(table.dtype), None, d_W2, d_b2, d_W3, d_b3,
        d_residual, d_norm_weight, d_norm_bias, None, None, d_W_e,
    )  # fmt: skip


normed_edge_messages.register_autograd(_normed_gradients, setup_context=_save_normed)


def embedded_rbf(
    D_first: Tensor,
    atoms: Tensor,
    rows: Tensor | None,
    pairs: Tensor,
    centres: Tensor,
    sigma: float,
    classes: Tensor | None,
    table: Tensor | None,
    W: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
) -> Tensor:
    """An edge embedding and its layer norm in one kernel, ``out[b, i, k] = layer_norm(W rbf[b, i, k] +
    table[classes[b, i, k]])``, where ``rbf`` are the edge's distance features (``[(1 + P) * C]``, not
    written): ``exp(-((D - centres[c]) / sigma)^2)`` (exponents clamped at -87), where ``D`` is ``D_first [B,
    L, K]`` for ``p = 0`` and, for ``p >= 1``, the distance between atom ``pairs[0, p - 1]`` of node ``i`` and
    atom ``pairs[1, p - 1]`` of its neighbour, the row ``rows[b * L + i, k]`` of the flattened ``atoms [B, L,
    A, 3]``. ``W [H, (1 + P) * C]``, ``table [T, H]``; the layer norm's ``norm_weight``, ``norm_bias [H]``
    and ``eps``. The full-backbone model's edges: 24 pairs of backbone atoms and the positional encodings;
    LigandMPNN's atom edges: their distances alone (no pairs, ``rows``, ``classes`` or ``table``). The
    features are rounded to the autocast dtype, as the plain path's linear map rounds them, and so is the
    embedding the layer norm reads; the output is written in it: ``[B, L, K, H]``. The backward pass
    recomputes the embedding and its statistics for the layer norm's gradients, and the features for
    ``W``'s."""
    device = atoms.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else atoms.dtype
    B, L, A, _ = atoms.shape
    flat = (
        D_first.float().flatten(),
        atoms.float().reshape(B * L, A * 3),
        None if rows is None else rows.flatten(),
        pairs,
        centres.float(),
        None if classes is None else classes.flatten(),
        None if table is None else table.to(dtype),
        W.to(dtype),
        norm_weight,
        norm_bias,
    )
    flat = (None if x is None else x.contiguous() for x in flat)
    return rbf_embedding(*flat, sigma, eps).view(*D_first.shape, -1)


@torch.library.custom_op("dpo_inv::rbf_embedding", mutates_args=())
def rbf_embedding(
    D_first: Tensor,
    atoms: Tensor,
    rows: Tensor | None,
    pairs: Tensor,
    centres: Tensor,
    classes: Tensor | None,
    table: Tensor | None,
    W: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    sigma: float,
    eps: float,
) -> Tensor:
    """:func:`embedded_rbf` on flat inputs (those of :func:`rbf_features`, and ``classes [E]``): ``[E, H]``
    in ``W``'s dtype."""
    E = D_first.shape[0]
    out = W.new_empty(E, W.shape[0])
    _embedding_kernel[(triton.cdiv(E, _EMBEDDING_EDGES),)](
        *_embedding_arguments(D_first, atoms, rows, pairs, centres, classes, table, W), norm_weight,
        norm_bias, out, **_embedding_constants(D_first, atoms, pairs, centres, table, W, sigma, eps),
        num_warps=_EMBEDDING_WARPS,
    )  # fmt: skip
    return out


@rbf_embedding.register_fake
def _(D_first, atoms, rows, pairs, centres, classes, table, W, norm_weight, norm_bias, sigma, eps) -> Tensor:  # noqa: ANN001
    return W.new_empty((D_first.shape[0], W.shape[0]))


def _embedding_arguments(
    D_first: Tensor,
    atoms: Tensor,
    rows: Tensor | None,
    pairs: Tensor,
    centres: Tensor,
    classes: Tensor | None,
    table: Tensor | None,
    W: Tensor,
) -> tuple:
    """The embedding kernels' first arguments: the features', the classes', the table's and ``W``'s."""
    return (
        *_pointers(D_first, atoms, rows), pairs[0].contiguous(), pairs[1].contiguous(), centres,
        *_pointers(D_first, classes, table)[1:], W.to(_dot_dtype(W.dtype)), D_first.shape[0],
        D_first.shape[0] // atoms.shape[0],
    )  # fmt: skip


def _embedding_constants(
    D_first: Tensor, atoms: Tensor, pairs: Tensor, centres: Tensor, table: Tensor | None, W: Tensor,
    sigma: float, eps: float,
) -> dict:  # fmt: skip
    """The embedding kernels' compile-time constants."""
    return {
        "A": atoms.shape[1] // 3, "P": pairs.shape[1], "C": centres.shape[0], "H": W.shape[0], "SIGMA": sigma,
        "EPS": eps, "HAS_TABLE": table is not None, "PAIRS": _embedding_pairs(pairs.shape[1]),
        "BLOCK_E": _EMBEDDING_EDGES, "DOT_DTYPE": _TL_DTYPE[_dot_dtype(W.dtype)],
        "X_DTYPE": _TL_DTYPE[W.dtype],
    }  # fmt: skip


@torch.library.custom_op("dpo_inv::rbf_embedding_backward", mutates_args=())
def rbf_embedding_backward(
    d_out: Tensor,
    D_first: Tensor,
    atoms: Tensor,
    rows: Tensor | None,
    pairs: Tensor,
    centres: Tensor,
    classes: Tensor | None,
    table: Tensor | None,
    W: Tensor,
    norm_weight: Tensor,
    sigma: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer norm's backward pass of :func:`rbf_embedding` on the embedding it recomputes: the gradient
    of the embedding ``[E, H]`` in ``d_out``'s dtype, those of the norm's weight and bias ``[2, H]`` (fp32)
    and ``W``'s in its dtype. Where the kernel takes ``W``'s itself (:func:`_weight_gradient_in_kernel`) the
    embedding's is empty, not written; else ``W``'s is empty, for a product with the recomputed features."""
    E, H = d_out.shape
    in_kernel = _weight_gradient_in_kernel(pairs.shape[1], table is not None)
    d_embedding = d_out.new_empty(0) if in_kernel else torch.empty_like(d_out)
    constants = _embedding_constants(D_first, atoms, pairs, centres, table, W, sigma, eps)
    constants["BLOCK_E"] = _backward_edges(pairs.shape[1], table is not None)
    programs = triton.cdiv(E, constants["BLOCK_E"])
    if in_kernel:  # persistent programs, each summing W's gradient over its blocks
        programs = min(programs, _num_programs(d_out.device))
    d_norm = d_out.new_empty((programs, 2, H), dtype=torch.float32)  # each program's sums
    d_W = d_out.new_empty((programs, *W.shape) if in_kernel else (0,), dtype=torch.float32)
    _embedding_backward_kernel[(programs,)](
        *_embedding_arguments(D_first, atoms, rows, pairs, centres, classes, table, W), norm_weight, d_out,
        d_embedding, d_norm, d_W, W_GRADIENT=in_kernel, num_warps=_EMBEDDING_WARPS, **constants,
    )  # fmt: skip
    return d_embedding, d_norm.sum(0), d_W.sum(0).to(W.dtype) if in_kernel else W.new_empty(0)


@rbf_embedding_backward.register_fake
def _(d_out, D_first, atoms, rows, pairs, centres, classes, table, W, norm_weight, sigma, eps) -> tuple:  # noqa: ANN001
    in_kernel = _weight_gradient_in_kernel(pairs.shape[1], table is not None)
    d_embedding = d_out.new_empty(0) if in_kernel else torch.empty_like(d_out)
    d_norm = d_out.new_empty((2, d_out.shape[1]), dtype=torch.float32)
    return d_embedding, d_norm, torch.empty_like(W) if in_kernel else W.new_empty(0)


def _weight_gradient_in_kernel(pairs: int, has_table: bool) -> bool:
    """Whether the layer norm's backward kernel takes ``W``'s gradient itself, summing it over its edges in
    registers: where the features of the distances and ``pairs`` pairs of atoms are one tile
    (:func:`_embedding_pairs`; LigandMPNN's atom edges: 16 features) and no table needs the embedding's
    gradient, which the kernel then does not write."""
    return not has_table and pairs < _EMBEDDING_PAIRS


def _backward_edges(pairs: int, has_table: bool) -> int:
    """Edges per block of the layer norm's backward kernel."""
    return _SUMMING_EDGES if _weight_gradient_in_kernel(pairs, has_table) else _EMBEDDING_EDGES


def _embedding_pairs(pairs: int) -> int:
    """How many of the features' ``1 + pairs`` distances the embedding's kernels take at a time."""
    return min(_EMBEDDING_PAIRS, triton.next_power_of_2(pairs + 1))


def _save_embedding(ctx, inputs: tuple, output: Tensor) -> None:  # noqa: ANN001
    *features, classes, table, W, norm_weight, norm_bias, sigma, eps = inputs
    ctx.save_for_backward(*features, classes, table, W, norm_weight)
    ctx.sigma, ctx.eps = sigma, eps


def _embedding_gradients(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    """The layer norm's gradients from the kernel that recomputes the embedding, and ``W``'s where it takes
    them; else ``table``'s as an embedding's and ``W``'s as a linear map's, from the features recomputed."""
    *features, classes, table, W, norm_weight = ctx.saved_tensors
    d_embedding, d_norm, d_W = rbf_embedding_backward(
        d_out.contiguous(), *features, classes, table, W, norm_weight, ctx.sigma, ctx.eps
    )
    d_table = None
    if table is not None and ctx.needs_input_grad[6]:
        d_table = torch.ops.aten.embedding_dense_backward(d_embedding, classes, table.shape[0], -1, False)
    if not ctx.needs_input_grad[7]:
        d_W = None
    elif not _weight_gradient_in_kernel(features[3].shape[1], table is not None):
        d_W = d_embedding.T @ rbf_features(*features, ctx.sigma, d_out.dtype)
    d_norm_weight, d_norm_bias = d_norm.to(norm_weight.dtype).unbind(0)
    return None, None, None, None, None, None, d_table, d_W, d_norm_weight, d_norm_bias, None, None


rbf_embedding.register_autograd(_embedding_gradients, setup_context=_save_embedding)


@torch.library.custom_op("dpo_inv::rbf_features", mutates_args=())
def rbf_features(
    D_first: Tensor,
    atoms: Tensor,
    rows: Tensor | None,
    pairs: Tensor,
    centres: Tensor,
    sigma: float,
    dtype: torch.dtype,
) -> Tensor:
    """The distance features of :func:`embedded_rbf`, written in ``dtype``, on flat inputs: ``D_first [E]``,
    ``atoms [R, A * 3]``, the neighbour's row ``rows [E]`` of each edge (edge ``e`` is one of row ``e // (E /
    R)``; None without pairs), ``pairs [2, P]``: ``[E, (1 + P) * C]``."""
    E, P, C = D_first.shape[0], pairs.shape[1], centres.shape[0]
    out = torch.empty(E, (1 + P) * C, device=atoms.device, dtype=dtype)
    _rbf_kernel[(triton.cdiv(E, _RBF_EDGES),)](
        *_pointers(D_first, atoms, rows), pairs[0].contiguous(), pairs[1].contiguous(), centres, out,
        E, E // atoms.shape[0], A=atoms.shape[1] // 3, P=P, P_BLOCK=triton.next_power_of_2(P + 1), C=C,
        SIGMA=sigma, BLOCK_E=_RBF_EDGES,
    )  # fmt: skip
    return out


@rbf_features.register_fake
def _(D_first, atoms, rows, pairs, centres, sigma, dtype) -> Tensor:  # noqa: ANN001
    return atoms.new_empty((D_first.shape[0], (1 + pairs.shape[1]) * centres.shape[0]), dtype=dtype)


@functools.cache
def _num_programs(device: torch.device) -> int:
    """Programs of the backward kernel: a few per multiprocessor, each summing its weight gradients; two
    under the interpreter."""
    if device.type != "cuda":
        return 2
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _configs(*shapes: tuple[int, int, int, int]) -> list:
    """Autotuned launch settings: (rows per program, edges per row at a time, warps, pipeline stages); a row
    is a node and sequence in the forward kernel, a node with its sequences in turn in the backward one.
    Under the interpreter, which runs each operation of a program in Python, one tile of 64 rows: few
    programs to interpret, and still loops over edges 16 at a time and (backward) over several tiles."""
    if INTERPRET:
        shapes = ((64, 16, 4, 1),)
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, k, warps, stages in shapes
    ]


_RBF_EDGES = 256 if INTERPRET else 16  # edges per program of the distance features' kernel (interpreted: few)
_EMBEDDING_EDGES = 256 if INTERPRET else 64  # and of the edge embedding's: a warpgroup's product, 64 rows
_SUMMING_EDGES = 256 if INTERPRET else 32  # and of its norm's backward kernel where it sums W's gradient (on
# sm_90 128 registers a thread, two programs a multiprocessor; at 64 edges, 255 and spilled)
_EMBEDDING_PAIRS = 4  # pairs of atoms whose features the edge embedding's kernel multiplies at a time
_EMBEDDING_WARPS = 8  # on 4, its layer norm's backward kernel spills (sm_90)

# each kernel is tuned once per form (flags, sequences per structure, neighbours) and dtype
_TUNED_BY = ["K", "N", *_OPTIONAL, "EDGE_OUT", "DOT_DTYPE"]

if triton is not None:
    _TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _gelu(x):
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(x):
        return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327

    @triton.jit
    def _dot(a, b, DOT_DTYPE: tl.constexpr):
        if tl.float32 == DOT_DTYPE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))

    @triton.jit
    def _square(ptr, H: tl.constexpr, TRANSPOSE: tl.constexpr):
        """An [H, H] matrix (transposed: ``out[i, o] = W[o, i]``)."""
        h = tl.arange(0, H)
        if TRANSPOSE:
            return tl.load(ptr + h[None, :] * H + h[:, None])
        return tl.load(ptr + h[:, None] * H + h[None, :])

    @triton.jit
    def _edge_states(
        edges, index, m, k0, M, K, N: tl.constexpr, H: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_INDEX: tl.constexpr,
    ):  # fmt: skip
        """The states ``[BLOCK_M, BLOCK_K, H]`` of the edges ``k0 + j`` of the rows ``m`` (node ``m // N``,
        sequence ``m % N``; those from ``M`` on absent), the edges' rows in ``edges``, which exist and (with
        ``HAS_INDEX``) their neighbours' rows in ``index`` (else their own) ``[BLOCK_M, BLOCK_K]``."""
        k = k0 + tl.arange(0, BLOCK_K)
        h = tl.arange(0, H)
        valid = (m < M)[:, None] & (k < K)[None, :]
        edge = (m // N).to(tl.int64)[:, None] * K + k[None, :]
        states = tl.load(edges + edge[:, :, None] * H + h[None, None, :], mask=valid[:, :, None], other=0.0)
        neighbour = edge
        if HAS_INDEX:
            neighbour = tl.load(index + edge, mask=valid, other=0)
        return states, edge, valid, neighbour

    @triton.jit
    def _pre(
        states, edge, valid, shared_row, nodes, table, scale, weight, shared, W_e, m, M,
        N: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_TABLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SHARED: tl.constexpr,
        HAS_EDGE_WEIGHT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """``pre [BLOCK_M, BLOCK_K, H]`` (fp32) of the rows ``m`` and their edges, from :func:`_edge_states`
        (``shared_row``: the neighbours' rows in ``shared``); the weight of each message ``[BLOCK_M,
        BLOCK_K]`` (0 where none); the neighbours' rows in ``table``. With ``HAS_EDGE_WEIGHT`` the edges'
        block is ``W_e`` (an ``[H, H]`` matrix) times their states."""
        h = tl.arange(0, H)
        n = m % N
        pre = states
        if HAS_EDGE_WEIGHT:  # as the products of the MLP: the matrix times the transposed edge rows
            rows = tl.trans(tl.reshape(states, [BLOCK_M * BLOCK_K, H]))
            pre = tl.reshape(tl.trans(_dot(W_e, rows, DOT_DTYPE)), [BLOCK_M, BLOCK_K, H])
        node = tl.load(nodes + m.to(tl.int64)[:, None] * H + h[None, :], mask=(m < M)[:, None], other=0.0)
        pre = pre.to(tl.float32) + node.to(tl.float32)[:, None, :]
        row = edge
        if HAS_SHARED:
            at = shared + shared_row[:, :, None] * H + h[None, None, :]
            pre += tl.load(at, mask=valid[:, :, None], other=0.0).to(tl.float32)
        if HAS_TABLE:
            row = shared_row * N + n[:, None]
            neighbour = tl.load(
                table + row[:, :, None] * H + h[None, None, :], mask=valid[:, :, None], other=0.0
            )
            neighbour = neighbour.to(tl.float32)
            if HAS_SCALE:
                neighbour *= tl.load(scale + edge * N + n[:, None], mask=valid, other=0.0)[:, :, None]
            pre += neighbour
        factor = valid.to(tl.float32)
        if HAS_WEIGHT:
            factor *= tl.load(weight + edge * N + n[:, None], mask=valid, other=0.0)
        return pre, factor, row

    @triton.autotune(
        # on sm_90 (Triton 3.9) only the decoder's form spills, 40 and 16 bytes a thread at (4, 16, 4, 2) and
        # (2, 32, 4, 2), and the atom context layers', 36 at (4, 16, 4, 2); (8, 16, 8, 2) spills 140 bytes in
        # the residue context layers' form and takes up to 226 KB of shared memory: left out
        _configs((4, 16, 8, 2), (2, 16, 4, 2), (4, 16, 4, 2), (2, 16, 8, 2), (2, 32, 4, 2), (4, 32, 8, 2)),
        key=[*_TUNED_BY, "NORM"],  # one tuning for the edge update with and without KEEP
    )
    @triton.jit(do_not_specialize=["M"])
    def _forward_kernel(
        edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e, out,
        residual, norm_weight, norm_bias, sums, means, rstds, eps, M, K,
        N: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_TABLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SHARED: tl.constexpr,
        HAS_EDGE_WEIGHT: tl.constexpr, EDGE_OUT: tl.constexpr, NORM: tl.constexpr, KEEP: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        m0 = tl.program_id(0) * BLOCK_M
        m = m0 + tl.arange(0, BLOCK_M)
        h = tl.arange(0, H)
        W2n = _square(W2, H, False)
        W_en = W2n
        if HAS_EDGE_WEIGHT:
            W_en = _square(W_e, H, False)
        if EDGE_OUT:
            W3n = _square(W3, H, False)
        bias2 = tl.load(b2 + h).to(tl.float32)
        if EDGE_OUT:
            bias3 = tl.load(b3 + h).to(tl.float32)
        if NORM:
            gamma = tl.load(norm_weight + h).to(tl.float32)
            beta = tl.load(norm_bias + h).to(tl.float32)
        acc = tl.zeros([BLOCK_M, H], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            states, edge, valid, shared_row = _edge_states(
                edges, index, m, k0, M, K, N, H, BLOCK_K, HAS_TABLE or HAS_SHARED
            )
            pre, factor, row = _pre(
                states, edge, valid, shared_row, nodes, table, scale, weight, shared, W_en, m, M, N, H,
                BLOCK_M, BLOCK_K, HAS_TABLE, HAS_SCALE, HAS_WEIGHT, HAS_SHARED, HAS_EDGE_WEIGHT, DOT_DTYPE,
            )  # fmt: skip
            # products as weights x transposed edge rows ([H, H] x [H, rows]): on Hopper each is one
            # warpgroup MMA that reads the weights from shared memory
            hidden = tl.reshape(_gelu(pre), [BLOCK_M * BLOCK_K, H])
            hidden = _gelu(_dot(W2n, tl.trans(hidden), DOT_DTYPE) + bias2[:, None])
            if EDGE_OUT:
                message = tl.trans(_dot(W3n, hidden, DOT_DTYPE)) + bias3[None, :]
                message = tl.reshape(message, [BLOCK_M, BLOCK_K, H])
                at = edge[:, :, None] * H + h[None, None, :]
                if NORM:  # the residual sum and its layer norm, rounded as the plain layer rounds them
                    message = message.to(out.dtype.element_ty).to(tl.float32)
                    x = message + tl.load(residual + at, mask=valid[:, :, None], other=0.0).to(tl.float32)
                    x = x.to(out.dtype.element_ty).to(tl.float32)
                    mean = tl.sum(x, axis=2) / H
                    centred = x - mean[:, :, None]
                    rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, axis=2) / H + eps)
                    message = centred * rstd[:, :, None] * gamma[None, None, :] + beta[None, None, :]
                    if KEEP:
                        tl.store(sums + at, x.to(sums.dtype.element_ty), mask=valid[:, :, None])
                        tl.store(means + edge, mean, mask=valid)
                        tl.store(rstds + edge, rstd, mask=valid)
                tl.store(out + at, message.to(out.dtype.element_ty), mask=valid[:, :, None])
            else:
                hidden = tl.reshape(tl.trans(hidden), [BLOCK_M, BLOCK_K, H])
                acc += tl.sum(hidden * factor[:, :, None], axis=1)
        if not EDGE_OUT:
            tl.store(out + m.to(tl.int64)[:, None] * H + h[None, :], acc.to(out.dtype.element_ty),
                     mask=(m < M)[:, None])  # fmt: skip

    @triton.autotune(
        # per-thread spills on sm_90 (`scripts/fused_check.py --compile_only`, Triton 3.9): none for
        # (1, 16, 8, 2) but the decoder's 48 bytes, outside its loops; none to 116 bytes for (1, 16, 8, 3);
        # none to 512 for (2, 16, 8, 2) and (1, 32, 8, 2); 0.2-1.4 KB for (4, 16, 8, 2) and (2, 32, 8, 2);
        # tiles on 4 warps, and of 8 x 16 edges, spill 0.7-4.6 KB, most of it in the loops, and are left out
        _configs((1, 16, 8, 2), (1, 16, 8, 3), (2, 16, 8, 2), (1, 32, 8, 2), (4, 16, 8, 2), (2, 32, 8, 2)),
        key=[*_TUNED_BY, "EDGE_GRADIENTS"],
        reset_to_zero=["d_table", "d_shared"],
    )
    @triton.jit(do_not_specialize=["R"])
    def _backward_kernel(
        edges, nodes, table, index, scale, weight, shared, W2, b2, W3, b3, W_e,
        d_out, added, d_edges, d_nodes, d_table, d_shared, d_weights, d_biases, R, K,
        N: tl.constexpr, N_BLOCK: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
        HAS_SHARED: tl.constexpr, HAS_EDGE_WEIGHT: tl.constexpr, EDGE_OUT: tl.constexpr,
        EDGE_GRADIENTS: tl.constexpr, HAS_ADDED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """Each program takes ``BLOCK_M`` nodes at a time and ``BLOCK_K`` of their edges, and the ``N``
        sequences of those edges in turn (``N_BLOCK``: N to a power of two): it sums the edge block's
        gradient over the sequences in registers and writes the edges' gradient once, in their dtype (with
        ``HAS_ADDED`` and ``EDGE_GRADIENTS``, plus ``added``: their gradient from a later use)."""
        pid = tl.program_id(0)
        h = tl.arange(0, H)
        s = tl.arange(0, N_BLOCK)  # the sequences of a node
        W2n = _square(W2, H, False)
        W2t = _square(W2, H, True)
        W_en = W2n
        if HAS_EDGE_WEIGHT:
            W_en = _square(W_e, H, False)
        if EDGE_OUT:
            W3t = _square(W3, H, True)
        if EDGE_GRADIENTS:
            W_et = _square(W_e, H, True)
            d_W_e = tl.zeros([H, H], dtype=tl.float32)
        bias2 = tl.load(b2 + h).to(tl.float32)
        d_W2 = tl.zeros([H, H], dtype=tl.float32)
        d_b2 = tl.zeros([H], dtype=tl.float32)
        if EDGE_OUT:
            d_W3 = tl.zeros([H, H], dtype=tl.float32)
            d_b3 = tl.zeros([H], dtype=tl.float32)
        for block in range(pid, tl.cdiv(R, BLOCK_M), tl.num_programs(0)):
            r = block * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = (r.to(tl.int64)[:, None] * N + s[None, :])[:, :, None] * H + h[None, None, :]
            present = ((r < R)[:, None] & (s < N)[None, :])[:, :, None]  # [BLOCK_M, N_BLOCK, 1]
            d_node = tl.zeros([BLOCK_M, N_BLOCK, H], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                # the edge block's gradient summed over the sequences, from -0.0: with one sequence the
                # sum is the one gradient, as the compiler sees (x + -0.0 is x)
                d_block = tl.full([BLOCK_M, BLOCK_K, H], -0.0, dtype=tl.float32)
                states, edge, valid, shared_row = _edge_states(
                    edges, index, r * N, k0, R * N, K, N, H, BLOCK_K, HAS_TABLE or HAS_SHARED
                )
                for n in range(N):
                    pre, factor, row = _pre(
                        states, edge, valid, shared_row, nodes, table, scale, weight, shared, W_en, r * N + n,
                        R * N, N, H, BLOCK_M, BLOCK_K, HAS_TABLE, HAS_SCALE, HAS_WEIGHT, HAS_SHARED,
                        HAS_EDGE_WEIGHT, DOT_DTYPE,
                    )  # fmt: skip
                    on = factor > 0
                    this = (s == n)[None, :, None]
                    # products as weights x transposed edge rows, as in the forward kernel
                    hidden1 = tl.reshape(_gelu(pre), [BLOCK_M * BLOCK_K, H])
                    z2 = _dot(W2n, tl.trans(hidden1), DOT_DTYPE) + bias2[:, None]
                    if EDGE_OUT:
                        at_out = d_out + edge[:, :, None] * H + h[None, None, :]
                        d_message = tl.load(at_out, mask=valid[:, :, None], other=0.0).to(tl.float32)
                        d_message = tl.trans(tl.reshape(d_message, [BLOCK_M * BLOCK_K, H]))
                        hidden2 = _gelu(z2)
                        d_W3 += _dot(d_message, tl.trans(hidden2), DOT_DTYPE)
                        d_b3 += tl.sum(d_message, axis=1)
                        d_hidden2 = _dot(W3t, d_message, DOT_DTYPE)
                    else:
                        at_sum = d_out + (r.to(tl.int64) * N + n)[:, None] * H + h[None, :]
                        d_sum = tl.load(at_sum, mask=(r < R)[:, None], other=0.0).to(tl.float32)
                        d_hidden2 = tl.trans(
                            tl.reshape(d_sum[:, None, :] * factor[:, :, None], [BLOCK_M * BLOCK_K, H])
                        )
                    d_z2 = d_hidden2 * _gelu_grad(z2)  # [H, rows], as z2
                    d_W2 += _dot(d_z2, hidden1, DOT_DTYPE)
                    d_b2 += tl.sum(d_z2, axis=1)
                    d_hidden1 = tl.trans(_dot(W2t, d_z2, DOT_DTYPE))
                    d_pre = tl.reshape(d_hidden1, [BLOCK_M, BLOCK_K, H]) * _gelu_grad(pre)
                    d_node += tl.where(this, tl.sum(d_pre, axis=1)[:, None, :], 0.0)
                    d_block += d_pre
                    if HAS_TABLE:
                        d_neighbour = d_pre
                        if HAS_SCALE:
                            at = edge * N + n
                            d_neighbour *= tl.load(scale + at, mask=on, other=0.0)[:, :, None]
                        tl.atomic_add(
                            d_table + row[:, :, None] * H + h[None, None, :], d_neighbour, mask=on[:, :, None]
                        )
                if HAS_SHARED:  # the structure's neighbours' block: the same for every sequence
                    at_shared = d_shared + shared_row[:, :, None] * H + h[None, None, :]
                    tl.atomic_add(at_shared, d_block, mask=valid[:, :, None])
                # the edges' gradient: the block's, or through W_e as its linear map's backward pass
                # (transposed as the products above), with W_e's, and a later use's added (HAS_ADDED) to
                # the product's transposed tile, where the kernel spills less than when adding after it
                at_edges = edge[:, :, None] * H + h[None, None, :]
                d_edge = d_block
                if EDGE_GRADIENTS:
                    d_rows = tl.trans(tl.reshape(d_block, [BLOCK_M * BLOCK_K, H]))
                    d_W_e += _dot(d_rows, tl.reshape(states, [BLOCK_M * BLOCK_K, H]), DOT_DTYPE)
                    d_edge_t = _dot(W_et, d_rows, DOT_DTYPE)
                    if HAS_ADDED:
                        at_t = tl.trans(tl.reshape(at_edges, [BLOCK_M * BLOCK_K, H]))
                        on = tl.broadcast_to(valid[:, :, None], [BLOCK_M, BLOCK_K, H])
                        on_t = tl.trans(tl.reshape(on, [BLOCK_M * BLOCK_K, H]))
                        d_edge_t += tl.load(added + at_t, mask=on_t, other=0.0).to(tl.float32)
                    d_edge = tl.reshape(tl.trans(d_edge_t), [BLOCK_M, BLOCK_K, H])
                tl.store(d_edges + at_edges, d_edge.to(d_edges.dtype.element_ty), mask=valid[:, :, None])
            tl.store(d_nodes + rows, d_node.to(d_nodes.dtype.element_ty), mask=present)
        square = h[:, None] * H + h[None, :]
        weights = 2 if EDGE_OUT or EDGE_GRADIENTS else 1  # W2's, then W3's or W_e's
        biases = 2 if EDGE_OUT else 1
        tl.store(d_weights + pid * weights * H * H + square, d_W2)
        tl.store(d_biases + pid * biases * H + h, d_b2)
        if EDGE_OUT:
            tl.store(d_weights + (pid * weights + 1) * H * H + square, d_W3)
            tl.store(d_biases + (pid * biases + 1) * H + h, d_b3)
        if EDGE_GRADIENTS:
            tl.store(d_weights + (pid * weights + 1) * H * H + square, d_W_e)

    @triton.jit
    def _rbf_values(
        atoms, centre_atom, neighbour_atom, centre, neighbour, first, edge_on, p, mu,
        A: tl.constexpr, P: tl.constexpr, SIGMA: tl.constexpr, BLOCK_E: tl.constexpr, PAIRS: tl.constexpr,
    ):  # fmt: skip
        """The distance features ``[BLOCK_E, PAIRS, C]`` of the edges from the rows ``centre`` to the rows
        ``neighbour`` of ``atoms`` (those not ``edge_on`` absent) for the pairs ``p`` of atoms: for ``p = 0``
        of the distances ``first``, for ``p >= 1`` of atom ``centre_atom[p - 1]`` of the centre to atom
        ``neighbour_atom[p - 1]`` of the neighbour; zero for ``p > P``. ``mu``: the ``C`` centres."""
        pair_on = (p >= 1) & (p <= P)
        a = tl.load(centre_atom + p - 1, mask=pair_on, other=0)
        b = tl.load(neighbour_atom + p - 1, mask=pair_on, other=0)
        on = edge_on[:, None] & pair_on[None, :]
        squared = tl.zeros([BLOCK_E, PAIRS], dtype=tl.float32)
        for x in tl.static_range(3):  # the plain path's sum over x, y, z, in order
            here = tl.load(atoms + centre[:, None] * (A * 3) + a[None, :] * 3 + x, mask=on, other=0.0)
            there = tl.load(atoms + neighbour[:, None] * (A * 3) + b[None, :] * 3 + x, mask=on, other=0.0)
            squared += (here - there) * (here - there)
        D = tl.where(p[None, :] == 0, first[:, None], tl.sqrt_rn(squared + 1e-6))
        z = tl.math.div_rn(D[:, :, None] - mu[None, None, :], SIGMA)
        return tl.where((p <= P)[None, :, None], tl.exp(tl.maximum(-(z * z), -87.0)), 0.0)

    @triton.jit
    def _rbf_kernel(
        D_first, atoms, rows, centre_atom, neighbour_atom, centres, out, E, K,
        A: tl.constexpr, P: tl.constexpr, P_BLOCK: tl.constexpr, C: tl.constexpr, SIGMA: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        p = tl.arange(0, P_BLOCK)
        c = tl.arange(0, C)
        edge_on = e < E
        centre = (e // K).to(tl.int64)
        neighbour = _neighbour_rows(rows, e, edge_on, centre, P)
        first = tl.load(D_first + e, mask=edge_on, other=0.0)
        values = _rbf_values(
            atoms, centre_atom, neighbour_atom, centre, neighbour, first, edge_on, p, tl.load(centres + c),
            A, P, SIGMA, BLOCK_E, P_BLOCK,
        )  # fmt: skip
        at = out + e.to(tl.int64)[:, None, None] * ((P + 1) * C) + p[None, :, None] * C + c[None, None, :]
        tl.store(at, values.to(out.dtype.element_ty), mask=(edge_on[:, None] & (p <= P)[None, :])[:, :, None])

    @triton.jit
    def _neighbour_rows(rows, e, edge_on, centre, P: tl.constexpr):
        """The rows of the edges' neighbours in ``atoms``; without pairs of atoms, unused (none read)."""
        neighbour = centre
        if P > 0:
            neighbour = tl.load(rows + e, mask=edge_on, other=0)
        return neighbour

    @triton.jit
    def _normalised_embedding(
        D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K, pid,
        A: tl.constexpr, P: tl.constexpr, C: tl.constexpr, H: tl.constexpr, SIGMA: tl.constexpr,
        EPS: tl.constexpr, HAS_TABLE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_E: tl.constexpr,
        DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """The embedding of program ``pid``'s edges: the features of ``PAIRS`` pairs of atoms at a time, as
        :func:`_rbf_kernel` computes them, multiplied by their columns of ``W`` as they are computed, plus
        the classes' rows of ``table``, rounded to ``X_DTYPE`` (``W``'s); normalised ``[BLOCK_E, H]`` (fp32)
        with the reciprocal deviations ``[BLOCK_E]``, the edges and which exist."""
        e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        i = tl.arange(0, PAIRS)
        h = tl.arange(0, H)
        edge_on = e < E
        centre = (e // K).to(tl.int64)
        neighbour = _neighbour_rows(rows, e, edge_on, centre, P)
        first = tl.load(D_first + e, mask=edge_on, other=0.0)
        mu = tl.load(centres + tl.arange(0, C))
        acc = tl.zeros([BLOCK_E, H], dtype=tl.float32)
        for p0 in tl.static_range(0, P + 1, PAIRS):
            values = _rbf_values(
                atoms, centre_atom, neighbour_atom, centre, neighbour, first, edge_on, p0 + i, mu,
                A, P, SIGMA, BLOCK_E, PAIRS,
            )  # fmt: skip
            values = tl.reshape(values.to(X_DTYPE), [BLOCK_E, PAIRS * C])
            f = p0 * C + tl.arange(0, PAIRS * C)
            columns = tl.load(
                W + h[None, :] * ((P + 1) * C) + f[:, None], mask=(f < (P + 1) * C)[:, None], other=0.0
            )
            acc += _dot(values, columns, DOT_DTYPE)
        if HAS_TABLE:
            encoding = table + tl.load(classes + e, mask=edge_on, other=0)[:, None] * H + h[None, :]
            acc += tl.load(encoding, mask=edge_on[:, None], other=0.0).to(tl.float32)
        x = acc.to(X_DTYPE).to(tl.float32)
        centred = x - (tl.sum(x, 1) / H)[:, None]
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, 1) / H + EPS)
        return centred * rstd[:, None], rstd, e, edge_on

    @triton.jit
    def _embedding_kernel(
        D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K, norm_weight,
        norm_bias, out, A: tl.constexpr, P: tl.constexpr, C: tl.constexpr, H: tl.constexpr,
        SIGMA: tl.constexpr, EPS: tl.constexpr, HAS_TABLE: tl.constexpr, PAIRS: tl.constexpr,
        BLOCK_E: tl.constexpr, DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """:func:`rbf_embedding`: the normalised embedding times the norm's weight, plus its bias."""
        normalised, _, e, edge_on = _normalised_embedding(
            D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K,
            tl.program_id(0), A, P, C, H, SIGMA, EPS, HAS_TABLE, PAIRS, BLOCK_E, DOT_DTYPE, X_DTYPE,
        )  # fmt: skip
        h = tl.arange(0, H)
        y = normalised * tl.load(norm_weight + h).to(tl.float32) + tl.load(norm_bias + h).to(tl.float32)
        at = out + e.to(tl.int64)[:, None] * H + h[None, :]
        tl.store(at, y.to(out.dtype.element_ty), mask=edge_on[:, None])

    @triton.jit
    def _norm_backward(
        D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K, norm_weight,
        d_out, block, A: tl.constexpr, P: tl.constexpr, C: tl.constexpr, H: tl.constexpr, SIGMA: tl.constexpr,
        EPS: tl.constexpr, HAS_TABLE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_E: tl.constexpr,
        DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """The layer norm's backward pass on the recomputed embedding of a block of edges: the embedding's
        gradient ``[BLOCK_E, H]`` (rounded to ``X_DTYPE``), the edges' sums of the norm's weight's and bias's
        gradients ``[H]``, the edges and which exist."""
        normalised, rstd, e, edge_on = _normalised_embedding(
            D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K, block,
            A, P, C, H, SIGMA, EPS, HAS_TABLE, PAIRS, BLOCK_E, DOT_DTYPE, X_DTYPE,
        )  # fmt: skip
        h = tl.arange(0, H)
        dy = tl.load(d_out + e.to(tl.int64)[:, None] * H + h[None, :], mask=edge_on[:, None], other=0.0)
        dy = dy.to(tl.float32)
        g = dy * tl.load(norm_weight + h).to(tl.float32)
        g_mean, g_projection = tl.sum(g, 1) / H, tl.sum(g * normalised, 1) / H
        dx = rstd[:, None] * (g - g_mean[:, None] - normalised * g_projection[:, None])
        return dx.to(X_DTYPE), tl.sum(dy * normalised, 0), tl.sum(dy, 0), e, edge_on

    @triton.jit
    def _embedding_backward_kernel(
        D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K, norm_weight,
        d_out, d_embedding, d_norm, d_W, A: tl.constexpr, P: tl.constexpr, C: tl.constexpr, H: tl.constexpr,
        SIGMA: tl.constexpr, EPS: tl.constexpr, HAS_TABLE: tl.constexpr, PAIRS: tl.constexpr,
        BLOCK_E: tl.constexpr, DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, W_GRADIENT: tl.constexpr,
    ):  # fmt: skip
        """:func:`rbf_embedding_backward`: the layer norm's backward pass on the recomputed embedding. Each
        program writes the embedding's gradient of its block of edges and the block's sums of the norm's
        weight's and bias's gradients; with ``W_GRADIENT`` it takes every ``num_programs``-th block from its
        own instead, and writes its sums of those and of ``W``'s (the features of the ``PAIRS`` pairs of
        atoms, recomputed, times the embedding's gradient)."""
        pid = tl.program_id(0)
        h = tl.arange(0, H)
        if W_GRADIENT:
            i = tl.arange(0, PAIRS)
            f = tl.arange(0, PAIRS * C)
            mu = tl.load(centres + tl.arange(0, C))
            d_weight = tl.zeros([H], dtype=tl.float32)
            d_bias = tl.zeros([H], dtype=tl.float32)
            d_columns = tl.zeros([H, PAIRS * C], dtype=tl.float32)
            for block in range(pid, tl.cdiv(E, BLOCK_E), tl.num_programs(0)):
                dx, d_weight_block, d_bias_block, e, edge_on = _norm_backward(
                    D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K,
                    norm_weight, d_out, block, A, P, C, H, SIGMA, EPS, HAS_TABLE, PAIRS, BLOCK_E, DOT_DTYPE,
                    X_DTYPE,
                )  # fmt: skip
                d_weight += d_weight_block
                d_bias += d_bias_block
                centre = (e // K).to(tl.int64)  # the features again, as the plain path's product reads them
                neighbour = _neighbour_rows(rows, e, edge_on, centre, P)
                first = tl.load(D_first + e, mask=edge_on, other=0.0)
                values = _rbf_values(
                    atoms, centre_atom, neighbour_atom, centre, neighbour, first, edge_on, i, mu,
                    A, P, SIGMA, BLOCK_E, PAIRS,
                )  # fmt: skip
                values = tl.reshape(values.to(X_DTYPE), [BLOCK_E, PAIRS * C])
                d_columns += _dot(tl.trans(dx), values, DOT_DTYPE)
            at = d_W + pid * H * ((P + 1) * C) + h[:, None] * ((P + 1) * C) + f[None, :]
            tl.store(at, d_columns, mask=(f < (P + 1) * C)[None, :])
        else:
            dx, d_weight, d_bias, e, edge_on = _norm_backward(
                D_first, atoms, rows, centre_atom, neighbour_atom, centres, classes, table, W, E, K,
                norm_weight, d_out, pid, A, P, C, H, SIGMA, EPS, HAS_TABLE, PAIRS, BLOCK_E, DOT_DTYPE,
                X_DTYPE,
            )  # fmt: skip
            at = d_embedding + e.to(tl.int64)[:, None] * H + h[None, :]
            tl.store(at, dx.to(d_embedding.dtype.element_ty), mask=edge_on[:, None])
        tl.store(d_norm + pid * 2 * H + h, d_weight)
        tl.store(d_norm + (pid * 2 + 1) * H + h, d_bias)
