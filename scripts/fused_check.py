"""The fused kernels on a GPU (the message MLPs', the edge embedding's): equal to the plain computation,
and how long each takes; or, on any machine, what each compiles to for a GPU.

    python scripts/fused_check.py            # a DPO micro-batch's decoder layer: 128 structures of 150
                                             # residues, 48 neighbours, 2 sequences each, bf16
    python scripts/fused_check.py --compile_only   # no GPU needed: every kernel, form and autotuned
                                                   # config compiled for an H100/H200 (sm_90)
    python scripts/fused_check.py --warm_cache --forms decoder encoder "edge update"
                                             # every autotuned config of ProteinMPNN's forms compiled into
                                             # Triton's cache, a process per config side by side

For each form the layers use it prints the relative error of the fused forward and gradients against the
plain PyTorch computation in fp32, the time of forward + backward of each path (CUDA events, median) and the
configs the autotuner chose.
With `--warm_cache` it only runs each form forward (with and without autograd) and backward once per
autotuned config, each config in a process of its own, so that Triton's cache (`~/.triton/cache`) holds
every config: a later process's autotuner then times the configs without compiling them one after another
(about 40 kernels for ProteinMPNN's forms, a few seconds each). On a CPU it runs under Triton's interpreter.
With `--compile_only` it compiles each kernel with Triton's compiler and the `ptxas` Triton ships, for the
GPU architecture `--arch` (90: Hopper), as the layers launch it under bf16 autocast (per-edge blocks and
weight matrices in bf16, 48 neighbours; LigandMPNN's context layers 25), and prints per config the shared
memory, the registers per thread and the bytes spilled to local memory per thread: a kernel that does not
compile, or needs more shared memory than a multiprocessor has (227 KB on sm_90), fails there before a GPU
is used.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.func import functional_call
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.testing import do_bench

from dpo_inv.models import fused
from dpo_inv.models.features import ProteinFeatures, _embedded_rbf
from dpo_inv.models.layers import AutocastLayerNorm

# form: (sequences per structure N, neighbours K, HAS_TABLE, HAS_SCALE, HAS_WEIGHT, HAS_SHARED,
# HAS_EDGE_WEIGHT, EDGE_OUT, NORM), as the layers call the kernels in training (the edge blocks applied in
# the kernels but LigandMPNN's residue context layers', whose entries are 2H wide; the edge update with its
# residual and layer norm)
FORMS = {
    "decoder": (2, 48, True, True, False, True, True, False, False),
    "encoder": (1, 48, True, False, True, False, True, False, False),
    "edge update": (1, 48, True, False, False, False, True, True, True),
    "context": (1, 25, False, False, True, False, False, False, False),
    "atom context": (1, 25, False, False, True, False, True, False, False),
}
EDGE_NORM = AutocastLayerNorm(128)  # the edge update's layer norm, as the layer applies it (parameters given)
# the forms whose backward kernel adds a later use's gradient of the edges to theirs (the encoder's node
# messages: the edge update's; the first atom context layer: the second's; fused.message_sum_and_edges)
ADDED = {"encoder", "atom context"}
KERNELS = {"forward": fused._forward_kernel, "backward": fused._backward_kernel}
SHARED_MEMORY_KB = {90: 227, 80: 163, 89: 99}  # the most one block may use, by architecture
POINTERS = {
    "index": "*i64", "scale": "*fp32", "weight": "*fp32", "W2": "*bf16", "b2": "*fp32", "W3": "*bf16",
    "b3": "*fp32", "d_table": "*fp32", "d_shared": "*fp32", "d_weights": "*fp32", "d_biases": "*fp32",
    "means": "*fp32", "rstds": "*fp32", "eps": "fp32",
}  # fmt: skip
# the arguments of the distance features' kernels
RBF_TYPES = {
    "D_first": "*fp32",
    "atoms": "*fp32",
    "rows": "*i64",
    "centre_atom": "*i64",
    "neighbour_atom": "*i64",
    "centres": "*fp32",
    "out": "*bf16",
    "E": "i32",
    "K": "i32",
}


def compiled(kernel: str, form: str, config: triton.Config, arch: int) -> dict[str, int]:
    """One kernel in one form and config compiled for the architecture ``arch`` (bf16 blocks and weights):
    its shared memory (bytes), registers per thread and bytes spilled per thread (``ptxas -v``)."""
    jit = KERNELS[kernel].fn
    N, K, *flags = FORMS[form]
    constants = {"N": N, "H": 128, **config.kwargs, "DOT_DTYPE": tl.bfloat16}
    *flags, norm = flags
    constants.update(zip((*fused._OPTIONAL, "EDGE_OUT"), flags, strict=True))
    if kernel == "forward":  # in training the layer norm's inputs are kept for the backward pass
        constants.update(NORM=norm, KEEP=norm)
    else:
        edge_gradients = fused._edge_gradients_in_kernel(constants["EDGE_OUT"], constants["HAS_EDGE_WEIGHT"])
        constants.update(
            EDGE_GRADIENTS=edge_gradients, HAS_ADDED=form in ADDED, N_BLOCK=triton.next_power_of_2(N)
        )
    types = {name: POINTERS.get(name, "*bf16") for name in jit.arg_names}
    types |= {"M": "i32", "R": "i32", "K": "i32"}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return ptxas_stats(jit, constants, types, K % 16 == 0, arch, options)


# the edge features' kernels as the backbone's edges launch them (5 atoms, 24 pairs and the positional
# encodings) and as LigandMPNN's atom edges do (1 atom, no pair: the distances alone; no table; the absent
# tensors' pointers stand in by the distances')
EDGES = {"backbone": (5, 24, True), "atom edges": (1, 0, False)}


def edge_types(edges: str) -> dict[str, str]:
    if EDGES[edges][2]:
        types = RBF_TYPES | {"classes": "*i64", "table": "*bf16", "W": "*bf16"}
    else:
        types = RBF_TYPES | {"rows": "*fp32", "classes": "*fp32", "table": "*fp32", "W": "*bf16"}
    # the layer norm's weights as CUDA's autocast gives them (bf16), the gradients' sums in fp32
    return types | {"norm_weight": "*bf16", "norm_bias": "*bf16", "d_out": "*bf16", "d_embedding": "*bf16",
                    "d_norm": "*fp32", "d_W": "*fp32"}  # fmt: skip


def compiled_rbf(arch: int, edges: str) -> dict[str, int]:
    """The distance features' kernel (the edge embedding's backward pass recomputes the features with it)
    compiled for ``arch`` as the ``edges`` launch it (16 centres, bf16 out), with the same statistics."""
    A, P, _ = EDGES[edges]
    constants = {"A": A, "P": P, "P_BLOCK": triton.next_power_of_2(P + 1), "C": 16, "SIGMA": 1.25,
                 "BLOCK_E": fused._RBF_EDGES}  # fmt: skip
    options = {"num_warps": 4, "num_stages": 1}
    return ptxas_stats(fused._rbf_kernel, constants, edge_types(edges), True, arch, options)


def compiled_embedding(arch: int, edges: str, backward: bool) -> dict[str, int]:
    """The edge embedding's kernel with its layer norm (``backward``: the layer norm's backward kernel)
    compiled for ``arch`` as the ``edges`` launch it (bf16 table, weights and out), with the same
    statistics."""
    A, P, table = EDGES[edges]
    constants = {"A": A, "P": P, "C": 16, "H": 128, "SIGMA": 1.25, "EPS": 1e-5, "HAS_TABLE": table,
                 "PAIRS": fused._embedding_pairs(P), "BLOCK_E": fused._EMBEDDING_EDGES,
                 "DOT_DTYPE": tl.bfloat16, "X_DTYPE": tl.bfloat16}  # fmt: skip
    if backward:
        constants["W_GRADIENT"] = fused._weight_gradient_in_kernel(P, table)
        constants["BLOCK_E"] = fused._backward_edges(P, table)
    options = {"num_warps": fused._EMBEDDING_WARPS, "num_stages": 1}
    kernel = fused._embedding_backward_kernel if backward else fused._embedding_kernel
    return ptxas_stats(kernel, constants, edge_types(edges), True, arch, options)


def ptxas_stats(
    jit: triton.JITFunction, constants: dict, types: dict[str, str], k_aligned: bool, arch: int, options: dict
) -> dict[str, int]:
    signature = {name: "constexpr" if name in constants else types[name] for name in jit.arg_names}
    aligned = {  # as a launch specialises: 16-byte aligned pointers, K a multiple of 16
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(jit.arg_names)
        if signature[name].startswith("*") or (name == "K" and k_aligned)
    }
    target = GPUTarget("cuda", arch, 32)
    binary = triton.compile(ASTSource(jit, signature, constants, aligned), target=target, options=options)
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(binary.asm["ptx"])
        name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # "a": the features Triton's code uses
        out = ptx.with_suffix(".o")
        command = [get_ptxas(arch).path, "-v", f"--gpu-name={name}", str(ptx), "-o", str(out)]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
        nvdisasm = Path(get_ptxas(arch).path).with_name("nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", str(out)], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", log)
    spilled = re.search(r"(\d+) bytes spill stores", log)
    return {
        "shared": binary.metadata.shared,
        "registers": int(registers.group(1)) if registers else 0,
        "spilled": int(spilled.group(1)) if spilled else 0,
        "in_loops": spill_accesses_in_loops(sass),
    }


def spill_accesses_in_loops(sass: str) -> int:
    """The local-memory loads and stores (``LDL``, ``STL``: the spills) of a disassembled kernel that lie in
    a loop, between a branch back and its target: those its tiles run again and again, where those before
    and after the loops run once per program."""
    at, labels, accesses, loops = None, {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        address = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if label:
            at = label.group(1)
        elif address:
            address = int(address.group(1), 16)
            if at:
                labels[at], at = address, None
            if re.search(r"\b(LDL|STL)\b", line):
                accesses.append(address)
            target = re.search(r"\bBRA\b.*`\(\.(L_x_\d+)\)", line)
            if target and labels.get(target.group(1), address) < address:
                loops.append((labels[target.group(1)], address))
    return sum(any(start <= x <= end for start, end in loops) for x in accesses)


def described(config: triton.Config) -> str:
    """A config as the lines print it."""
    return (
        f"BLOCK_M {config.kwargs['BLOCK_M']}, BLOCK_K {config.kwargs['BLOCK_K']}, "
        f"{config.num_warps} warps, {config.num_stages} stages"
    )


def compile_all(forms: list[str], arch: int, only: triton.Config | None = None) -> bool:
    """Every kernel, form and autotuned config (or ``only`` that config) compiled for ``arch``, a line
    each; whether all fit in its shared memory."""
    fits = True
    for kernel, autotuned in KERNELS.items():
        for form in forms:
            for config in autotuned.configs if only is None else [only]:
                shape = described(config)
                stats = compiled(kernel, form, config, arch)
                fits &= stats["shared"] <= 1024 * SHARED_MEMORY_KB.get(arch, 99)
                print(f"{kernel:8s} {form:11s} {shape}: shared {stats['shared'] / 1024:.0f} KB, "
                      f"{stats['registers']} registers, {stats['spilled']} bytes spilled, "
                      f"{stats['in_loops']} spill accesses in loops", flush=True)  # fmt: skip
    for edges, (_, P, table) in EDGES.items():
        for name, stats, (tile, warps) in (
            ("rbf", compiled_rbf(arch, edges), (fused._RBF_EDGES, 4)),
            (
                "embedding",
                compiled_embedding(arch, edges, False),
                (fused._EMBEDDING_EDGES, fused._EMBEDDING_WARPS),
            ),
            (
                "norm_back",
                compiled_embedding(arch, edges, True),
                (fused._backward_edges(P, table), fused._EMBEDDING_WARPS),
            ),
        ):
            fits &= stats["shared"] <= 1024 * SHARED_MEMORY_KB.get(arch, 99)
            print(f"{name:9s} {edges:10s} {tile} edges, {warps} warps: shared "
                  f"{stats['shared'] / 1024:.0f} KB, {stats['registers']} registers, "
                  f"{stats['spilled']} bytes spilled, {stats['in_loops']} spill accesses in loops",
                  flush=True)  # fmt: skip
    return fits


def plain(form: str, edges, nodes, table, index, seen, shared, W2, b2, W3, b3, W_e, norm_weight, norm_bias):  # noqa: ANN001
    """The layers' plain computation of each form."""
    if "context" in form:
        pre = (edges if form == "context" else F.linear(edges, W_e))[:, :, None] + nodes[:, None]
        out = (F.gelu(F.linear(F.gelu(pre), W2, b2)) * seen[..., None]).sum(1)
        # the atom layers' with a later use of the edges (their sum over the entries), as the layer's
        return out if form == "context" else out + edges.sum(1, keepdim=True)
    pre = F.linear(edges, W_e)[:, :, None] + nodes[:, None]
    neighbours = table[index]
    if form == "decoder":
        pre = pre + seen[..., None] * neighbours + shared[index][:, :, None]
        return F.gelu(F.linear(F.gelu(pre), W2, b2)).sum(1)
    hidden = F.gelu(F.linear(F.gelu(pre + neighbours), W2, b2))
    if form == "encoder":  # with a later use of the edges (their sum over the neighbours), as the layer's
        return (hidden * seen[..., None]).sum(1) + edges.sum(1, keepdim=True)
    norm = {"weight": norm_weight, "bias": norm_bias}
    return functional_call(EDGE_NORM, norm, (edges + F.linear(hidden[:, :, 0], W3, b3),))


