"""The fused message-MLP kernels against the plain layers they replace, on the CPU under Triton's interpreter;
and compiled for a GPU by Triton's own compiler.

The kernels run on CUDA GPUs; here `test_fused_kernels_under_the_interpreter` runs the other tests of this
file in a process with TRITON_INTERPRET=1, where the layers take the fused path on the CPU, and
`test_the_kernels_compile_for_an_h100_on_a_machine_without_one` builds them for sm_90 as a GPU would.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dpo_inv.data.batches import collate, structure_inputs
from dpo_inv.data.design import prepare_design
from dpo_inv.models import fused
from dpo_inv.models.features import _embedded_rbf, _neighbor_rbf, virtual_cb
from dpo_inv.models.layers import use_fused_kernels
from dpo_inv.models.mpnn import decoding_ranks
from dpo_inv.models.weights import load_model, model_parse_options
from dpo_inv.structures.parse import parse_structure

interpreted = pytest.mark.skipif(
    not fused.INTERPRET, reason="run under Triton's interpreter by test_fused_kernels_under_the_interpreter"
)
H = 128
STRUCTURES = Path(__file__).resolve().parents[1] / "data" / "structures"


@pytest.mark.slow
@pytest.mark.skipif(fused.triton is None, reason="Triton is not installed")
@pytest.mark.skipif(fused.INTERPRET, reason="this process is the interpreter's")
def test_fused_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    others = ["-k", "not test_fused_kernels_under_the_interpreter and not test_the_kernels_compile"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *others]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(fused.triton is None, reason="Triton is not installed")
@pytest.mark.skipif(fused.INTERPRET, reason="this process is the interpreter's")
def test_the_kernels_compile_for_an_h100_on_a_machine_without_one():
    """Triton's compiler and ptxas, not the interpreter, build the kernels for sm_90, as a GPU would at its
    first step: the message MLPs' in the decoder's form (gathered neighbours scaled by visibility, two
    sequences) and the encoder's edge update (per-edge messages through W3), the distance features', the
    edge embedding's with its layer norm and the norm's backward kernel, within the shared memory a
    multiprocessor has, and (the message MLPs') at one tile of 16 edges on 8 warps with no spilled register
    read or written in a loop (the backward kernel's products read the weights from shared memory: held in
    registers, they spilled 120 and 620 bytes a thread, in the loops). The decoder's backward kernel, which
    sums the edges' gradient over its sequences in registers, spills a few values it keeps for its end,
    before its loops (at most 64 bytes a thread); no other kernel spills."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "fused_check.py"
    command = [sys.executable, str(script), "--compile_only", "--forms", "decoder", "edge update", "--config",
               "1,16,8,2"]  # fmt: skip
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "forward",
        "forward",
        "backward",
        "backward",
        "rbf",
        "embedding",
        "norm_back",
        "rbf",
        "embedding",
        "norm_back",
    ], lines
    for line in lines:
        pattern = r"shared (\d+) KB, (\d+) registers, (\d+) bytes spilled, (\d+) spill accesses"
        found = re.search(pattern, line)
        shared, registers, spilled, in_loops = (int(x) for x in found.groups())
        assert shared <= 227 and 0 < registers <= 255 and spilled <= 64 and in_loops == 0, line
        assert shared > 0 or line.split()[:3] == ["rbf", "atom", "edges"], line  # the one without a product
        assert spilled == 0 or line.startswith("backward decoder"), line


