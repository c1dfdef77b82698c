"""Each speed optimisation of the training step leaves the loss what the plain path gives, on real pairs:
bf16 autocast, DataLoader workers, torch.compile, length bucketing, padding to a multiple, one encoder pass
per pair and model, precomputed reference log-probs, cached structure features, the O(L*K) autoregressive
mask, a step without host reads (what CUDA graphs capture).

Accelerators come from the trainer's own `build_accelerator`. Covered elsewhere (see docs/benchmarks.md):
the neighbour-space mask equals official ProteinMPNN's L x L permutation mask (test_model), decoding several
sequences and orders against one encoding equals separate decodes (test_model), the length-grouped sampler
reduces padding (test_data), precomputed reference log-probs and torch.compile give the same training run
(test_train).
"""

import copy
import ctypes
import math
import re
from dataclasses import replace

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import EXAMPLE, SHARED_DATA, needs_program
from test_train import small_pairs
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import dpo_inv.data.featurized
import dpo_inv.models.features
import dpo_inv.models.layers
import dpo_inv.structures.parse
from dpo_inv.data.batches import (
    REFERENCE_COLUMNS,
    ExampleDataset,
    LengthGroupedSampler,
    collate,
    structure_inputs,
)
from dpo_inv.data.dataset import load_records
from dpo_inv.data.design import prepare_design
from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import ALL_LINEAR, add_adapter
from dpo_inv.models.features import ProteinFeatures
from dpo_inv.models.layers import (
    DecLayer,
    EncLayer,
    MessageLayer,
    cuda_layer_norm_policy,
    use_activation_checkpointing,
)
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.weights import load_model, model_parse_options
from dpo_inv.structures.parse import parse_structure
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.evaluation import evaluate
from dpo_inv.training.launch import glibc
from dpo_inv.training.loading import RunData, precompute_reference
from dpo_inv.training.loss import batch_ranks, pair_logps
from dpo_inv.training.objective import step_metrics
from dpo_inv.training.trainer import build_accelerator, build_step, load_models, prepare_run

POLICY, REFERENCE = "vanilla/v_48_020", "vanilla/v_48_010"  # different weights: a loss that is not log 2
CONFIG = DPOConfig(model_name_or_path=POLICY, ref_model_name_or_path=REFERENCE)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 real pairs on two ~85-residue chains (2xcjA, 1lpbA)."""
    folder = tmp_path_factory.mktemp("speed")
    return load_records(small_pairs(folder), cache_dir=folder / "cache")


@pytest.fixture(scope="module")
def policy() -> ProteinMPNN:
    return load_model(POLICY, dropout=0.0).train()


@pytest.fixture(scope="module")
def reference() -> ProteinMPNN:
    return load_model(REFERENCE).eval().requires_grad_(False)


@pytest.fixture
def accelerator_for():
    """The trainer's Accelerator for a configuration. Accelerate keeps one state per process: each is built
    from scratch, and the state is cleared afterwards."""

    def build(config: DPOConfig):
        AcceleratorState._reset_state(reset_partial_state=True)
        return build_accelerator(config)[0]

    yield build
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_trainer_computes_values_below_the_least_normal_float_as_zero(accelerator_for):
    """x86 CPUs compute on subnormal floats (below 1.2e-38) about a hundred times slower than on others: from
    the trainer's Accelerator on, they are zeros."""
    torch.set_flush_denormal(False)
    subnormal = torch.tensor([1e-39, -1e-40])
    assert (subnormal * 1.0).ne(0).all()
    accelerator_for(CONFIG)
    assert torch.equal(subnormal * 1.0, torch.zeros(2))


def batch_of(data, indices) -> dict[str, torch.Tensor]:
    dataset = ExampleDataset(data)
    return collate([dataset[i] for i in indices])


def train_step(accelerator, policy, reference, batch, dtypes=None):
    """One training micro-batch as dpo_inv.training.trainer runs it, on a copy of the policy prepared by
    `accelerator`; returns (loss, per-pair metrics, flat gradient). `dtypes` collects the output layer's
    dtype."""
    model = accelerator.prepare(copy.deepcopy(policy))
    if dtypes is not None:
        model.W_out.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    loss, per_pair = step_metrics(CONFIG, model, reference, batch, epoch=0)
    accelerator.backward(loss)
    return loss.detach(), per_pair, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.slow  # 10 s where the CPU emulates bf16
