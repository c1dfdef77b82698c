"""Speed of the DPO training step: pairs/s, residues/s, step-time percentiles, peak memory, data loading.

    python scripts/benchmark.py                                      # the example pairs, scaled up
    python scripts/benchmark.py --lengths 100 200 400 800 1500 --batch_sizes 1   # growth with length
    python scripts/benchmark.py --lengths 150 600 --batch_sizes 8 16 32 64 --mixed_precision bf16
    python scripts/benchmark.py --find_max_length --batch_sizes 1     # the longest structure that trains
    python scripts/benchmark.py --file_batch_sizes 8 32 --lengths 150 --batch_sizes 32 128   # both, one load

Every `DPOConfig` field is an option too (`--config FILE.yaml`, `--mixed_precision`,
`--precompute_ref_log_probs`, `--num_decoding_orders`, `--dataloader_num_workers`, `--torch_compile`, ...).
Under `accelerate launch` or `torchrun` the numbers are for all processes together. The script builds what
`dpo_inv.training.trainer` builds (the Accelerator with its autocast and compilation settings, the
length-grouped DataLoader, AdamW) and runs the same micro-batch (`build_step`: objective and backward, or
their CUDA graphs with `--cuda_graphs`; metrics gather, gradient clipping, optimizer step); it times `steps`
of them after `warmup` untimed ones.

Data. Without `--lengths`: `train_file` (the bundled example by default) with its pairs repeated to
`num_pairs`. With `--lengths`: for each length L, one structure of exactly L residues of real geometry, the
five-chain complex `base_structure` cut after L residues, or repeated (copy k moved k x 250 Å) beyond its 815;
all chains designed, sequences random; `--file_batch_sizes` measures `train_file` too, first, in the same
process (one model load). Both go through `load_records`: parsed once, then read from the Arrow
cache in `work_dir`.

Output: one JSON line per measurement: device, world size, batch size, mean residues per structure, padding,
pairs/s, residues/s, matrix-multiply TFLOP/s, operators per micro-batch and the bytes they move per pair,
step-time percentiles, data-loading share of the step, peak memory (CUDA tensors, else process RSS), GPU
utilisation, and what must hold: encoder passes per micro-batch of each model, structure parses during the
steps. A length sweep ends with a line giving the exponent of step time and step memory in L (log-log slope;
1 = linear); `--find_max_length` gives the largest L that trains.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from Bio.Data.PDBData import protein_letters_3to1
from Bio.PDB import MMCIFIO
from Bio.PDB.StructureBuilder import StructureBuilder
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, RandomSampler, Sampler
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker
from trl import TrlParser

import dpo_inv.data.featurized
from dpo_inv.data.batches import ExampleDataset, LengthGroupedSampler, collate
from dpo_inv.data.dataset import RecordSet, load_records
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.weights import model_parse_options
from dpo_inv.structures.parse import AMINO_ACIDS, BACKBONE_ATOMS, parse_structure
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.graphs import Step
from dpo_inv.training.launch import return_freed_memory
from dpo_inv.training.loading import precompute_reference
from dpo_inv.training.loss import batch_ranks
from dpo_inv.training.trainer import build_accelerator, build_optimizer, build_step, load_models

ROOT = Path(__file__).resolve().parents[1]
THREE_LETTER = {letter: name for name, letter in protein_letters_3to1.items() if letter in AMINO_ACIDS}
COPY_SPACING = 250.0  # Å between copies of the base structure, which is smaller: copies do not touch


def _help(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass
class Options:
    """What to measure; the training itself is set by the `DPOConfig` fields."""

    steps: int = _help(20, "Timed micro-batches per measurement.")
    warmup: int = _help(2, "Untimed micro-batches first (allocator warm-up; torch.compile compiles here).")
    num_pairs: int = _help(4096, "Without --lengths: repeat the train_file's pairs to this many.")
    lengths: list[int] | None = _help(None, "Structure lengths in residues, e.g. 100 200 400 800 1500.")
    batch_sizes: list[int] | None = _help(None, "Per-device batches; default per_device_train_batch_size.")
    file_batch_sizes: list[int] | None = _help(
        None, "With --lengths: measure the train_file (repeated to num_pairs) too, first, at these batches."
    )
    min_seconds: float = _help(
        0.0,
        "Time micro-batches past --steps until this many seconds have passed (GPU utilisation is "
        "sampled every 0.2 s).",
    )
    length_grouping: bool = _help(True, "Length-grouped batches as in training; false: random batches.")
    find_max_length: bool = _help(False, "Find the longest structure that trains, at each batch size.")
    max_memory_gb: float | None = _help(
        None, "Memory budget of --find_max_length; default: the GPU's memory, on CPU 40%% of free RAM."
    )
    base_structure: str = _help("data/structures/1BD2.pdb.gz", "Real structure cut or repeated to a length.")
    work_dir: str = _help("outputs/benchmark", "Generated data files and their feature cache.")


# ---- data -------------------------------------------------------------------------------------------------


def write_if_changed(path: Path, text: str) -> Path:
    """Leave an identical file untouched: its cached features stay valid, and every rank may call this."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def scaled_pairs(train_file: str, num_pairs: int, work_dir: Path) -> Path:
    """The records of `train_file` repeated to `num_pairs` (structure paths made absolute)."""
    source = Path(train_file).resolve()
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    for row in rows:
        row["pdb_file"] = str((source.parent / row["pdb_file"]).resolve())
    text = "".join(json.dumps(rows[i % len(rows)]) + "\n" for i in range(num_pairs))
    return write_if_changed(work_dir / f"{source.stem}-x{num_pairs}.jsonl", text)