def fused_form(
    form: str, edges, nodes, table, index, seen, shared, W2, b2, W3, b3, W_e, norm_weight, norm_bias
):  # noqa: ANN001
    if form == "decoder":
        neighbours = {"table": table, "index": index, "scale": seen, "shared": shared}
        return fused.message_sum(edges, nodes, W2, b2, **neighbours, W_e=W_e)
    if form == "encoder":
        out, again = fused.message_sum_and_edges(edges, nodes, W2, b2, table, index, weight=seen, W_e=W_e)
        return out + again.sum(1, keepdim=True)
    if form == "context":
        return fused.message_sum(edges, nodes, W2, b2, weight=seen)
    if form == "atom context":
        out, again = fused.message_sum_and_edges(edges, nodes, W2, b2, weight=seen, W_e=W_e)
        return out + again.sum(1, keepdim=True)
    norm = (x.to(edges.dtype) for x in (norm_weight, norm_bias))  # rounded as the layer rounds them on CUDA
    mlp = (edges, nodes[:, 0], table[:, 0], index, W2, b2, W3, b3)
    return fused.edge_update(*mlp, edges, *norm, 1e-5, W_e=W_e)


def form_inputs(form: str, B: int, L: int, K: int, device: torch.device) -> tuple[dict, tuple[str, ...]]:
    """Random inputs of one form for B structures of L residues (fp32), and the names of those learnt (they
    require a gradient)."""
    H, N, R = 128, FORMS[form][0], B * L
    K = FORMS[form][1] if "context" in form else K  # a context layer's entries, not --neighbours
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, device=device, generator=generator)

    tensors = {
        "edges": randn(R, K, H), "nodes": randn(R, N, H), "table": randn(R, N, H), "shared": randn(R, H),
        "index": torch.randint(0, R, (R, K), device=device, generator=generator),
        "seen": (torch.rand(R, K, N, device=device, generator=generator) > 0.5).float(),
        "W2": randn(H, H, scale=0.1), "b2": randn(H), "W3": randn(H, H, scale=0.1), "b3": randn(H),
        "W_e": randn(H, H, scale=0.1), "norm_weight": 1 + randn(H, scale=0.1),
        "norm_bias": randn(H, scale=0.1),
    }  # fmt: skip
    learnt = ("edges", "nodes") + (() if "context" in form else ("table",))
    learnt += ("W_e",) if FORMS[form][6] else ()
    learnt += ("W2", "b2")
    learnt += ("shared",) if form == "decoder" else ()
    learnt += ("W3", "b3", "norm_weight", "norm_bias") if form == "edge update" else ()
    for name in learnt:
        tensors[name].requires_grad_()
    return tensors, learnt