def test_bf16_autocast_matches_fp32(data, policy, reference, accelerator_for):
    """The trainer's bf16 autocast against fp32 on one batch: log-probs, loss and gradient agree to bf16
    precision."""
    batch = batch_of(data, [0, 1, 8, 9])  # both structures
    loss, per_pair, gradient = train_step(accelerator_for(CONFIG), policy, reference, batch)
    dtypes = []
    loss16, per_pair16, gradient16 = train_step(
        accelerator_for(replace(CONFIG, mixed_precision="bf16")), policy, reference, batch, dtypes
    )
    assert dtypes == [torch.bfloat16]  # autocast is on

    # bf16 keeps 8 significant bits (relative rounding error up to 2^-8); a sum of per-residue log-probs,
    # all of one sign, keeps a relative error of that order: allow 2^-7, twice the rounding of one operation
    logps, logps16 = (
        torch.stack([pairs["logps/chosen"], pairs["logps/rejected"]], -1) for pairs in (per_pair, per_pair16)
    )
    assert not torch.equal(logps, logps16)
    assert ((logps16 - logps).abs() <= 2**-7 * logps.abs()).all(), (logps, logps16)
    # -logsigmoid is 1-Lipschitz, so the loss moves at most beta x the change of the DPO logits
    logits_change = ((logps16[:, 0] - logps16[:, 1]) - (logps[:, 0] - logps[:, 1])).abs().max()
    assert (loss16 - loss).abs() <= CONFIG.beta * logits_change + 1e-6
    assert torch.nn.functional.cosine_similarity(gradient, gradient16, dim=0) > 0.99
    assert float(gradient16.norm()) == pytest.approx(float(gradient.norm()), rel=0.05)


def test_edges_stay_in_bf16_where_autocast_runs_layer_norms_in_fp32(data, policy):
    """Under bf16 autocast the encoder writes its edges (the features', each layer's edge update) in bf16,
    with the same values, also under CUDA's autocast, which runs layer norms in fp32: that policy is
    emulated here on the CPU for `aten::layer_norm`. There `nn.LayerNorm` wrote them in fp32, which each next
    linear map read and rounded again."""
    inputs = structure_inputs(batch_of(data, [0, 8]))

    def encoded_edges() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return policy.encode(**inputs).h_E

    cpu_policy = encoded_edges()
    with cuda_layer_norm_policy():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.nn.LayerNorm(128)(torch.randn(3, 128, dtype=torch.bfloat16)).dtype == torch.float32
        cuda_policy = encoded_edges()
    assert cpu_policy.dtype == cuda_policy.dtype == torch.bfloat16
    assert torch.equal(cpu_policy, cuda_policy)


def test_edge_layer_norms_with_weights_in_bf16_as_cuda_takes_them(data, policy, monkeypatch):
    """Where a device's layer norm takes its weights only in its input's dtype (CUDA's), the edge layer norms
    round theirs to bf16: the encoder's edges stay within bf16 rounding of the fp32-weight ones, and the
    weights' gradients reach them in fp32."""
    inputs = structure_inputs(batch_of(data, [0, 8]))
    model = copy.deepcopy(policy)

    def encoded_edges() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model.encode(**inputs).h_E

    fp32_weights = encoded_edges().detach()
    monkeypatch.setattr(dpo_inv.models.layers, "weights_in_input_dtype", lambda device: True)
    edges = encoded_edges()
    assert edges.dtype == torch.bfloat16 and not torch.equal(edges, fp32_weights)
    assert float((edges.detach().float() - fp32_weights.float()).norm() / fp32_weights.float().norm()) < 2**-7
    edges.float().square().sum().backward()
    norm = model.encoder_layers[2].norm3
    assert norm.weight.grad.dtype == torch.float32 and norm.weight.grad.abs().sum() > 0


