"""CUDA graphs of the training step on a GPU: the plain step's loss, metrics and gradients, and the speed-up.

    python scripts/graphs_check.py                      # the example pairs, batches 8 and 32, fp32
    python scripts/graphs_check.py --train_file ../shared/data/train.jsonl --mixed_precision bf16 \
        --fused_modes off on                            # and with the fused kernels, graphed as well

The model as `python -m dpo_inv.run --cuda_graphs` builds it; for each batch size and mode of the fused
kernels (`--fused_modes`: off, on or both, with one model load; on runs them in bf16 or fp16), the same
micro-batches (padded to `--pad_to_multiple_of`, 32 by default) through the plain step and through its CUDA
graphs (`build_step` with and without `cuda_graphs`; forward and backward, the optimizer left out so that both
see the same weights), first compared (every shape captured), then timed. Printed, one JSON line each: the
largest difference of loss, metrics and gradients relative to their scale, the graphs captured, and the
forward-and-backward pairs/s of each path (alternating), with the speed-up. Every other option is a
`DPOConfig` field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import datasets
import torch
from benchmark import Trainer, build, epochs, scaled_pairs, train_loader
from trl import TrlParser

from dpo_inv.data.dataset import load_records
from dpo_inv.models.layers import use_fused_kernels
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.graphs import GraphedStep
from dpo_inv.training.loss import batch_ranks
from dpo_inv.training.trainer import build_step


@dataclass
class Options:
    batch_sizes: list[int] = field(default_factory=lambda: [8, 32], metadata={"help": "Micro-batch sizes."})
    steps: int = field(default=20, metadata={"help": "Micro-batches compared, then timed, on each path."})
    num_pairs: int = field(default=1024, metadata={"help": "The train_file's pairs repeated to this many."})
    work_dir: str = field(default="outputs/graphs_check", metadata={"help": "Data file and feature cache."})
    fused_modes: list[str] = field(
        default_factory=lambda: ["off"],
        metadata={
            "help": "The fused kernels off, on, or both in turn (on: bf16 or fp16).",
            "choices": ["off", "on"],
        },
    )


def gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def check(trainer: Trainer, options: Options, batch_size: int, fused: bool) -> dict:
    config, model, accelerator = trainer.config, trainer.model, trainer.accelerator
    for module in (model, trainer.reference):
        if module is not None:
            use_fused_kernels(module, fused)
    plain = build_step(replace(config, cuda_graphs=False), model, trainer.reference, accelerator)
    graphed = GraphedStep(plain, [p for p in model.parameters() if p.requires_grad])
    work = Path(options.work_dir)
    data = load_records(scaled_pairs(config.train_file, options.num_pairs, work), cache_dir=work / "cache")
    stream = epochs(train_loader(trainer, data, batch_size, True))
    batches = []
    for _ in range(options.steps):
        epoch, batch = next(stream)
        ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
        batches.append((batch, ranks))
    worst: dict[str, float] = {}
    for batch, ranks in batches:  # compared; every shape captured before the timing
        model.zero_grad(set_to_none=True)
        loss, rows = plain(batch, ranks)
        expected = {"loss": loss, **rows, "gradients": gradients(model)}
        model.zero_grad(set_to_none=True)
        loss, rows = graphed(batch, ranks)
        got = {"loss": loss, **rows, "gradients": gradients(model)}
        for name, value in expected.items():
            worst[name] = max(worst.get(name, 0.0), relative(got[name], value))
    seconds = {"plain": 0.0, "graphs": 0.0}
    for batch, ranks in batches:
        for name, step in (("plain", plain), ("graphs", graphed)):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(batch, ranks)
            torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - start
    pairs = options.steps * batch_size
    speed = {name: round(pairs / value, 1) for name, value in seconds.items()}
    return {
        "device": torch.cuda.get_device_name(),
        "mixed_precision": config.mixed_precision,
        "per_device_batch_size": batch_size,
        "pad_to_multiple_of": config.pad_to_multiple_of,
        "fused_kernels": fused,
        "graphs_captured": len(graphed.captured),
        "max_relative_difference": {name: float(f"{value:.2e}") for name, value in worst.items()},
        "pairs_per_second": speed,
        "speedup": round(speed["graphs"] / speed["plain"], 2),
    }


def main() -> None:
    parser = TrlParser(dataclass_types=[Options, DPOConfig], description=__doc__.split("\n\n")[0])
    options, config = parser.parse_args_and_config()
    datasets.disable_progress_bars()
    Path(options.work_dir).mkdir(parents=True, exist_ok=True)
    trainer, _ = build(replace(config, cuda_graphs=True, pad_to_multiple_of=config.pad_to_multiple_of or 32))
    for batch_size in options.batch_sizes:
        for mode in options.fused_modes:
            print(json.dumps(check(trainer, options, batch_size, mode == "on")), flush=True)


if __name__ == "__main__":
    main()