@interpreted
def test_the_device_checks_warm_up_runs_each_form_with_each_config_alone():
    """`fused_check.py --warm_cache`, which `scripts/gpu_check.sh` runs first so that each autotuned config is
    compiled side by side, not one by one inside a timed process: each of ProteinMPNN's forms runs forward
    and backward in a process of its own per config, the config alone (the interpreter's one here)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "fused_check.py"
    forms = ["decoder", "encoder", "edge update"]
    shape = ["--structures", "1", "--length", "20"]
    command = [sys.executable, str(script), "--warm_cache", "--forms", *forms, *shape]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    tile = "BLOCK_M 64, BLOCK_K 16, 4 warps, 1 stages"
    assert result.stdout == f"warm: decoder, encoder, edge update: forward {tile}, backward {tile}\n"


@pytest.fixture(autouse=True)
def vectorised_erf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter computes erf element by element in Python (math.erf), most of the interpreted
    kernels' time: torch's erf instead, on the whole array."""
    if fused.INTERPRET:
        from triton.runtime import interpreter

        for name in ("np_erf_fp32", "np_erf_fp64"):
            monkeypatch.setattr(interpreter, name, lambda x: torch.erf(torch.from_numpy(x)).numpy())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def plain_mlp(pre: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(F.gelu(pre), W2, b2))


def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape)).requires_grad_()


@interpreted
@pytest.mark.parametrize(
    "form",
    [
        "decoder",
        "decoder, three sequences",
        "encoder",
        "context, 25 entries",
        "context, 25 entries, the edge block in the kernel",
        "edge update",
        "edge update, normed",
    ],
)
def test_kernels_equal_the_plain_computation_and_its_gradients(form: str):
    """Every form the layers use, values and gradients in fp32; K not a multiple of the kernels' block, and
    an odd number of sequences per structure (not a power of two: the backward kernel's sum over them). The
    edges' block ``W_e h_E`` computed in the kernel (the encoder's and decoder's forms, LigandMPNN's atom
    context layers') or given (its residue context layers', whose entries are 2H wide). The decoder's
    neighbours' blocks: the visible one scaled per sequence (``table``), the structure's shared by all
    sequences (``shared``). The edge update also with its residual (the edges) and layer norm in the kernel,
    as the layer calls it without dropout."""
    torch.manual_seed(0)
    R, T = 7, 11
    K = 25 if "context" in form else 20
    N = 3 if "three" in form else 2 if form == "decoder" else 1
    edges, nodes, table, shared = leaf(R, K, H), leaf(R, N, H), leaf(T, N, H), leaf(T, H)
    W2, b2, W3, b3, W_e = (
        leaf(H, H, scale=0.1),
        leaf(H),
        leaf(H, H, scale=0.1),
        leaf(H),
        leaf(H, H, scale=0.1),
    )
    index = torch.randint(0, T, (R, K))
    seen = (torch.rand(R, K, N) > 0.5).float()
    pre = F.linear(edges, W_e)[:, :, None] + nodes[:, None]
    leaves = [edges, nodes, table, W2, b2, W_e]
    if form.startswith("decoder"):
        out = fused.message_sum(
            edges, nodes, W2, b2, table=table, index=index, scale=seen, shared=shared, W_e=W_e
        )
        expected = plain_mlp(pre + seen[..., None] * table[index] + shared[index][:, :, None], W2, b2).sum(1)
        leaves.append(shared)
    elif form == "encoder":
        out = fused.message_sum(edges, nodes, W2, b2, table=table, index=index, weight=seen, W_e=W_e)
        expected = (plain_mlp(pre + table[index], W2, b2) * seen[..., None]).sum(1)
    elif form.endswith("in the kernel"):
        out = fused.message_sum(edges, nodes, W2, b2, weight=seen, W_e=W_e)
        expected = (plain_mlp(pre, W2, b2) * seen[..., None]).sum(1)
        leaves = [edges, nodes, W2, b2, W_e]
    elif form.startswith("context"):
        out = fused.message_sum(edges, nodes, W2, b2, weight=seen)
        expected = (plain_mlp(edges[:, :, None] + nodes[:, None], W2, b2) * seen[..., None]).sum(1)
        leaves = [edges, nodes, W2, b2]
    elif form == "edge update":
        out = fused.edge_messages(edges, nodes[:, 0], table[:, 0], index, W2, b2, W3, b3, W_e=W_e)
        expected = F.linear(plain_mlp((pre + table[index])[:, :, 0], W2, b2), W3, b3)
        leaves += [W3, b3]
    else:
        norm = (1.0 + leaf(H, scale=0.1), leaf(H, scale=0.1))
        blocks = (edges, nodes[:, 0], table[:, 0], index, W2, b2, W3, b3, edges, *norm, 1e-5)
        out = fused.edge_update(*blocks, W_e=W_e)
        with torch.no_grad():  # the reference's forward pass, which keeps nothing for a backward one
            assert torch.equal(fused.edge_update(*blocks, W_e=W_e), out)
        messages = F.linear(plain_mlp((pre + table[index])[:, :, 0], W2, b2), W3, b3)
        expected = F.layer_norm(edges + messages, (H,), *norm)
        leaves += [W3, b3, *norm]
    assert out.shape == expected.shape
    assert relative(out, expected) < 1e-6
    grad = torch.randn_like(expected)
    for got, want in zip(
        torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, leaves, grad), strict=True
    ):
        assert relative(got, want) < 1e-5