def test_dataloader_workers_give_the_same_batches_and_loss(data, policy, reference, accelerator_for):
    """Two DataLoader workers (with pinned memory on CUDA) give the main process's batches, over two epochs,
    and so its loss."""
    accelerator = accelerator_for(CONFIG)
    dataset = ExampleDataset(data)

    def batches(num_workers: int) -> list[dict[str, torch.Tensor]]:
        loader = DataLoader(
            dataset,
            batch_size=4,
            sampler=LengthGroupedSampler(dataset.lengths, 4, seed=0),
            collate_fn=collate,
            num_workers=num_workers,
            pin_memory=accelerator.device.type == "cuda",
        )
        loader = accelerator.prepare(loader)
        out = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            out.extend(loader)
        return out

    plain, workers = batches(0), batches(2)
    assert len(plain) == len(workers) == 8
    assert not torch.equal(plain[0]["index"], plain[4]["index"])  # epochs are shuffled differently
    for a, b in zip(plain, workers, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    with torch.no_grad():
        losses = [
            step_metrics(CONFIG, policy, reference, batch, epoch=0)[0] for batch in (plain[0], workers[0])
        ]
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_torch_compile_matches_eager_when_the_batch_shape_changes(data, policy, reference, accelerator_for):
    """The trainer's regional compilation with dynamic shapes: loss and every gradient as eager, for batches
    whose size and length change as length-grouped batches do (a whole training run: test_train), and with
    activation checkpointing the same as without; one graph
    for all the encoder layers, one for the decoder layers and one for the features, compiled once for every
    shape, each traced once (the layers' float constants specialised: as symbolic floats Dynamo would trace
    every region a second time). (A first batch of 3 or 4 structures would compile the features again for
    the next size: the graph takes the batch's size to be that of the coordinates' dimension of 3 or of the
    4 backbone atoms.)"""
    needs_program("g++")
    torch._dynamo.utils.compilation_time_metrics.clear()
    accelerator = accelerator_for(replace(CONFIG, torch_compile=True))
    compiled = accelerator.prepare(copy.deepcopy(policy))
    assert isinstance(compiled.encoder_layers[0], torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(compiled.decoder_layers[0], torch._dynamo.eval_frame.OptimizedModule)
    eager = copy.deepcopy(policy)
    try:
        for indices in ([8, 9, 10, 11, 12], [0, 1, 2, 3, 4, 5]):  # 5 pairs of 84 residues, then 6 of 85
            batch = batch_of(data, indices)
            results = []
            # the compiled layers checkpointed too: run again, compiled, in the backward pass
            for model, every in ((eager, None), (compiled, None), (compiled, 1)):
                use_activation_checkpointing(model, every)
                loss, _ = step_metrics(CONFIG, model, reference, batch, epoch=0)
                loss.backward()
                results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
                model.zero_grad(set_to_none=True)
            (loss, gradient), (compiled_loss, compiled_gradient), checkpointed = results
            torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
            scale = gradient.abs().max().clamp(min=1.0)
            assert (compiled_gradient - gradient).abs().max() <= 1e-4 * scale
            assert all(map(torch.equal, checkpointed, (compiled_loss, compiled_gradient)))
        for module in (EncLayer, DecLayer, ProteinFeatures):
            assert len(_debug_get_cache_entry_list(module.forward)) == 1, f"{module.__name__} recompiled"
        traced = torch._dynamo.utils.compilation_time_metrics
        assert "compile_attempt_1" not in traced, "a region was traced twice"
    finally:
        torch._dynamo.reset()


def saved_bytes_and_gradients(model: ProteinMPNN, batch: dict[str, torch.Tensor]) -> tuple[int, dict]:
    """What a training forward pass of `model` on `batch` keeps for its backward pass (bytes of autograd's
    saved tensors), and the gradients of both sequences' summed log-probabilities, from seed 0."""
    torch.manual_seed(0)
    kept = []
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.nbytes) or t, lambda t: t):
        logps = pair_logps(model, batch, batch_ranks(batch, 0, 1, "random"))
    (logps.chosen - 2 * logps.rejected).sum().backward()
    return sum(kept), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [POLICY, "ligand/v_32_010_25"])