def write_structure(base: Path, length: int, path: Path) -> list[str]:
    """mmCIF of `length` residues (backbone atoms): the chains of `base` in file order, cut after `length`
    residues or repeated, copy k moved by k * COPY_SPACING Å along x and its chains named A1, B1, ...
    Returns the chain ids."""
    builder = StructureBuilder()
    builder.init_structure(path.stem)
    builder.init_model(0)
    base_chains, chains, left, copy = parse_structure(base).values(), [], length, 0
    while left > 0:
        for chain in base_chains:
            if left == 0:
                break
            chain_id = chain.chain_id + (str(copy) if copy else "")
            builder.init_chain(chain_id)
            builder.init_seg("    ")
            chains.append(chain_id)
            shift = np.array([copy * COPY_SPACING, 0.0, 0.0], dtype=np.float32)
            residues = zip(chain.sequence, chain.coords, chain.positions, strict=True)
            for letter, atoms, position in list(residues)[:left]:
                builder.init_residue(THREE_LETTER.get(letter, "UNK"), " ", int(position) + 1, " ")
                for name, xyz in zip(BACKBONE_ATOMS, atoms, strict=True):
                    if np.isfinite(xyz).all():
                        builder.init_atom(name, xyz + shift, 20.0, 1.0, " ", f" {name:<3}", element=name[0])
                left -= 1
        copy += 1
    writer, text = MMCIFIO(), io.StringIO()
    writer.set_structure(builder.get_structure())
    writer.save(text)
    write_if_changed(path, text.getvalue())
    return chains


def length_pairs(base: Path, length: int, num_pairs: int, work_dir: Path, seed: int) -> Path:
    """`num_pairs` pairs of random sequences designing every chain of one structure of `length` residues."""
    structure = work_dir / f"{base.name.split('.')[0]}-L{length}.cif"
    record = {"pdb_file": str(structure.resolve()), "design_chains": write_structure(base, length, structure)}
    rng = random.Random(seed)
    lines = []
    for _ in range(num_pairs):
        chosen, rejected = ("".join(rng.choices(AMINO_ACIDS, k=length)) for _ in range(2))
        lines.append(json.dumps({**record, "preferred_seq": chosen, "unpreferred_seq": rejected}) + "\n")
    return write_if_changed(work_dir / f"length-{length}-x{num_pairs}.jsonl", "".join(lines))


# ---- what must hold, counted during the timed steps -------------------------------------------------------

ENCODES: Counter[str] = Counter()  # encoder passes of the policy (train mode) and the reference (eval mode)
PARSES = multiprocessing.Value("i", 0)  # structure parses, in DataLoader workers (forked) too


def count_encoder_passes_and_parses() -> None:
    """Wrap `ProteinMPNN.encode` and the structure cache's `read_model` with counters."""
    encode, parse = ProteinMPNN.encode, dpo_inv.data.featurized.read_model

    def counted_encode(self: ProteinMPNN, *args, **kwargs):
        ENCODES["policy" if self.training else "reference"] += 1
        return encode(self, *args, **kwargs)

    def counted_parse(path):
        with PARSES.get_lock():
            PARSES.value += 1
        return parse(path)

    ProteinMPNN.encode = counted_encode
    dpo_inv.data.featurized.read_model = counted_parse