def bf16_blocks(tensors: dict) -> dict:
    """The inputs with the per-edge and per-node blocks in bf16, as the layers hand them under autocast."""
    blocks = ("edges", "nodes", "table", "shared")
    return {n: (t.detach().bfloat16().requires_grad_() if n in blocks else t) for n, t in tensors.items()}


def check(form: str, B: int, L: int, K: int, device: torch.device) -> str:
    """One form on random inputs of B structures of L residues: errors and timings, as a line."""
    N, R = FORMS[form][0], B * L
    K = FORMS[form][1] if "context" in form else K
    tensors, learnt = form_inputs(form, B, L, K, device)
    expected = plain(form, **tensors)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, [tensors[name] for name in learnt], grad)
    half = bf16_blocks(tensors)
    leaves = [half[name] for name in learnt]
    out = fused_form(form, **half)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

    errors = [error(out, expected)] + [error(a, b) for a, b in zip(grads, expected_grads, strict=True)]

    def step(path: Callable) -> Callable[[], None]:
        def run() -> None:
            result = path(form, **half)
            torch.autograd.grad(result, leaves, grad.to(result.dtype))

        return run

    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain_ms = do_bench(step(plain), return_mode="median")
    fused_ms = do_bench(step(fused_form), return_mode="median")
    return (
        f"{form:12s} R={R} K={K} N={N}: bf16 relative error out {errors[0]:.1e}, gradients "
        f"{max(errors[1:]):.1e}; forward+backward plain (bf16 autocast) {plain_ms:.2f} ms, "
        f"fused {fused_ms:.2f} ms ({plain_ms / fused_ms:.2f}x); tuned: forward "
        f"{described(fused._forward_kernel.best_config)}, "
        f"backward {described(fused._backward_kernel.best_config)}"
    )