def test_activation_checkpointing_keeps_a_fraction_and_gives_the_same_gradients(data, cache_dir, name):
    """activation_checkpointing (TRL's gradient_checkpointing): each checkpointed message-passing layer keeps
    only its inputs and runs again in the backward pass with the random state of its forward pass (the same
    dropout masks), so every gradient is the same to the bit; with every layer checkpointed ProteinMPNN's
    forward pass keeps a seventh of the bytes (LigandMPNN's, whose atom features are not in a layer and
    whose context layers recompute only their message MLPs, under two fifths), every second layer in
    between. Only the policy is checkpointed: not the reference."""
    if name == POLICY:
        batch = batch_of(data, [0, 8])
    else:
        options = model_parse_options(name)
        pairs = load_records(EXAMPLE / "ligand" / "train.jsonl", cache_dir=cache_dir, options=options)
        batch = batch_of(pairs, [0])
    model = load_model(name).train()  # with its dropout
    plain, gradients = saved_bytes_and_gradients(model, batch)
    fractions = {}
    for every in (1, 2):
        use_activation_checkpointing(model, every)
        saved, checkpointed = saved_bytes_and_gradients(model, batch)
        assert all(torch.equal(checkpointed[k], gradients[k]) for k in gradients), every
        fractions[every] = saved / plain
    use_activation_checkpointing(model, None)
    assert saved_bytes_and_gradients(model, batch)[0] == plain
    bound = 1 / 6 if name == POLICY else 2 / 5
    assert fractions[1] < bound < fractions[2] < 1, fractions

    every_second = '{"every_n_layers": 2}'  # TRL's names, and their options as JSON from the command line
    config = replace(CONFIG, model_name_or_path=name, ref_model_name_or_path=None,
                     gradient_checkpointing=True, gradient_checkpointing_kwargs=every_second)  # fmt: skip
    policy, reference = load_models(config, torch.device("cpu"))
    layers = [m for m in policy.modules() if isinstance(m, MessageLayer)]
    assert [layer.checkpointed for layer in layers] == [i % 2 == 0 for i in range(len(layers))]
    assert not any(getattr(m, "checkpointed", False) for m in reference.modules())


def test_activation_checkpointing_gives_lora_adapters_the_same_gradients(data):
    """LoRA adapters on every linear map, with their dropout on: each checkpointed layer runs its adapters
    again in the backward pass with the same dropout masks, so every adapter's gradient is the same to the
    bit; the frozen base weights get none."""
    batch = batch_of(data, [0, 8])
    model = add_adapter(load_model(POLICY), r=4, alpha=8, dropout=0.1, targets=ALL_LINEAR).train()
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # as after some training: zero B would leave A without a gradient
            torch.nn.init.normal_(parameter, std=0.05)
    adapters = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert len(adapters) > 60 and all("lora_" in name for name in adapters)
    _, gradients = saved_bytes_and_gradients(model, batch)
    use_activation_checkpointing(model, 1)
    assert sum(isinstance(m, MessageLayer) and m.checkpointed for m in model.modules()) == 6
    _, checkpointed = saved_bytes_and_gradients(model, batch)
    assert all(gradients[k] is None for k in gradients if k not in adapters)
    assert all(gradients[k].abs().sum() > 0 and torch.equal(checkpointed[k], gradients[k]) for k in adapters)


class Mallinfo2(ctypes.Structure):
    """glibc's malloc statistics (malloc.h)."""

    FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]


class HeapPeak(TorchDispatchMode):
    """The most bytes glibc's malloc had handed out and not taken back, read after each operator, above
    those it had at the start."""

    def __init__(self) -> None:
        super().__init__()
        self.mallinfo2 = glibc().mallinfo2
        self.mallinfo2.restype = Mallinfo2
        self.start = self.peak = self.in_use()

    def in_use(self) -> int:
        info = self.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.peak -= self.start