REGIONS = {"features": ".features", "encoder": "encoder_layers.", "decoder": ".decoder_layers."}


class OperatorCount(TorchDispatchMode):
    """The ATen operators that compute (views and reshapes, which launch nothing on a GPU, left out), how
    many of them are casts to another dtype (what autocast adds), and the bytes they move: each one's
    tensor inputs read and outputs written, once each, by region of the model (the structure features
    with their edge embedding, the encoder and decoder layers, the rest), forward and backward.

    The bytes are what an unfused step moves to and from memory, operator by operator, cache left aside: a
    gather counts its table and its output, an expanded input its distinct elements."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = self.casts = 0
        self.bytes: Counter[str] = Counter()
        self.tracker = ModuleTracker()

    def __enter__(self) -> OperatorCount:
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def region(self) -> str:
        parents = " ".join(self.tracker.parents)
        name = next((region for region, key in REGIONS.items() if key in parents), "rest")
        return f"{name}_{'backward' if self.tracker.is_bw else 'forward'}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (func.is_view or func is torch.ops.aten._unsafe_view.default):
            self.operators += 1
            if func is torch.ops.aten._to_copy.default:
                self.casts += kwargs.get("dtype", args[0].dtype) != args[0].dtype
            inputs = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.bytes[self.region()] += sum(map(stored_bytes, [*inputs.values(), *outputs]))
        return out


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``tensor`` (an expanded dimension, of stride 0, counts once)."""
    distinct = math.prod(n for n, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride)
    return distinct * tensor.element_size()


def counted_step(step: Step, count: OperatorCount, batch: dict, ranks: torch.Tensor) -> tuple:
    """`step` with its operators counted in `count`."""
    with count:
        return step(batch, ranks)


# ---- the device: synchronisation, memory, utilisation ---------------------------------------------------


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    return f"cpu ({model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def proc_value(file: str, key: str) -> float:
    """A `key: N kB` line of /proc/self/status or /proc/meminfo, in MiB (NaN where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path(file).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return math.nan


def reset_peak_memory(device: torch.device) -> float:
    """Start measuring a new peak; returns the memory in use now (MiB): CUDA tensors, else the process RSS."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    gc.collect()
    return_freed_memory()  # glibc: so that RSS is what is live
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS (VmHWM)
    return proc_value("/proc/self/status", "VmRSS")


def peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return proc_value("/proc/self/status", "VmHWM")