@interpreted
@pytest.mark.parametrize(
    "form", ["decoder", "edge update", "edge update, normed", "edge update, normed, the edges its residual"]
)
def test_the_kernels_are_operators_that_autograd_and_the_compiler_take_whole(form: str):
    """Each kernel is one operator (`dpo_inv::message_mlp`, its backward `dpo_inv::message_mlp_backward`;
    the edge update with its layer norm `dpo_inv::edge_update`, its residual another tensor or, as the
    layers call it, the edges): `torch.library.opcheck` checks its schema, shapes without running it (fake
    tensors), autograd and AOT dispatch; a compiled function that calls it is one graph, without a break,
    and gives eager's values and gradients."""
    torch.manual_seed(0)
    R, K, T, N = 5, 20, 9, 2 if form == "decoder" else 1
    edges, nodes, table, shared = leaf(R, K, H), leaf(R, N, H), leaf(T, N, H), leaf(T, H)
    W2, b2, W3, b3 = leaf(H, H, scale=0.1), leaf(H), leaf(H, H, scale=0.1), leaf(H)
    index = torch.randint(0, T, (R, K))
    seen = (torch.rand(R, K, N) > 0.5).float()
    op, W_e = fused.message_mlp, leaf(H, H, scale=0.1)
    if form == "decoder":
        args = (edges, nodes, table, index, seen, None, shared, W2, b2, None, None, W_e)
    elif form == "edge update":
        args = (edges, nodes, table, index, None, None, None, W2, b2, W3, b3)
    else:
        residual = None if "residual" in form else leaf(R, K, H)
        op, norm = fused.normed_edge_messages, (residual, 1.0 + leaf(H, scale=0.1), leaf(H, scale=0.1))
        args = (edges, nodes, table, index, W2, b2, W3, b3, *norm, 1e-5, True, W_e)
    torch.library.opcheck(op, args)

    def loss(*args: torch.Tensor | None) -> torch.Tensor:
        out = op(*args)
        return (out if op is fused.message_mlp else out[0]).square().sum()

    assert torch._dynamo.explain(loss)(*args).graph_break_count == 0
    leaves = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
    want = torch.autograd.grad(loss(*args), leaves)
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*args), leaves)
    for a, b in zip(got, want, strict=True):
        assert relative(a, b) < 1e-6