@pytest.mark.slow
@pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="reads glibc's mallinfo2")
def test_context_layers_compute_their_messages_in_chunks_where_that_saves_memory(cache_dir, monkeypatch):
    """LigandMPNN's context layers sum their messages over chunks of entries where their activations are not
    kept: in a checkpointed layer (which recomputes its message MLP chunk by chunk in the backward pass, not
    the whole layer) and in a pass without gradients on the CPU. Without gradients the log-probabilities are
    those of one chunk, to the bit; checkpointed, every gradient is the plain pass's to the bit but those the
    chunks sum (the context layers' first two linear maps, and the atom edges' projection folded into the
    first), within 1e-5 of the largest; the heap's peak falls by more than a fifth each time."""
    name = "ligand/v_32_010_25"
    options = model_parse_options(name)
    pairs = load_records(EXAMPLE / "ligand" / "train.jsonl", cache_dir=cache_dir, options=options)
    batch = batch_of(pairs, [0, 1])  # 1BC8: 2 x 2,325 atoms with 25 entries each
    model = load_model(name)

    def peak_and_logps(chunk_entries: int, grad: bool) -> tuple[int, torch.Tensor]:
        monkeypatch.setattr(dpo_inv.models.layers, "CHUNK_ENTRIES", chunk_entries)
        with torch.set_grad_enabled(grad), HeapPeak() as heap:
            logps = pair_logps(model, batch, batch_ranks(batch, 0, 1, "random"))
            if grad:
                (logps.chosen - 2 * logps.rejected).sum().backward()
        return heap.peak, torch.stack([logps.chosen, logps.rejected]).detach()

    model.eval()
    (whole, expected), (chunked, logps) = peak_and_logps(1 << 30, False), peak_and_logps(1 << 14, False)
    assert torch.equal(logps, expected) and chunked < 0.8 * whole, (chunked, whole)

    model.train()  # with its dropout
    peaks, gradients = [], []
    for every, chunk_entries in ((None, 1 << 30), (1, 1 << 30), (1, 1 << 14)):
        use_activation_checkpointing(model, every)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        peaks.append(peak_and_logps(chunk_entries, True)[0])
        gradients.append({k: p.grad for k, p in model.named_parameters()})
    summed_in_chunks = re.compile(r"y_context_encoder_layers\.\d\.W[12]\.|W_edges_y\.weight")
    assert any(summed_in_chunks.search(k) for k in gradients[0])
    for k, plain in gradients[0].items():
        assert torch.equal(gradients[1][k], plain), k
        if summed_in_chunks.search(k):
            assert (gradients[2][k] - plain).abs().max() <= 1e-5 * plain.abs().max(), k
        else:
            assert torch.equal(gradients[2][k], plain), k
    assert peaks[2] < 0.8 * peaks[1] < 0.64 * peaks[0], peaks


@pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="reads glibc's mallinfo2")
def test_the_neighbour_searches_hold_a_chunk_of_distances_at_a_time(monkeypatch):
    """The k-nearest-neighbour graph of 1BD2's 815 residues and each residue's 25 nearest context atoms in
    3mht (327 residues, 535 atoms), searched a chunk of rows at a time (SEARCH_CHUNK_DISTANCES): the
    graph and the atoms of one search, to the bit, with the heap's peak a quarter of one search's or less
    (that holds all L x L distances, about 32 bytes each)."""
    model = load_model("ligand/v_32_010_25")
    options = model_parse_options("ligand/v_32_010_25")

    def inputs(name: str) -> dict[str, torch.Tensor]:
        path = EXAMPLE / "structures" / name
        return collate([prepare_design(path, list(parse_structure(path, options)), [], {}, options).example])

    tcr, mht = inputs("1BD2.pdb.gz"), inputs("3mht.pdb.gz")
    context = (mht["context_xyz"], mht["context_element"], mht["context_mask"])
    assert tcr["mask"].shape[1] == 815 and mht["mask"].shape[1] == 327 and context[0].shape[1] == 535
    searches = {
        "1BD2": (model.features._dist, tcr["X"][:, :, 1], tcr["mask"]),
        "3mht atoms": (model.features.nearest_atoms, mht["X"], mht["mask"], *context),
    }
    for name, (search, *args) in searches.items():
        results = []
        for distances in (1 << 30, 1 << 15):
            monkeypatch.setattr(dpo_inv.models.features, "SEARCH_CHUNK_DISTANCES", distances)
            with torch.no_grad(), HeapPeak() as heap:
                found = search(*args)
            results.append((found, heap.peak))
        (whole, whole_peak), (chunked, chunked_peak) = results
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True)), name
        assert chunked_peak <= whole_peak / 4, (name, chunked_peak, whole_peak)


