"""The bytes a DPO step moves per pair, counted operator by operator, for the step of now and of before: the
table of docs/benchmarks.md, "Bytes a step moves". No GPU needed.

    python scripts/bytes_table.py            # 29 rows, about 55 minutes on two CPU cores

Each row is one `scripts/benchmark.py` process (one warm-up micro-batch of 2 structures of 150 residues,
or for LigandMPNN's rows 2 of the ligand example's first pairs, of 1BC8: 93 residues with 406 context
atoms; whose operators it counts: `megabytes_moved_per_pair`), with CUDA's autocast policy for layer norms
(fp32) emulated on the CPU, and the fused kernels run by Triton's interpreter. "Before" rows put back what the
step of before did: `nn.LayerNorm` for the edges' layer norms, the distance features in plain PyTorch, the
backward kernel's gradients of the edges written in fp32 (and then rounded), the decoder's structure blocks
gathered and added before its kernel, the edge update's residual and layer norm after its kernel, the edges'
blocks of the first linear maps applied before the kernels, the edges' and their blocks' weights' gradients
taken from the blocks' after the backward kernels (and the edge update's residual's added to its edges'),
the edge update's kernel's gradient of the edges written in fp32, the decoder's kernel's summed over its
sequences with fp32 atomic adds (and then rounded), the distance features written by their kernel and the
edge embedding applied after it, the encoder layers' two gradients of their edges summed by autograd;
LigandMPNN's atom layers' edge blocks applied before their kernels, their two gradients of the atom edges
summed by autograd, the atom edges' embedding in plain PyTorch and its atoms' one-hot element features built
in int64, concatenated and cast; the edges' embeddings written by their kernel, then normalised by their
layer norms; the atom edges' `y_edges` gradient taken by a product after the norm's backward kernel, from
the embedding's gradient it wrote and the features recomputed.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

import dpo_inv.models.features as features
import dpo_inv.models.fused as fused
import dpo_inv.models.layers as layers

ROOT = Path(__file__).resolve().parents[1]
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s of HBM
MEASURED_H100 = {  # pairs/s at batch 128, length 150 (docs/benchmarks.md, "On a GPU")
    "fp32": 503, "bf16, plain layers, before": 748, "bf16, fused message MLPs, before": 695,
    "fp32, precomputed reference": 658, "bf16, plain, precomputed reference, before": 997,
    "bf16, fused, precomputed reference, before": 789,
}  # fmt: skip
FP32, BF16 = "--mixed_precision no", "--mixed_precision bf16"
FUSED, PRE = "--fused_kernels true", "--precompute_ref_log_probs"
# what the step of before did, which its rows put back (count): nn.LayerNorm for the edges, the plain distance
# features, the kernels' edge gradients in fp32, the decoder's structure blocks gathered and added before it,
# the edge update's residual and layer norm after its kernel, the edge blocks applied before the kernels, the
# edges' gradients through W_e taken after the backward kernels, and the residual's added after, the edge
# update's edge gradients in fp32, the decoder's summed over its sequences in fp32 by atomic adds, the edge
# embedding applied to the distance features after their kernel wrote them, the encoder layers' node sums
# not passing their edges on (autograd adds the edge update's gradient of them to theirs), the edges'
# embeddings normalised after their kernel, the atom edges' weight gradient by a product after the norm's
# backward kernel
CHANGES = (
    "norms",
    "features",
    "gradients",
    "structure",
    "epilogue",
    "edge blocks",
    "edge gradients",
    "edge update",
    "decoder sums",
    "embedding",
    "edges passed",
    "embedding norm",
    "atom weight gradient",
)  # in the order they were made
BEFORE = frozenset(CHANGES)


def from_on(change: str) -> frozenset[str]:
    """What a row of the step made before ``change`` puts back: that change and those after it."""
    return frozenset(CHANGES[CHANGES.index(change) :])


# row: (options, what it puts back)
ROWS = {
    "fp32": (FP32, set()),
    "bf16, plain layers, before": (BF16, {"norms"}),
    "bf16, plain layers, the edges' layer norms in bf16": (BF16, set()),
    "bf16, fused message MLPs, before": (f"{BF16} {FUSED}", BEFORE),
    "bf16, fused, the edges' layer norms in bf16": (f"{BF16} {FUSED}", from_on("features")),
    "bf16, fused, and the distance features' kernel": (f"{BF16} {FUSED}", from_on("gradients")),
    "bf16, fused, and the edges' gradients in bf16": (
        f"{BF16} {FUSED}",
        from_on("structure"),
    ),
    "bf16, fused, and the decoder's neighbours gathered in its kernel": (
        f"{BF16} {FUSED}",
        from_on("epilogue"),
    ),
    "bf16, fused, and the edge update's residual and layer norm in its kernel": (
        f"{BF16} {FUSED}",
        from_on("edge blocks"),
    ),
    "bf16, fused, and the edge blocks applied in the kernels": (
        f"{BF16} {FUSED}",
        from_on("edge gradients"),
    ),
    "bf16, fused, and the edges' gradients through the edge blocks in the kernels": (
        f"{BF16} {FUSED}",
        from_on("edge update"),
    ),
    "bf16, fused, and the edge update's edge gradients in bf16": (
        f"{BF16} {FUSED}",
        from_on("decoder sums"),
    ),
    "bf16, fused, and the decoder's edge gradients summed in its kernel": (
        f"{BF16} {FUSED}",
        from_on("embedding"),
    ),
    "bf16, fused, and the edge embedding in the distance features' kernel": (
        f"{BF16} {FUSED}",
        from_on("edges passed"),
    ),
    "bf16, fused, and the encoder's edge gradients summed in its kernels": (
        f"{BF16} {FUSED}",
        from_on("embedding norm"),
    ),
    "bf16, fused, and the edge embedding's layer norm in its kernel": (f"{BF16} {FUSED}", set()),
    "fp32, precomputed reference": (f"{FP32} {PRE}", set()),
    "bf16, plain, precomputed reference, before": (f"{BF16} {PRE}", {"norms"}),
    "bf16, plain, precomputed reference": (f"{BF16} {PRE}", set()),
    "bf16, fused, precomputed reference, before": (f"{BF16} {PRE} {FUSED}", BEFORE),
    "bf16, fused, precomputed reference, before the encoder's edge gradients summed in its kernels": (
        f"{BF16} {PRE} {FUSED}",
        from_on("edges passed"),
    ),
    "bf16, fused, precomputed reference, before the edge embedding's layer norm in its kernel": (
        f"{BF16} {PRE} {FUSED}",
        from_on("embedding norm"),
    ),
    "bf16, fused, precomputed reference": (f"{BF16} {PRE} {FUSED}", set()),
    "LigandMPNN, fp32": (FP32, set()),
    "LigandMPNN, bf16, plain layers": (BF16, set()),
    "LigandMPNN, bf16, fused, before": (
        f"{BF16} {FUSED}",
        {"atom layers", "one-hots"} | from_on("embedding norm"),
    ),
    "LigandMPNN, bf16, fused, before the edge embeddings' layer norms in their kernel": (
        f"{BF16} {FUSED}",
        from_on("embedding norm"),
    ),
    "LigandMPNN, bf16, fused, before the atom edges' weight gradient in the norm's backward kernel": (
        f"{BF16} {FUSED}",
        from_on("atom weight gradient"),
    ),
    "LigandMPNN, bf16, fused": (f"{BF16} {FUSED}", set()),
}
BENCHMARK = "--batch_sizes 2 --steps 1 --warmup 1 --work_dir outputs/bytes_table"
PROTEIN = "--lengths 150"
LIGAND = "--train_file data/ligand/train.jsonl --num_pairs 4 --model_name_or_path ligand/v_32_010_25"  # 1BC8


def fp32_gradients_out(edges: torch.Tensor, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel's outputs of before: the edges' gradient in fp32 (zeros where it summed them over
    the sequences with atomic adds)."""
    fill = torch.empty if nodes.shape[1] == 1 else torch.zeros
    return fill(edges.shape, dtype=torch.float32), torch.empty_like(nodes)