@interpreted
def test_the_backward_kernel_writes_the_edges_gradient_once_in_their_dtype():
    """With bf16 blocks, the backward kernel writes the edges' gradient once in bf16, with one sequence per
    structure (the encoder's two MLPs and the context layers') and with two (the decoder's, summed over them
    in the kernel); the gradients autograd returns are in the blocks' dtype, within bf16 rounding of the
    fp32 ones. With the edge block's weight ``W_e``, the node sums' kernel computes the edges' gradient
    through it and ``W_e``'s itself; the edge update's writes the block's, from which autograd takes both."""
    torch.manual_seed(0)
    R, K, T = 3, 16, 5
    W2, b2, W3, b3 = (0.1 * torch.randn(H, H), torch.randn(H), 0.1 * torch.randn(H, H), torch.randn(H))
    index = torch.randint(0, T, (R, K))
    for N, edge_out, W_e in (
        (1, False, None),
        (2, False, None),
        (1, True, None),
        (1, False, leaf(H, H, scale=0.1)),
        (2, False, leaf(H, H, scale=0.1)),
        (1, True, leaf(H, H, scale=0.1)),
    ):
        blocks = [torch.randn(R, K, H), torch.randn(R, N, H), torch.randn(T, N, H)]
        weights = (W2, b2, W3, b3, W_e) if edge_out else (W2, b2, None, None, W_e)
        low = [x.bfloat16().requires_grad_() for x in blocks]
        out = fused.message_mlp(*low, index, None, None, None, *weights)
        d_out = torch.randn_like(out)
        gradients = fused.message_mlp_backward(d_out, *low, index, None, None, None, *weights)
        assert gradients[0].dtype == torch.bfloat16
        assert gradients[-1].shape == ((H, H) if W_e is not None and not edge_out else (0,))
        learnt = [] if W_e is None else [W_e]
        leaves = [*low, *learnt]
        got = torch.autograd.grad(out, leaves, d_out)
        high = [x.detach().float().requires_grad_() for x in low]
        want = torch.autograd.grad(
            fused.message_mlp(*high, index, None, None, None, *weights), [*high, *learnt], d_out.float()
        )
        for a, b, x in zip(got, want, leaves, strict=True):
            assert a.dtype == x.dtype and relative(a, b) < 2**-7


@interpreted
def test_the_node_sum_passes_its_edges_on_and_adds_their_later_gradient(monkeypatch: pytest.MonkeyPatch):
    """`message_sum_and_edges` (each encoder layer's node messages) returns the edges again for their next
    use (the edge update): autograd then sums no gradients of the edges, the node sum's backward kernel adds
    the later use's to its own. In fp32 the gradients of the plain computation with both uses; in bf16 those
    of `message_sum` with the edges used twice (where autograd adds), within bf16 rounding; an operator
    (`opcheck` of the backward one with the gradient to add) that a compiled function calls without a graph
    break; with the edges in another dtype than the kernel's, the edges themselves."""
    torch.manual_seed(0)
    R, K, T = 5, 20, 9
    W2, b2, W_e = leaf(H, H, scale=0.1), leaf(H), leaf(H, H, scale=0.1)
    later = torch.randn(H, H) / H**0.5  # the later use: a linear map of the edges
    index = torch.randint(0, T, (R, K))
    seen = (torch.rand(R, K, 1) > 0.5).float()

    def loss(edges: torch.Tensor, nodes: torch.Tensor, table: torch.Tensor, passes: bool) -> torch.Tensor:
        blocks = (edges, nodes, W2, b2, table, index)
        if passes:
            out, again = fused.message_sum_and_edges(*blocks, weight=seen, W_e=W_e)
        else:
            out, again = fused.message_sum(*blocks, weight=seen, W_e=W_e), edges
        return out.float().square().sum() + F.linear(again.float(), later).sin().sum()

    edges, nodes, table = leaf(R, K, H), leaf(R, 1, H), leaf(T, 1, H)
    assert torch.equal(fused.message_sum_and_edges(edges, nodes, W2, b2, table, index)[1], edges)
    leaves = [edges, nodes, table, W2, b2, W_e]
    pre = F.linear(edges, W_e)[:, :, None] + nodes[:, None] + table[index]
    plain = (plain_mlp(pre, W2, b2) * seen[..., None]).sum(1).square().sum()
    want = torch.autograd.grad(plain + F.linear(edges, later).sin().sum(), leaves)
    got = torch.autograd.grad(loss(edges, nodes, table, True), leaves)
    for a, b in zip(got, want, strict=True):
        assert relative(a, b) < 1e-5

    low = [x.detach().bfloat16().requires_grad_() for x in (edges, nodes, table)]
    want = torch.autograd.grad(loss(*low, False), low)
    backward = fused.message_mlp_backward
    calls = []

    def spy(*args: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        calls.append(args[-1])
        return backward(*args)

    monkeypatch.setattr(fused, "message_mlp_backward", spy)
    got = torch.autograd.grad(loss(*low, True), low)
    monkeypatch.undo()
    assert len(calls) == 1 and calls[0] is not None and calls[0].dtype == torch.bfloat16
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16 and relative(a, b) < 2**-7

    d_out = torch.randn(R, 1, H)
    blocks = [x.detach() for x in (edges, nodes, table)] + [index, None, seen, None]
    blocks += [x.detach() for x in (W2, b2)] + [None, None, W_e.detach()]
    torch.library.opcheck(backward, (d_out, *blocks, torch.randn(R, K, H)))  # (no double backward)
    args = (edges, nodes, table, True)
    assert torch._dynamo.explain(loss)(*args).graph_break_count == 0
    want = torch.autograd.grad(loss(*args), leaves)
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*args), leaves)
    for a, b in zip(got, want, strict=True):
        assert relative(a, b) < 1e-6

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the kernel reads the fp32 edges cast to bf16
        _, again = fused.message_sum_and_edges(edges, nodes, W2, b2, table, index)
    assert again is edges