def test_padding_to_a_multiple_leaves_the_loss_and_gradients(data, policy, reference):
    """pad_to_multiple_of (batch shapes that repeat, for CUDA graphs): 85-residue pairs padded to 128 give
    the loss, metrics and every gradient of the unpadded batch."""
    dataset = ExampleDataset(data)
    results = []
    for multiple in (None, 64):
        batch = collate([dataset[i] for i in (0, 1, 8)], pad_to_multiple_of=multiple)
        model = copy.deepcopy(policy)
        loss, rows = step_metrics(CONFIG, model, reference, batch, epoch=0)
        loss.backward()
        results.append(
            (
                batch["mask"].shape[1],
                loss.detach(),
                rows,
                torch.cat([p.grad.flatten() for p in model.parameters()]),
            )
        )
    (length, loss, rows, gradient), (padded, padded_loss, padded_rows, padded_gradient) = results
    assert (length, padded) == (85, 128)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-6)
    for name, values in rows.items():
        torch.testing.assert_close(padded_rows[name], values, rtol=1e-5, atol=1e-5)
    assert (padded_gradient - gradient).abs().max() <= 1e-5 * gradient.abs().max()


class HostReads(TorchDispatchMode):
    """The operations that read a device value on the host or copy Python data to the device, which a CUDA
    graph cannot capture (and which stall an uncaptured GPU step)."""

    HOST = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "_unique2", "unique_dim"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.HOST:
            self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_step_cuda_graphs_capture_reads_nothing_on_the_host(data, policy, reference, accelerator_for):
    """What `cuda_graphs` captures — the trainer's step, forward and backward — reads no value on the host
    and copies no Python data to the device (the decoding ranks are its input), with the reference live or
    precomputed. (It is the plain step itself: the graphs replay it on a GPU, scripts/graphs_check.py.)"""
    batch = batch_of(data, [0, 1, 8, 9])
    ranks = batch_ranks(batch, CONFIG.seed, 1, "random")
    accelerator = accelerator_for(CONFIG)
    for config, ref in ((CONFIG, reference), (replace(CONFIG, precompute_ref_log_probs=True), None)):
        inputs = dict(batch)
        if ref is None:
            with torch.no_grad():
                logps = pair_logps(reference, batch, ranks)
            inputs.update(ref_chosen_logps=logps.chosen, ref_rejected_logps=logps.rejected)
        step = build_step(config, copy.deepcopy(policy), ref, accelerator)
        with HostReads() as reads:
            loss, rows = step(inputs, ranks)
        assert reads.calls == [], reads.calls
        assert loss.isfinite() and rows["loss"].shape == (4,)
    with pytest.raises(OptionError, match="cuda_graphs needs an NVIDIA GPU, not cpu: drop cuda_graphs"):
        accelerator_for(replace(CONFIG, cuda_graphs=True))
    for options, message in (
        (
            {"gradient_accumulation_steps": 2},
            "gradient_accumulation_steps: raise per_device_train_batch_size",
        ),
        ({"mixed_precision": "fp16"}, "mixed_precision fp16: use bf16"),
        ({"torch_compile": True}, "torch_compile: choose one"),
    ):
        with pytest.raises(OptionError, match=f"cuda_graphs does not go with {message}"):
            replace(CONFIG, cuda_graphs=True, **options)


