"""CUDA graphs of the training step: the forward and backward of a micro-batch captured once per batch shape,
then replayed, so that a small batch's step does not wait on the host launching its operators one by one (a
batch-8 DPO step's forward and backward run about 1,000 in fp32, 1,400 in bf16). What is captured is the
plain step, unchanged; `cuda_graphs` turns it on and `pad_to_multiple_of` makes shapes repeat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpo_inv.training.objective import Rows

# forward and backward of a micro-batch under decoding ranks: its loss (detached) and per-example metrics
Step = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, Rows]]
WARMUP = 2  # eager runs of a new shape before its capture (lazy initialisations, library workspaces)


def shape_of(batch: dict[str, torch.Tensor], ranks: torch.Tensor) -> tuple:
    """What a graph is captured for: every input's name, shape and dtype."""
    inputs = sorted({**batch, "ranks": ranks}.items())
    return tuple((name, tuple(value.shape), value.dtype) for name, value in inputs)


@dataclass
class Captured:
    """One shape's graph, the static inputs each micro-batch is copied into and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    batch: dict[str, torch.Tensor]
    ranks: torch.Tensor
    loss: torch.Tensor
    rows: Rows
    grads: list[torch.Tensor | None]  # of each trained parameter


class GraphedStep:
    """``step`` replayed from a CUDA graph per batch shape, on the current CUDA device.

    The graphs write the gradients anew (they do not add to them): the caller steps the optimizer after
    every micro-batch (no gradient accumulation) and may set the gradients to None in between. The random
    state the warm-up runs draw from is restored: a replay draws from the state at its start, as the plain
    step does."""

    def __init__(self, step: Step, parameters: list[torch.nn.Parameter]) -> None:
        self.step = step
        self.parameters = parameters
        self.captured: dict[tuple, Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for all shapes: they never overlap

    def __call__(self, batch: dict[str, torch.Tensor], ranks: torch.Tensor) -> tuple[torch.Tensor, Rows]:
        key = shape_of(batch, ranks)
        if key not in self.captured:
            self.captured[key] = self.capture(batch, ranks)
        captured = self.captured[key]
        for name, value in batch.items():
            captured.batch[name].copy_(value)
        captured.ranks.copy_(ranks)
        captured.graph.replay()
        for parameter, grad in zip(self.parameters, captured.grads, strict=True):
            parameter.grad = grad
        return captured.loss.clone(), {name: value.clone() for name, value in captured.rows.items()}

    def capture(self, batch: dict[str, torch.Tensor], ranks: torch.Tensor) -> Captured:
        """Warm up on a side stream, then capture ``step`` on static copies of the inputs."""
        static = {name: value.clone() for name, value in batch.items()}
        static_ranks = ranks.clone()
        random_state = torch.cuda.get_rng_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.set_grads_to_none()
                self.step(static, static_ranks)
        torch.cuda.current_stream().wait_stream(side)
        self.set_grads_to_none()
        torch.cuda.set_rng_state(random_state)  # a replay draws from the state at its start (not a capture)
        graph = torch.cuda.CUDAGraph()
        # thread_local: DataLoader threads may pin memory meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            loss, rows = self.step(static, static_ranks)
        grads = [parameter.grad for parameter in self.parameters]
        return Captured(graph, static, static_ranks, loss, rows, grads)

    def set_grads_to_none(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None