@interpreted
def test_the_edge_embedding_kernel_equals_the_plain_features():
    """The edge embedding of a real structure (2xcjA, 84 residues, 48 neighbours) and its layer norm: its 25
    RBF-expanded distances and positional encodings as one kernel that never writes the distances' features
    or the embedding. In fp32 the plain path's values and its weights' and the norm's gradients (to 1e-5;
    the distances' map's recomputes the features with the features' own kernel, whose values are the plain
    ones; the norm's backward kernel the embedding; neither is kept for the backward pass, where the plain
    path keeps both); under bf16 autocast, in bf16 and within bf16 rounding of fp32, and its gradients at
    most twice as far from fp32's as the plain path's under autocast (1-2% for the positional table's, 0.3%
    for the norm's, where a CPU's layer norm sums the plain path's in bf16, 5%); the features' kernel's
    values each within one bf16 unit of the plain ones (a GPU rounds to the nearest, as the linear map's
    cast does; the interpreter truncates). `opcheck` of the three operators."""
    torch.manual_seed(0)
    model = load_model("vanilla/v_48_020").eval()
    batch = designed("vanilla/v_48_020")
    X, mask = batch["X"], batch["mask"]
    features = model.features
    N, Ca, C, O = X.unbind(2)
    atoms = torch.stack((N, Ca, C, O, virtual_cb(X)), dim=2)
    D_neighbors, E_idx = features._dist(Ca, mask)
    learnt = [
        features.edge_embedding.weight,
        features.embeddings.linear.weight,
        features.embeddings.linear.bias,
        features.norm_edges.weight,
        features.norm_edges.bias,
    ]
    d_out = torch.randn(1, 84, 48, H)

    def embedded(fuse: bool) -> tuple[torch.Tensor, ...]:
        embedding = features._edge_embedding_parts(E_idx, batch["residue_idx"], batch["chain_encoding"])
        out = _embedded_rbf(
            D_neighbors, atoms, E_idx, features.atom_pairs, embedding, features.norm_edges, fuse
        )
        return out, *torch.autograd.grad(out, learnt, d_out.to(out.dtype))

    plain, *plain_grads = embedded(False)
    got, *grads = embedded(True)

    def kept(fuse: bool) -> list[int]:
        """The sizes of the tensors autograd keeps for the backward pass."""
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            embedded(fuse)
        return sizes

    # the plain path's: the 84 x 48 edges' 400 features (for the map's gradient), their embedding (the norm's)
    per_edge = {84 * 48 * 400, 84 * 48 * H}
    assert per_edge <= set(kept(False)) and not per_edge & set(kept(True))
    assert plain.shape == got.shape == (1, 84, 48, H) and got.dtype == torch.float32
    assert relative(got, plain) < 1e-6
    for a, b in zip(grads, plain_grads, strict=True):  # the norm's: sums over 4,032 edges in another order
        assert relative(a, b) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, *autocast_grads = embedded(False)
        low, *low_grads = embedded(True)
    assert low.dtype == torch.bfloat16 and relative(low, plain) < 2**-7
    for a, b, want, x in zip(low_grads, autocast_grads, plain_grads, learnt, strict=True):
        assert a.dtype == x.dtype and relative(a, want) <= 2 * relative(b, want)
    centres, rows = torch.linspace(2.0, 22.0, 16), E_idx.flatten()  # one structure: its rows are E_idx
    flat = (D_neighbors.flatten(), atoms.reshape(84, 15), rows, features.atom_pairs, centres)
    rbf = _neighbor_rbf(D_neighbors, atoms, E_idx, features.atom_pairs).view(-1, 400)
    assert relative(fused.rbf_features(*flat, 1.25, torch.float32), rbf) < 1e-6
    rounded = fused.rbf_features(*flat, 1.25, torch.bfloat16)
    assert ((rounded.float() - rbf).abs() <= 2**-7 * rbf.abs()).all()
    torch.library.opcheck(fused.rbf_features, (*flat, 1.25, torch.float32))
    E = 6 * 4  # opcheck runs the operator many times: 6 residues with 4 neighbours each
    few = (
        10 * torch.rand(E),
        40 * torch.rand(6, 15),
        torch.randint(0, 6, (E,)),
        features.atom_pairs,
        centres,
    )
    embedding = (torch.randint(0, 66, (E,)), leaf(66, H), leaf(H, 400, scale=0.05))
    norm = (leaf(H, scale=0.1).detach().add_(1).requires_grad_(), leaf(H, scale=0.1))
    torch.library.opcheck(fused.rbf_embedding, (*few, *embedding, *norm, 1.25, 1e-5))
    # the backward pass's inputs, which take no gradient
    constants = (embedding[0], *(x.detach() for x in (*embedding[1:], norm[0])))
    torch.library.opcheck(fused.rbf_embedding_backward, (torch.randn(E, H), *few, *constants, 1.25, 1e-5))