def test_length_grouped_batches_score_each_pair_as_when_alone(policy, cache_dir):
    """A pair's log-probs do not depend on the batch it lands in nor on its padding: 8 val pairs on six
    chains of 118-169 residues, in batches grouped by length (as LengthGroupedSampler groups them within a
    mega-batch; that it reduces padding is tested in test_data), in mixed batches, and alone."""
    data = load_records(SHARED_DATA / "val.jsonl", cache_dir=cache_dir)
    data = replace(data, records=data.records.select([0, 1, 8, 13, 15, 22, 23, 30]))
    dataset = ExampleDataset(data)
    grouped = sorted(range(8), key=lambda i: -dataset.lengths[i])
    mixed = grouped[0::2] + grouped[1::2]
    model = copy.deepcopy(policy).eval()

    def scores(indices: list[int], batch_size: int = 4) -> dict[int, torch.Tensor]:
        out = {}
        for start in range(0, len(indices), batch_size):
            batch = collate([dataset[i] for i in indices[start : start + batch_size]])
            with torch.no_grad():
                logps = pair_logps(model, batch, batch_ranks(batch, CONFIG.seed, 2, "random"))
            for k, i in enumerate(batch["index"].tolist()):
                out[i] = torch.stack([logps.chosen[k], logps.rejected[k]])
        return out

    def padding(indices: list[int]) -> int:
        chunks = [dataset.lengths[indices[s : s + 4]] for s in range(0, len(indices), 4)]
        return sum(int(c.max() * len(c) - c.sum()) for c in chunks)

    assert 0 < padding(grouped) < padding(mixed)
    alone = scores(list(range(8)), batch_size=1)
    for batches in (grouped, mixed):
        for i, logps in scores(batches).items():
            torch.testing.assert_close(logps, alone[i], rtol=1e-5, atol=1e-4)


@pytest.fixture
def encoder_passes(monkeypatch):
    """(policy or reference, structures in the batch) of every ProteinMPNN.encode call, and the shape of the
    sequences of every decode call."""
    calls: dict[str, list] = {"encode": [], "decode": []}
    encode, decode = ProteinMPNN.encode, ProteinMPNN.decode

    def counted_encode(self, X, *args, **kwargs):
        calls["encode"].append(("policy" if self.training else "reference", X.shape[0]))
        return encode(self, X, *args, **kwargs)

    def counted_decode(self, enc, S, ranks):
        calls["decode"].append(tuple(S.shape))
        return decode(self, enc, S, ranks)

    monkeypatch.setattr(ProteinMPNN, "encode", counted_encode)
    monkeypatch.setattr(ProteinMPNN, "decode", counted_decode)
    return calls


@pytest.mark.parametrize("num_orders", [1, 3])
def test_one_encoder_pass_per_pair_and_model(data, policy, reference, encoder_passes, num_orders):
    config = DPOConfig(ref_model_name_or_path=REFERENCE, num_decoding_orders=num_orders)
    batch = batch_of(data, [0, 8, 9])  # both structures
    loss, _ = step_metrics(config, policy, reference, batch, epoch=0)
    loss.backward()
    policy.zero_grad(set_to_none=True)
    assert sorted(encoder_passes["encode"]) == [("policy", 3), ("reference", 3)]
    # both sequences under every decoding order are decoded at once against that one encoding
    L = batch["mask"].shape[1]
    assert encoder_passes["decode"] == [(3, 2 * num_orders, L), (3, 2 * num_orders, L)]


def test_precomputed_reference_runs_no_reference_forward_in_training(
    data, policy, reference, encoder_passes, accelerator_for
):
    """Each pair is scored by the reference once before training; training steps never run it, and give
    the loss of the on-the-fly reference (the whole training run: test_train)."""
    config = DPOConfig(ref_model_name_or_path=REFERENCE, precompute_ref_log_probs=True, num_decoding_orders=2)
    plain = replace(config, precompute_ref_log_probs=False)
    data = replace(data, records=data.records.select([0, 1, 8, 9]))  # both structures
    precomputed = precompute_reference(accelerator_for(config), reference, data, config)
    assert encoder_passes["encode"] == [("reference", 4)]  # one eval batch
    encoder_passes["encode"].clear()

    batch = batch_of(precomputed, range(4))
    loss, _ = step_metrics(config, policy, reference, batch, epoch=0)  # the reference is given, not used
    loss.backward()
    policy.zero_grad(set_to_none=True)
    assert encoder_passes["encode"] == [("policy", 4)]
    with torch.no_grad():
        expected, _ = step_metrics(plain, policy, reference, batch_of(data, range(4)), epoch=0)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_every_evaluation_reads_the_eval_pairs_reference_computed_once(
    data, policy, reference, accelerator_for, monkeypatch
):
    """The trainer scores the eval pairs with the reference once, before training, where the loss needs
    only its sums: an evaluation then runs no reference forward and gives, exactly, the metrics of the
    reference run live. ResiDPO (per-position reference terms) keeps the reference live."""
    encodes = []
    encode = ProteinMPNN.encode
    monkeypatch.setattr(
        ProteinMPNN,
        "encode",
        lambda self, X, *a, **k: encodes.append(self is reference) or encode(self, X, *a, **k),
    )
    config = replace(CONFIG, per_device_eval_batch_size=4)
    accelerator = accelerator_for(config)
    train, held_out = (
        replace(data, records=data.records.select(rows)) for rows in ([0, 8], [1, 2, 9, 10, 11])
    )
    run = prepare_run(accelerator, config, copy.deepcopy(policy), reference, RunData(train, held_out))
    assert encodes == [True, True]  # two eval batches, before training
    encodes.clear()
    once = evaluate(accelerator, config, run.model, run.reference, run.eval_loader, [])
    assert encodes == [False, False]
    live_loader = DataLoader(ExampleDataset(held_out), 4, collate_fn=collate)
    live = evaluate(accelerator, config, run.model, run.reference, live_loader, [])
    assert encodes[2:] == [False, True, False, True]
    assert math.isnan(once.pop("eval_recovery")) and math.isnan(live.pop("eval_recovery"))  # no structures
    assert once == live and once["eval_loss"] != pytest.approx(math.log(2))

    residpo = replace(config, loss_type=["residpo"])
    assert not residpo.reference_sums_only and config.reference_sums_only
    run = prepare_run(accelerator, residpo, copy.deepcopy(policy), reference, RunData(train, held_out))
    assert REFERENCE_COLUMNS[0] not in run.data.eval.records.column_names