class Utilisation(threading.Thread):
    """Mean GPU utilisation, sampled every 0.2 s: torch.cuda.utilization (nvidia-ml-py) or nvidia-smi."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(daemon=True)
        self.device, self.samples, self.done = device, [], threading.Event()

    def sample(self) -> float | None:
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:
            query = ["nvidia-smi", f"--id={self.device.index or 0}", "--query-gpu=utilization.gpu",
                     "--format=csv,noheader,nounits"]  # fmt: skip
            try:
                return float(subprocess.run(query, capture_output=True, text=True, check=True).stdout)
            except (OSError, ValueError, subprocess.CalledProcessError):
                return None

    def run(self) -> None:
        while not self.done.wait(0.2) and (value := self.sample()) is not None:
            self.samples.append(value)

    def stop(self) -> float | None:
        self.done.set()
        self.join()
        return round(float(np.mean(self.samples)), 1) if self.samples else None


# ---- training, as dpo_inv.training.trainer does it ------------------------------------------------------


@dataclass
class Trainer:
    """What `dpo_inv.training.trainer.train` builds once: accelerator, policy, frozen reference, optimizer."""

    accelerator: Accelerator
    config: DPOConfig
    model: torch.nn.Module
    reference: torch.nn.Module | None  # with --use_peft, the policy with its adapters off
    optimizer: torch.optim.Optimizer


def build(config: DPOConfig) -> tuple[Trainer, str]:
    """The accelerator, models and optimizer, as `dpo_inv.training.trainer.train` builds them; and the
    set-up."""
    accelerator, setup = build_accelerator(config)
    set_seed(config.seed)
    model, reference = load_models(config, accelerator.device)
    optimizer = build_optimizer(config, model)  # with --use_peft, the adapters
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    return Trainer(accelerator, config, model, reference, optimizer), setup


def sampler(trainer: Trainer, dataset: ExampleDataset, batch_size: int, length_grouping: bool) -> Sampler:
    """The sampler of `dpo_inv.training.trainer` (length-grouped global batches, seeded), or seeded random
    batches."""
    global_batch, seed = batch_size * trainer.accelerator.num_processes, trainer.config.seed
    if length_grouping:
        return LengthGroupedSampler(dataset.lengths, global_batch, seed)
    return RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))


def train_loader(trainer: Trainer, data: RecordSet, batch_size: int, length_grouping: bool) -> DataLoader:
    """The training DataLoader of `dpo_inv.training.trainer`, prepared (sharded over the processes)."""
    accelerator, config = trainer.accelerator, trainer.config
    dataset = ExampleDataset(data)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler(trainer, dataset, batch_size, length_grouping),
        collate_fn=partial(collate, pad_to_multiple_of=config.pad_to_multiple_of),
        num_workers=config.dataloader_num_workers,
        pin_memory=accelerator.device.type == "cuda",
    )
    return accelerator.prepare(loader)


def micro_batch(trainer: Trainer, step: Step, batch: dict, epoch: int) -> None:
    """One micro-batch of the loop in `dpo_inv.training.trainer.train` (`step`: its `build_step`)."""
    accelerator, model, optimizer, config = (
        trainer.accelerator,
        trainer.model,
        trainer.optimizer,
        trainer.config,
    )
    ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
    with accelerator.accumulate(model):
        _, per_pair = step(batch, ranks)
        finite = bool(accelerator.gather_for_metrics(per_pair)["loss"].isfinite().all())
        if accelerator.sync_gradients:
            max_norm = trainer.config.max_grad_norm or math.inf
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            if finite and bool(grad_norm.isfinite()):
                optimizer.step()
        optimizer.zero_grad()


def epochs(loader: DataLoader) -> Iterator[tuple[int, dict]]:
    """(epoch, batch) for ever."""
    for epoch in range(sys.maxsize):
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch


# ---- the measurement --------------------------------------------------------------------------------------


def measure(trainer: Trainer, data: RecordSet, batch_size: int, options: Options) -> dict:
    """Time `options.steps` micro-batches after `options.warmup` untimed ones."""
    accelerator, config, device = trainer.accelerator, trainer.config, trainer.accelerator.device
    result: dict = {"per_device_batch_size": batch_size}
    reference = trainer.reference
    if config.precompute_ref_log_probs:  # the reference scores, once, the pairs the steps will draw
        needed = (options.warmup + options.steps) * batch_size * accelerator.num_processes
        if len(data.records) > needed:
            order = sampler(trainer, ExampleDataset(data), batch_size, options.length_grouping)
            data = replace(data, records=data.records.select(sorted(list(order)[:needed])))
        start = time.perf_counter()
        data = precompute_reference(accelerator, reference, data, config)
        result["precompute_pairs_per_second"] = round(len(data.records) / (time.perf_counter() - start), 2)
        reference = None  # as in training: no reference model in the steps
    step_function = build_step(config, trainer.model, reference, accelerator)
    stream = epochs(train_loader(trainer, data, batch_size, options.length_grouping))

    start, flops_per_residue, operators, moved = time.perf_counter(), None, None, None
    for step in range(options.warmup):
        epoch, batch = next(stream)
        if step == 0 and not (config.torch_compile or config.cuda_graphs):  # FLOPs and operators, both passes
            passes, everything = OperatorCount(), OperatorCount()
            with FlopCounterMode(display=False) as flops, everything:
                micro_batch(trainer, partial(counted_step, step_function, passes), batch, epoch)
            flops_per_residue = flops.get_total_flops() / int(batch["length"].sum())
            operators = {
                "forward_and_backward": passes.operators,
                "casts": passes.casts,
                "metrics_clipping_optimizer": everything.operators - passes.operators,
            }
            pairs_in_batch = len(batch["length"])
            moved = {region: round(n / pairs_in_batch / 1e6, 1) for region, n in sorted(passes.bytes.items())}
            moved["metrics_clipping_optimizer"] = round(
                (everything.bytes.total() - passes.bytes.total()) / pairs_in_batch / 1e6, 1
            )
            moved["total"] = round(everything.bytes.total() / pairs_in_batch / 1e6, 1)
        else:
            micro_batch(trainer, step_function, batch, epoch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result["warmup_seconds"] = round(time.perf_counter() - start, 2)

    memory_before = reset_peak_memory(device)
    utilisation = Utilisation(device) if device.type == "cuda" else None
    if utilisation is not None:
        utilisation.start()
    ENCODES.clear()
    parses_before = PARSES.value
    step_seconds, load_seconds, residues, padded, pairs = [], [], 0, 0, 0
    while len(step_seconds) < options.steps or sum(step_seconds) < options.min_seconds:
        start = time.perf_counter()
        epoch, batch = next(stream)
        loaded = time.perf_counter()
        micro_batch(trainer, step_function, batch, epoch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_seconds.append(time.perf_counter() - start)
        load_seconds.append(loaded - start)
        lengths = accelerator.gather(batch["length"].to(device)).cpu()  # unpadded, of all processes
        residues += int(lengths.sum())
        padded += int(batch["mask"].shape[1]) * len(lengths)
        pairs += len(lengths)
    seconds, total = np.array(step_seconds), sum(step_seconds)
    return {
        **result,
        "mean_residues_per_structure": round(residues / pairs, 1),
        "padding_fraction": round(1 - residues / padded, 4),
        "pairs_per_second": round(pairs / total, 3),
        "residues_per_second": round(residues / total, 1),
        "matmul_tflops_per_second": (
            round(flops_per_residue * residues / total / 1e12, 4) if flops_per_residue else None
        ),
        "step_seconds": {f"p{q}": round(float(np.percentile(seconds, q)), 4) for q in (10, 50, 90, 99)},
        "operators_per_step": operators,
        "megabytes_moved_per_pair": moved,
        "data_loading_share": round(sum(load_seconds) / total, 4),
        "peak_memory_mb": round(peak_memory(device), 1),
        "memory_before_steps_mb": round(memory_before, 1),
        "memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss",
        "gpu_utilization_percent": utilisation.stop() if utilisation is not None else None,
        "timed_steps": len(step_seconds),
        "encoder_passes_per_step": {
            name: ENCODES[name] / len(step_seconds) for name in ("policy", "reference")
        },
        "structure_parses_in_loop": PARSES.value - parses_before,
    }


def try_measure(trainer: Trainer, data: RecordSet, batch_size: int, options: Options) -> dict:
    """`measure`; running out of GPU memory is reported in the result."""
    try:
        return measure(trainer, data, batch_size, options)
    except torch.OutOfMemoryError as err:
        message = str(err).splitlines()[0]
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return {"per_device_batch_size": batch_size, "error": f"out of memory: {message}"}


def loglog_slope(x: list[float], y: list[float]) -> float | None:
    """The least-squares exponent p of y ~ x^p."""
    points = np.array([(a, b) for a, b in zip(x, y, strict=True) if a > 0 and b > 0])
    return round(float(np.polyfit(*np.log(points).T, 1)[0]), 3) if len(points) >= 2 else None


# ---- the three modes --------------------------------------------------------------------------------------


def main() -> None:
    parser = TrlParser(dataclass_types=[Options, DPOConfig], description=__doc__.split("\n\n")[0])
    options, config = parser.parse_args_and_config()
    datasets.disable_progress_bars()
    trainer, setup = build(config)
    accelerator = trainer.accelerator
    work_dir = Path(options.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    base = ROOT / options.base_structure  # an absolute path stays itself
    batch_sizes = options.batch_sizes or [config.per_device_train_batch_size]
    count_encoder_passes_and_parses()
    header = {
        "device": describe(accelerator.device),
        "torch": torch.__version__,
        "world_size": accelerator.num_processes,
        "setup": setup,
        "mixed_precision": config.mixed_precision,
        "fused_kernels": config.fused_kernels,
        "torch_compile": config.torch_compile,
        "precompute_ref_log_probs": config.precompute_ref_log_probs,
        "use_peft": config.use_peft,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "num_decoding_orders": config.num_decoding_orders,
        "dataloader_num_workers": config.dataloader_num_workers,
        "pin_memory": accelerator.device.type == "cuda",
        "length_grouping": options.length_grouping,
    }

    def emit(record: dict) -> None:
        if accelerator.is_main_process:
            print(json.dumps({**header, **record}), flush=True)

    def load(write: Callable[[], Path]) -> tuple[RecordSet, dict]:
        """Rank 0 writes the data file and parses its structures first; the others then read the cache."""
        start = time.perf_counter()
        with accelerator.main_process_first():
            options = model_parse_options(config.model_name_or_path, None, config.ligand_context)
            data = load_records(write(), cache_dir=config.cache_dir or work_dir / "cache", options=options)
        return data, {"data": data.source, "load_seconds": round(time.perf_counter() - start, 2)}

    if options.find_max_length:
        for batch_size in batch_sizes:
            num_pairs = 2 * batch_size * accelerator.num_processes  # a warm-up and a timed micro-batch

            def data_of_length(length: int, num_pairs: int = num_pairs) -> RecordSet:
                return load(lambda: length_pairs(base, length, num_pairs, work_dir, config.seed))[0]

            emit(find_max_length(trainer, options, batch_size, data_of_length))
        return
    if not options.lengths or options.file_batch_sizes:  # throughput on the (scaled-up) training file
        data, loaded = load(lambda: scaled_pairs(config.train_file, options.num_pairs, work_dir))
        for batch_size in options.file_batch_sizes or batch_sizes:
            emit({**loaded, **try_measure(trainer, data, batch_size, options)})
        del data
    if not options.lengths:
        return
    sweep: dict[int, list[dict]] = {batch_size: [] for batch_size in batch_sizes}
    num_pairs = (options.warmup + options.steps) * max(batch_sizes) * accelerator.num_processes
    for length in options.lengths:
        data, loaded = load(lambda n=length: length_pairs(base, n, num_pairs, work_dir, config.seed))
        for batch_size in batch_sizes:
            result = {"length": length, **try_measure(trainer, data, batch_size, options)}
            sweep[batch_size].append(result)
            emit({**loaded, **result})
    for batch_size, results in sweep.items():
        done = [r for r in results if "error" not in r]
        if len(done) >= 2:
            lengths = [r["length"] for r in done]
            times = [r["step_seconds"]["p50"] for r in done]
            memory = [round(r["peak_memory_mb"] - r["memory_before_steps_mb"], 1) for r in done]
            emit({"length_sweep": True, "per_device_batch_size": batch_size, "lengths": lengths,
                  "step_seconds_p50": times, "step_memory_mb": memory,
                  "time_exponent": loglog_slope(lengths, times),
                  "memory_exponent": loglog_slope(lengths, memory)})  # fmt: skip


def find_max_length(
    trainer: Trainer, options: Options, batch_size: int, data_of_length: Callable[[int], RecordSet]
) -> dict:
    """Double L from the first of `--lengths` (default 1000) until a step runs out of memory or over the
    budget, then bisect to within 2%. Each trial: one warm-up and one timed micro-batch."""
    device = trainer.accelerator.device
    if options.max_memory_gb is not None:
        budget = options.max_memory_gb * 1024
    elif device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory / 2**20
    else:
        budget = 0.4 * proc_value("/proc/meminfo", "MemAvailable")
    quick = replace(options, warmup=1, steps=1)
    good, bad, trials = 0, 0, []
    length = (options.lengths or [1000])[0]
    while length >= 1 and (not bad or bad - good > max(1, 0.02 * good)):
        result = try_measure(trainer, data_of_length(length), batch_size, quick)
        ok = "error" not in result and result["peak_memory_mb"] <= budget
        trial = {"length": length, "ok": ok, "error": result.get("error"),
                 "peak_memory_mb": result.get("peak_memory_mb"),
                 "step_seconds": result.get("step_seconds", {}).get("p50")}  # fmt: skip
        trials.append(trial)
        print(json.dumps(trial), file=sys.stderr, flush=True)
        good, bad = (length, bad) if ok else (good, length)
        length = 2 * length if not bad else (good + bad) // 2 if good else length // 2
    best = next((t for t in trials if t["length"] == good and t["ok"]), {})
    return {
        "find_max_length": True,
        "per_device_batch_size": batch_size,
        "max_length": good,
        "first_failing_length": bad,
        "memory_budget_mb": round(budget, 1),
        "peak_memory_mb_at_max": best.get("peak_memory_mb"),
        "step_seconds_at_max": best.get("step_seconds"),
        "trials": trials,
    }


if __name__ == "__main__":
    main()