@interpreted
def test_the_atom_edges_embedding_kernel_equals_the_plain_features():
    """LigandMPNN's atom edges on a real structure (1BC8: each of 93 residues' 25 context atoms, each with
    its 25 fellow atoms): the embedding of their RBF-expanded distances and its layer norm by the same kernel
    as the backbone edges', without pairs of atoms or positional encodings. In fp32 the plain path's values
    and `y_edges`'s and the norm's gradients (to 1e-5), with no features or embedding kept for the backward
    pass, and none written by it: the norm's backward kernel takes `y_edges`'s gradient itself, where the
    plain path writes the features again and the embedding's gradient; under bf16 autocast within bf16
    rounding, the gradients as the first test's; `opcheck` of the three operators without the neighbours'
    rows, the classes and the table."""
    torch.manual_seed(0)
    model = load_model("ligand/v_32_010_25").eval()
    batch = structure_inputs(designed("ligand/v_32_010_25"))
    features = model.features
    X, mask = batch["X"], batch["mask"]
    Y, _, _ = features.nearest_atoms(
        X, mask, batch["context_xyz"], batch["context_element"], batch["context_mask"]
    )
    D = torch.sqrt(torch.sum((Y[:, :, :, None] - Y[:, :, None]) ** 2, -1) + 1e-6)
    learnt = [features.y_edges.weight, features.norm_y_edges.weight, features.norm_y_edges.bias]
    d_out = torch.randn(*D.shape, H)

    def embedded(fuse: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[int], int]:
        """The output, the gradients, the sizes of the tensors kept for the backward pass and of the
        largest one it writes."""
        features.fused = fuse
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            out = features._atom_edges(D, Y)
        d_in = d_out.to(out.dtype)
        with Written() as written:
            grads = torch.autograd.grad(out, learnt, d_in)
        return out, grads, sizes, written.largest

    plain, plain_grads, plain_saved, plain_written = embedded(False)
    got, grads, saved, written = embedded(True)
    # the plain path keeps the features and the embedding; the kernel the distances
    assert {D.numel() * 16, D.numel() * H} <= set(plain_saved) and max(saved) == D.numel()
    assert plain_written == D.numel() * H and written < D.numel()  # a value per edge: [E, H] and [E, 16]
    assert got.shape == plain.shape == (1, 93, 25, 25, H) and got.dtype == torch.float32
    assert relative(got, plain) < 1e-6
    for a, b in zip(grads, plain_grads, strict=True):  # the norm's: sums over 58,125 edges in another order
        assert relative(a, b) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, autocast_grads, _, _ = embedded(False)
        low, low_grads, _, _ = embedded(True)
    assert low.dtype == torch.bfloat16 and relative(low, plain) < 2**-7
    for a, b, want, x in zip(low_grads, autocast_grads, plain_grads, learnt, strict=True):
        assert a.dtype == x.dtype and relative(a, want) <= 2 * relative(b, want)
    E = 6 * 4  # 6 atoms with 4 fellow atoms each
    few = (
        10 * torch.rand(E),
        40 * torch.rand(6, 3),
        None,
        features.atom_pairs[:, :0],
        torch.linspace(2, 22, 16),
    )
    torch.library.opcheck(fused.rbf_features, (*few, 1.25, torch.float32))
    norm = (leaf(H, scale=0.1).detach().add_(1).requires_grad_(), leaf(H, scale=0.1))
    W = leaf(H, 16, scale=0.05)
    torch.library.opcheck(fused.rbf_embedding, (*few, None, None, W, *norm, 1.25, 1e-5))
    constants = (None, None, W.detach(), norm[0].detach())  # the backward pass's, which take no gradient
    torch.library.opcheck(fused.rbf_embedding_backward, (torch.randn(E, H), *few, *constants, 1.25, 1e-5))