def test_no_structure_is_parsed_after_the_first_load(tmp_path, monkeypatch):
    """Features come from the Arrow cache: a second load and every DataLoader epoch, in worker processes too,
    run without the parser."""
    parsed = []
    real = dpo_inv.data.featurized.read_model
    monkeypatch.setattr(dpo_inv.data.featurized, "read_model", lambda path: parsed.append(path) or real(path))
    path, cache = small_pairs(tmp_path), tmp_path / "cache"
    assert len(load_records(path, cache_dir=cache).structures) == len(parsed) == 2

    def refuse(path):
        raise AssertionError(f"parsed {path} after the first load")

    monkeypatch.setattr(dpo_inv.data.featurized, "read_model", refuse)
    monkeypatch.setattr(dpo_inv.structures.parse, "read_model", refuse)
    data = load_records(path, cache_dir=cache)
    assert all(f["filename"].startswith(str(cache)) for f in data.structures.cache_files)  # memory-mapped
    dataset = ExampleDataset(data)
    for num_workers in (0, 2):  # workers are forked with the refusing parser
        sampler = LengthGroupedSampler(dataset.lengths, 4, seed=0)
        loader = DataLoader(
            dataset, batch_size=4, sampler=sampler, collate_fn=collate, num_workers=num_workers
        )
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert sum(len(batch["index"]) for batch in loader) == 16


class ShapeRecorder(TorchDispatchMode):
    """The shapes of every tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


def test_decoder_and_its_backward_hold_no_length_by_length_tensor(data, policy):
    """The autoregressive mask lives in neighbour space, [B, L, K, N]: decoding, forward and backward, makes
    no L x L tensor, so its memory and time grow as L*K (only the encoder's k-NN search is L x L)."""
    batch = batch_of(data, [0, 1])
    L = batch["mask"].shape[1]
    model = copy.deepcopy(policy)
    enc = model.encode(batch["X"], batch["mask"], batch["residue_idx"], batch["chain_encoding"])
    ranks = batch_ranks(batch, CONFIG.seed, 2, "random")
    S = torch.stack([batch["chosen"], batch["rejected"]], 1).repeat_interleave(2, 1)
    with ShapeRecorder() as recorder:
        log_probs = model.decode(enc, S, ranks.repeat(1, 2, 1))
        log_probs.sum().backward()
    assert len(recorder.shapes) > 100
    assert not [shape for shape in recorder.shapes if list(shape).count(L) >= 2]
    k = model.config.k_neighbors
    assert (2, L, k, 4) in recorder.shapes  # the mask itself: [B, L, K, N sequences]
    assert math.prod(max(recorder.shapes, key=math.prod)) <= 2 * L * k * 4 * model.config.hidden_dim