def warm_cache(forms: list[str], B: int, L: int, K: int) -> None:
    """Every autotuned config of the message kernels in ``forms`` compiled into Triton's cache, a process per
    config side by side (the edge embedding's kernels, with one config each, are left to the first use)."""
    count = max(len(kernel.configs) for kernel in KERNELS.values())
    context = multiprocessing.get_context("spawn")  # a CUDA context per process
    shapes = [(forms, B, L, K)] * count
    with ProcessPoolExecutor(count, mp_context=context) as pool:
        for line in pool.map(warm_config, range(count), *zip(*shapes, strict=True)):
            print(line, flush=True)


def warm_config(i: int, forms: list[str], B: int, L: int, K: int) -> str:
    """Each form forward, with and without autograd (the edge update keeps its norm's inputs only with),
    and backward, with the ``i``-th config of each kernel alone (one config: the autotuner launches it
    without timing), as a line."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for kernel in KERNELS.values():
        kernel.configs = [kernel.configs[i % len(kernel.configs)]]
    for form in forms:
        tensors, learnt = form_inputs(form, B, L, FORMS[form][1] if "context" in form else K, device)
        half = bf16_blocks(tensors)
        out = fused_form(form, **half)
        torch.autograd.grad(out, [half[name] for name in learnt], torch.ones_like(out))
        with torch.no_grad():
            fused_form(form, **half)
    return f"warm: {', '.join(forms)}: forward {described(fused._forward_kernel.configs[0])}, backward " + (
        described(fused._backward_kernel.configs[0])
    )


def check_embedding(B: int, L: int, K: int, device: torch.device) -> str:
    """The edge embedding and its layer norm on B structures of L residues (random atoms in a 40 Å box,
    random neighbours and positional classes, ProteinMPNN's weights' scale) as one kernel in bf16 against the
    plain path in fp32: the relative error of the output and the weights' (and the norm's) gradients, and
    the times of forward + backward of the kernel and of the plain path under bf16 autocast, as a line."""
    generator = torch.Generator(device).manual_seed(0)
    atoms = 40 * torch.rand(B, L, 5, 3, device=device, generator=generator)
    E_idx = torch.randint(0, L, (B, L, K), device=device, generator=generator)
    D_first = 2 + 20 * torch.rand(B, L, K, device=device, generator=generator)
    classes = torch.randint(0, 66, (B, L, K), device=device, generator=generator)
    pairs = ProteinFeatures(128, K).to(device).atom_pairs
    table = torch.randn(66, 128, device=device, generator=generator).requires_grad_()
    W = (0.05 * torch.randn(128, 400, device=device, generator=generator)).requires_grad_()
    norm = AutocastLayerNorm(128).to(device)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=generator)
        norm.bias.normal_(0.0, 0.1, generator=generator)
    d_out = torch.randn(B, L, K, 128, device=device, generator=generator)

    def embedded(fuse: bool, autocast: bool = True) -> list[torch.Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = _embedded_rbf(D_first, atoms, E_idx, pairs, (classes, table, W), norm, fuse)
        learnt = (table, W, norm.weight, norm.bias)
        return [out, *torch.autograd.grad(out, learnt, d_out.to(out.dtype))]

    want = embedded(False, autocast=False)
    errors = [float((a.float() - b).norm() / b.norm()) for a, b in zip(embedded(True), want, strict=True)]
    plain_ms = do_bench(lambda: embedded(False), return_mode="median")
    fused_ms = do_bench(lambda: embedded(True), return_mode="median")
    return (
        f"{'embedding':12s} R={B * L} K={K}: bf16 relative error out {errors[0]:.1e}, gradients "
        f"{max(errors[1:]):.1e}; forward+backward plain (bf16 autocast) {plain_ms:.2f} ms, fused "
        f"{fused_ms:.2f} ms ({plain_ms / fused_ms:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--structures", type=int, default=128)
    parser.add_argument("--length", type=int, default=150)
    parser.add_argument("--neighbours", type=int, default=48)
    parser.add_argument("--compile_only", action="store_true", help="Compile for --arch; no GPU needed.")
    parser.add_argument("--arch", type=int, default=90, help="With --compile_only: sm_ARCH (90: H100, H200).")
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    parser.add_argument(
        "--config",
        metavar="M,K,WARPS,STAGES",
        help="With --compile_only: this config alone (BLOCK_M, BLOCK_K, warps, stages).",
    )
    parser.add_argument(
        "--warm_cache", action="store_true", help="Every autotuned config into Triton's cache."
    )
    args = parser.parse_args()
    if args.warm_cache:
        warm_cache(args.forms, args.structures, args.length, args.neighbours)
        return
    if args.compile_only:
        only = None
        if args.config:
            m, k, warps, stages = (int(x) for x in args.config.split(","))
            only = triton.Config({"BLOCK_M": m, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        if not compile_all(args.forms, args.arch, only):
            raise SystemExit(f"a kernel needs more shared memory than sm_{args.arch} has")
        return
    for form in args.forms:
        print(check(form, args.structures, args.length, args.neighbours, torch.device("cuda")), flush=True)
    print(check_embedding(args.structures, args.length, args.neighbours, torch.device("cuda")), flush=True)


if __name__ == "__main__":
    main()