def designed(name: str) -> dict[str, torch.Tensor]:
    """A small real structure as the model reads it: 2xcjA (84 residues); for LigandMPNN 1BC8 (93
    residues designed, with its DNA and zinc as context)."""
    options = model_parse_options(name)
    path = STRUCTURES / ("1BC8.pdb.gz" if name.startswith("ligand") else "2xcjA.pdb.gz")
    design = ["C"] if name.startswith("ligand") else ["A"]
    fixed = [chain for chain in parse_structure(path, options) if chain not in design]
    return collate([prepare_design(path, design, fixed, {}, options).example])


class Written(TorchDispatchMode):
    """The size of the largest tensor an operator writes (views of its inputs left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)}
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, x.numel())
        return out


class EdgeGradientSums(TorchDispatchMode):
    """Counts the adds of two tensors shaped as the edges, ``[..., K, H]`` (LigandMPNN's atom edges too,
    ``[..., M, M, H]``): in a backward pass, autograd summing a gradient of the edges over their uses."""

    def __init__(self, *shapes: tuple[int, ...]) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def edges(self, x: object) -> bool:
        return isinstance(x, torch.Tensor) and any(x.shape[-len(s) :] == s for s in self.shapes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            self.count += all(map(self.edges, args[:2]))
        return func(*args, **(kwargs or {}))


def step(model, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Log-probs of the native sequence and of it shifted by one, each in its own random decoding order (two
    sequences per structure in the decoder), the gradient of their sum's difference (a DPO-like objective)
    with respect to every parameter, and how many sums of the edges' gradients its backward pass ran."""
    S = torch.stack([batch["native"], batch["native"].roll(1, 1)], 1)
    ranks = decoding_ranks(batch["decode_mask"], batch["mask"], [7], num_orders=2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        log_probs = model.decode(model.encode(**structure_inputs(batch)), S, ranks)
    logps = (log_probs.gather(-1, S.unsqueeze(-1)).squeeze(-1) * batch["mask"][:, None]).sum(-1)
    params = [p for p in model.parameters() if p.requires_grad]
    M = model.config.atom_context_num
    with EdgeGradientSums((model.config.k_neighbors, H), *([(M, M, H)] if M else [])) as sums:
        grads = torch.autograd.grad(logps[:, 0].sum() - logps[:, 1].sum(), params, allow_unused=True)
    flat = [
        g.flatten() if g is not None else torch.zeros(p.numel()) for g, p in zip(grads, params, strict=True)
    ]
    return logps.detach(), torch.cat(flat), sums.count


@interpreted
@pytest.mark.parametrize("name", ["vanilla/v_48_020", "ligand/v_32_010_25"])
def test_models_with_fused_kernels_equal_the_plain_layers(name: str, monkeypatch: pytest.MonkeyPatch):
    """Whole models on real structures, every layer fused (LigandMPNN's context layers too): in fp32 the
    log-probs and gradients of the plain layers, which equal the official code's (test_model, test_ligand);
    in bf16 (ProteinMPNN) the fp32 ones within the tolerances of the trainer's bf16 test (test_speed). The
    fused path is taken only when turned on: by the edge embedding, each encoder layer's two MLPs (the edge
    update's with its residual and layer norm) and each decoder layer's, and LigandMPNN's atom edges'
    embedding and four context layers; every MLP's kernel applies its edge block but those of the context
    layers over residues."""
    torch.manual_seed(0)
    model = load_model(name).eval()
    fused_model = copy.deepcopy(model)
    use_fused_kernels(fused_model, True)
    batch = designed(name)
    assert name.startswith("vanilla") or batch["context_mask"].any()
    calls = []
    for op in ("embedded_rbf", "message_mlp", "normed_edge_messages"):
        original = getattr(fused, op)
        monkeypatch.setattr(
            fused,
            op,
            lambda *a, op=op, original=original: calls.append((op, a[-1] is not None)) or original(*a),
        )
    logps, gradient, plain_sums = step(model, batch, "no")
    assert calls == []  # off by default
    logps_fused, gradient_fused, sums = step(fused_model, batch, "no")
    # (operator, its last argument given: the message MLPs' edge block W_e)
    counts = {("embedded_rbf", True): 1, ("message_mlp", True): 6, ("normed_edge_messages", True): 3}
    if name.startswith("ligand"):  # the atom edges' embedding too; the atom layers apply their edge block
        counts.update({("embedded_rbf", True): 2, ("message_mlp", True): 8, ("message_mlp", False): 2})
    assert Counter(calls) == counts
    # each encoder layer's node messages pass their edges on to its edge update (LigandMPNN's first atom
    # layer its atom edges to the second), and their backward kernel adds its gradient of them; autograd
    # still sums the decoder's three layers'
    assert sums == 2 < plain_sums, (sums, plain_sums)
    assert (logps_fused - logps).abs().max() < 1e-3  # sums of ~90 log-probs, each within 1e-5
    assert relative(gradient_fused, gradient) < 1e-5
    if name.startswith("ligand"):
        return  # bf16 takes the same path (the interpreter multiplies in fp32): once is enough
    logps16, gradient16, _ = step(fused_model, batch, "bf16")
    assert ((logps16 - logps).abs() <= 2**-7 * logps.abs()).all()
    assert F.cosine_similarity(gradient16, gradient, dim=0) > 0.99
    assert float(gradient16.norm()) == pytest.approx(float(gradient.norm()), rel=0.05)
