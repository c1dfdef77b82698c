"""The fused message-MLP kernels on a GPU: equal to the plain computation, and how long each takes.

    python scripts/fused_check.py            # a DPO micro-batch's decoder layer: 128 structures of 150
                                             # residues, 48 neighbours, 2 sequences each, bf16

For each form the layers use it prints the relative error of the fused forward and gradients against the
plain PyTorch computation in fp32, and the time of forward + backward of each path (CUDA events, median).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dpo_inv.models import fused


def plain(form: str, edges, nodes, table, index, seen, W2, b2, W3, b3):  # noqa: ANN001
    """The layers' plain computation of each form."""
    pre = edges[:, :, None] + nodes[:, None]
    if form == "context":
        return (F.gelu(F.linear(F.gelu(pre), W2, b2)) * seen[..., None]).sum(1)
    neighbours = table[index]
    if form == "decoder":
        return F.gelu(F.linear(F.gelu(pre + seen[..., None] * neighbours), W2, b2)).sum(1)
    hidden = F.gelu(F.linear(F.gelu(pre + neighbours), W2, b2))
    if form == "encoder":
        return (hidden * seen[..., None]).sum(1)
    return F.linear(hidden[:, :, 0], W3, b3)


def fused_form(form: str, edges, nodes, table, index, seen, W2, b2, W3, b3):  # noqa: ANN001
    if form == "decoder":
        return fused.message_sum(edges, nodes, W2, b2, table=table, index=index, scale=seen)
    if form == "encoder":
        return fused.message_sum(edges, nodes, W2, b2, table=table, index=index, weight=seen)
    if form == "context":
        return fused.message_sum(edges, nodes, W2, b2, weight=seen)
    return fused.edge_messages(edges, nodes[:, 0], table[:, 0], index, W2, b2, W3, b3)


def check(form: str, B: int, L: int, K: int, device: torch.device) -> str:
    """One form on random inputs of B structures of L residues: errors and timings, as a line."""
    H, N, R = 128, 2 if form == "decoder" else 1, B * L
    K = 25 if form == "context" else K
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, device=device, generator=generator)

    tensors = {
        "edges": randn(R, K, H), "nodes": randn(R, N, H), "table": randn(R, N, H),
        "index": torch.randint(0, R, (R, K), device=device, generator=generator),
        "seen": (torch.rand(R, K, N, device=device, generator=generator) > 0.5).float(),
        "W2": randn(H, H, scale=0.1), "b2": randn(H), "W3": randn(H, H, scale=0.1), "b3": randn(H),
    }  # fmt: skip
    learnt = ("edges", "nodes") + (("table",) if form != "context" else ()) + ("W2", "b2")
    learnt += ("W3", "b3") if form == "edge update" else ()
    for name in learnt:
        tensors[name].requires_grad_()
    expected = plain(form, **tensors)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, [tensors[name] for name in learnt], grad)
    half = {n: (t.detach().bfloat16().requires_grad_() if n in ("edges", "nodes", "table") else t)
            for n, t in tensors.items()}  # fmt: skip
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
        f"fused {fused_ms:.2f} ms ({plain_ms / fused_ms:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--structures", type=int, default=128)
    parser.add_argument("--length", type=int, default=150)
    parser.add_argument("--neighbours", type=int, default=48)
    args = parser.parse_args()
    for form in ("decoder", "encoder", "edge update", "context"):
        print(check(form, args.structures, args.length, args.neighbours, torch.device("cuda")), flush=True)


if __name__ == "__main__":
    main()