@torch.library.custom_op("bytes_table::rbf_embedding", mutates_args=())
def unnormalised_embedding(
    D_first: torch.Tensor,
    atoms: torch.Tensor,
    rows: torch.Tensor | None,
    pairs: torch.Tensor,
    centres: torch.Tensor,
    classes: torch.Tensor | None,
    table: torch.Tensor | None,
    W: torch.Tensor,
    sigma: float,
) -> torch.Tensor:
    """The edge embedding's kernel of before, one operator without the layer norm: ``fused.rbf_embedding``'s
    inputs but the norm's, its output ``[E, H]`` unnormalised (computed here by the features' kernel and a
    product: one operator all the same)."""
    embedded = fused.rbf_features(D_first, atoms, rows, pairs, centres, sigma, W.dtype) @ W.T
    return embedded if table is None else embedded + table[classes]


def _unnormalised_gradients(ctx, d_out: torch.Tensor) -> tuple:  # noqa: ANN001
    """The gradients of before: ``table``'s as an embedding's, ``W``'s from the features recomputed."""
    *features_in, classes = ctx.saved_tensors
    d_table = None
    if ctx.num_classes is not None:
        d_table = torch.ops.aten.embedding_dense_backward(d_out, classes, ctx.num_classes, -1, False)
    d_W = d_out.T @ fused.rbf_features(*features_in, ctx.sigma, d_out.dtype)
    return None, None, None, None, None, None, d_table, d_W, None


def _save_unnormalised(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    *features_in, classes, table, W, sigma = inputs
    ctx.save_for_backward(*features_in, classes)
    ctx.sigma, ctx.num_classes = sigma, None if table is None else table.shape[0]


unnormalised_embedding.register_autograd(_unnormalised_gradients, setup_context=_save_unnormalised)


def count(row: str) -> None:
    """In this process: the benchmark of one row."""
    options, put_back = ROWS[row]
    if "structure" in put_back:
        message_sum = fused.message_sum

        def added_before(edges, nodes, W2, b2, table=None, index=None, scale=None, weight=None, shared=None):  # noqa: ANN001, ANN202
            if shared is not None:  # the layer's gather and add, as it did them
                edges = edges + shared[index]
            return message_sum(edges, nodes, W2, b2, table, index, scale, weight)

        fused.message_sum = added_before
    if "decoder sums" in put_back:  # first: "edge update" keeps the rule it finds for the other kernels
        in_dtype = fused._gradients_out
        fused._gradients_out = lambda edges, nodes: (
            in_dtype(edges, nodes) if nodes.shape[1] == 1 else fp32_gradients_out(edges, nodes)
        )
    if "gradients" in put_back:
        fused._gradients_out = fp32_gradients_out
    if "edge update" in put_back:  # its kernel wrote the edges' gradient in fp32, rounded after
        backward, gradients_out = fused.message_mlp_backward, fused._gradients_out

        def in_fp32(d_out, edges, nodes, table, index, scale, weight, shared, W2, b2, W3, *rest):  # noqa: ANN001, ANN002, ANN202
            fused._gradients_out = gradients_out if W3 is None else fp32_gradients_out  # W3: the edge update
            return backward(d_out, edges, nodes, table, index, scale, weight, shared, W2, b2, W3, *rest)

        fused.message_mlp_backward = in_fp32
    if "epilogue" in put_back:  # the messages written, then added and normalised by the layer's norm
        norm = layers.AutocastLayerNorm(128)

        def normalised_after(*args, W_e=None):  # noqa: ANN001, ANN002, ANN202
            *mlp, residual, weight, bias, eps = args
            summed = residual + fused.edge_messages(*mlp, W_e=W_e)
            return functional_call(norm, {"weight": weight, "bias": bias}, (summed,))

        fused.edge_update = normalised_after
    if "norms" in put_back:
        layers.AutocastLayerNorm.forward = torch.nn.LayerNorm.forward
    embedded_rbf = features._embedded_rbf
    if "features" in put_back:
        features._embedded_rbf = lambda D, atoms, E_idx, pairs, embedding, norm, fuse: embedded_rbf(
            D, atoms, E_idx, pairs, embedding, norm, False
        )
    elif "embedding" in put_back:  # the features written in bf16 by their kernel, the edge embedding after

        def embedded_after(D, atoms, E_idx, pairs, embedding, norm, fuse):  # noqa: ANN001, ANN202
            if not (fuse and fused.available(D)):
                return embedded_rbf(D, atoms, E_idx, pairs, embedding, norm, fuse)
            B, L, A, _ = atoms.shape
            flat = (D.flatten(), atoms.reshape(B * L, A * 3), layers.flat_neighbors(E_idx).flatten(), pairs)
            centres = features._rbf_centres(atoms.device)
            rbf = fused.rbf_features(*flat, centres, features._RBF_SIGMA, torch.get_autocast_dtype("cpu"))
            return norm(features._embedded(rbf.view(*D.shape, -1), *embedding))

        features._embedded_rbf = embedded_after
    if "embedding norm" in put_back:  # the embedding's kernel wrote the embedding, its layer norm after

        def normalised_after(*inputs_norm_sigma_eps):  # noqa: ANN002, ANN202
            *inputs, norm_weight, norm_bias, sigma, eps = inputs_norm_sigma_eps
            embedded = unnormalised_embedding(*inputs, sigma)
            with torch.autocast("cpu", enabled=False):  # as AutocastLayerNorm
                return F.layer_norm(embedded, embedded.shape[-1:], norm_weight, norm_bias, eps)

        fused.rbf_embedding = normalised_after
    if "atom weight gradient" in put_back:  # the embedding's gradient written, y_edges' by a product after
        fused._weight_gradient_in_kernel = lambda pairs, has_table: False
    if "edge gradients" in put_back:  # the blocks' gradients written, the edges' and W_e's by matrix products
        fused._edge_gradients_in_kernel = lambda edge_out, edge_weight: False
        edge_gradients = fused._edge_gradients

        def added_after(d_edges, d_W_e, edges, W_e, added=None):  # noqa: ANN001, ANN202
            d_edges, d_W_e = edge_gradients(d_edges, d_W_e, edges, W_e)  # the residual's: added after
            return d_edges if added is None else d_edges + added, d_W_e

        fused._edge_gradients = added_after
    if "atom layers" in put_back:  # LigandMPNN's: W_e applied before the kernel, the atom edges not passed on
        sum_and_edges = fused.message_sum_and_edges

        def atom_layers_before(edges, *args, table=None, W_e=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if table is not None:  # the encoder's node messages
                return sum_and_edges(edges, *args, table=table, W_e=W_e, **kwargs)
            return fused.message_sum(F.linear(edges, W_e), *args, **kwargs), edges

        fused.message_sum_and_edges = atom_layers_before
        features.LigandFeatures._atom_edges = lambda self, D, Y: self.norm_y_edges(
            self.y_edges(features._rbf(D))
        )
    if "one-hots" in put_back:  # LigandMPNN's atoms' element, group and period one-hot in int64, then cast

        def integer_one_hots(self, element):  # noqa: ANN001, ANN202
            group, period = self.groups_and_periods[element].unbind(-1)
            sizes = (features._NUM_ELEMENTS, features._NUM_GROUPS, features._NUM_PERIODS)
            hots = [F.one_hot(x, n) for x, n in zip((element, group, period), sizes, strict=True)]
            return torch.cat(hots, -1).to(self.type_linear.weight.dtype)

        features.LigandFeatures._element_one_hot = integer_one_hots
    if "edges passed" in put_back:  # the edges used twice by each encoder layer: autograd adds the gradients
        fused.message_sum_and_edges = lambda edges, *args, **kwargs: (
            fused.message_sum(edges, *args, **kwargs),
            edges,
        )
    if "edge blocks" in put_back:  # W_e applied to the edges by a linear map, its output read by the kernel
        for name in ("message_sum", "edge_messages", "edge_update"):
            fused_op = getattr(fused, name)

            def applied_before(edges, *args, W_e=None, fused_op=fused_op, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                return fused_op(edges if W_e is None else F.linear(edges, W_e), *args, **kwargs)

            setattr(fused, name, applied_before)
    data = LIGAND if row.startswith("LigandMPNN") else PROTEIN
    sys.argv = ["benchmark.py", *BENCHMARK.split(), *data.split(), *options.split()]
    with layers.cuda_layer_norm_policy():
        runpy.run_path(str(ROOT / "scripts" / "benchmark.py"), run_name="__main__")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        count(sys.argv[2])
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    print("| step | MB per pair | of which the features | bound H100 / H200, pairs/s | measured on an H100 |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        command = [sys.executable, "-W", "ignore", __file__, "--row", row]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        moved = json.loads(result.stdout.strip().splitlines()[-1])["megabytes_moved_per_pair"]
        per_pair = moved["total"] - moved["metrics_clipping_optimizer"]
        of_features = moved["features_forward"] + moved["features_backward"]
        bounds = [bandwidth / (per_pair * 1e6) for bandwidth in BANDWIDTH.values()]
        measured = MEASURED_H100.get(row)
        share = f"{measured} ({measured / bounds[0]:.0%} of the bound)" if measured else ""
        bound = f"{bounds[0]:,.0f} / {bounds[1]:,.0f}"
        print(f"| {row} | {per_pair:,.0f} | {of_features:,.0f} | {bound} | {share} |", flush=True)


if __name__ == "__main__":
    main()
