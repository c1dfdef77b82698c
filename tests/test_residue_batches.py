"""Micro-batches measured in residues (per_device_train_batch_residues), on the bundled pairs: the budget,
every pair once per epoch, seeded and resumable order, one and two processes, bad values; the note that
tells a GPU run of small micro-batches what fills the device."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard
from conftest import EXAMPLE, train_in_process
from test_distributed import free_port, launchers
from test_train import metrics, run, weights

import dpo_inv.training.trainer
from dpo_inv.data.batches import ExampleDataset, ResidueBatchSampler, collate
from dpo_inv.data.dataset import load_records
from dpo_inv.errors import OptionError
from dpo_inv.models.weights import load_model
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loading import RunData
from dpo_inv.training.trainer import (
    BF16_EMULATED,
    FP32_ON_A_GPU,
    Steps,
    data_notes,
    device_notes,
    train_batches,
)

PAIRS = EXAMPLE / "pairs" / "train.jsonl"  # 146 pairs on 20 structures of 84 to 173 residues
SMALL = ("2xcjA", "1lpbA")  # 84 and 85 residues, 8 pairs each


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return load_records(str(PAIRS), cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def lengths(records) -> np.ndarray:
    return ExampleDataset(records).lengths


def epoch_batches(sampler: ResidueBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("budget", [150, 600, 2000, 10000])
def test_each_micro_batch_fits_the_budget_and_an_epoch_has_every_pair_once(lengths, budget):
    """150 is below 10 of the 20 structures: each of their pairs is a micro-batch alone."""
    sampler = ResidueBatchSampler(lengths, budget, seed=0)
    for epoch in range(3):
        batches = epoch_batches(sampler, epoch)
        assert len(batches) == len(sampler)  # the same number in every epoch
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        longest = [int(lengths[batch].max()) for batch in batches]
        assert all(len(b) * n <= budget or len(b) == 1 for b, n in zip(batches, longest, strict=True))
        # as many as fit: every micro-batch but the shortest structures' last is full
        assert sum(len(b) < max(1, budget // n) for b, n in zip(batches, longest, strict=True)) <= 1
        assert longest[0] == lengths.max()  # a device too small for the longest fails at the first step
    if budget == 150:
        assert sum(len(b) == 1 for b in batches) >= int((lengths > 150).sum())


@pytest.mark.parametrize("processes", [2, 3])
def test_with_several_processes_each_rank_gets_as_many_pairs_within_the_budget(lengths, processes):
    budget = 600
    sampler = ResidueBatchSampler(lengths, budget, seed=0, num_processes=processes)
    batches = epoch_batches(sampler, 1)
    assert len(batches) == len(sampler) and len(batches) % processes == 0
    steps = [batches[i : i + processes] for i in range(0, len(batches), processes)]
    for step in steps:
        assert len({len(batch) for batch in step}) == 1  # what the collectives of a step need
        assert all(len(b) * lengths[b].max() <= budget for b in step)
        in_turn = [i for j in range(len(step[0])) for i in (batch[j] for batch in step)]
        if len(set(in_turn)) == len(in_turn):  # the ranks take the longest-first examples in turn
            assert np.all(np.diff(lengths[in_turn]) <= 0)
    seen = [i for batch in batches for i in batch]
    assert set(seen) == set(range(len(lengths)))
    assert len(seen) - len(lengths) < processes  # the last global batch filled up with a few repeats

    # Accelerate deals rank r the r-th micro-batch of each step, every rank as many
    shards = [list(BatchSamplerShard(sampler, processes, r)) for r in range(processes)]
    assert [len(shard) for shard in shards] == [len(steps)] * processes
    assert all(shard == [step[r] for step in steps] for r, shard in enumerate(shards))


def test_the_same_seed_and_epoch_give_the_same_batches(lengths):
    """A resumed run builds its sampler anew: it must cut the same batches in the same order."""
    first, again = ResidueBatchSampler(lengths, 1000, seed=7), ResidueBatchSampler(lengths, 1000, seed=7)
    assert epoch_batches(first, 2) == epoch_batches(again, 2)
    assert epoch_batches(first, 2) != epoch_batches(first, 3)
    assert epoch_batches(first, 2) != epoch_batches(ResidueBatchSampler(lengths, 1000, seed=8), 2)


def test_the_trainer_loader_skips_and_sets_the_epoch_through_accelerate(records, lengths):
    """The DataLoader the trainer builds, as Accelerate wraps it for rank 1 of 2: set_epoch reaches the
    sampler, and skipping the first batches (resume) leaves the rest of the epoch as it was."""
    config = DPOConfig(per_device_train_batch_residues=800, seed=3)
    options = train_batches(config, lengths, num_processes=2)
    sampler = options["batch_sampler"]
    loader = DataLoaderShard(
        ExampleDataset(records), batch_sampler=BatchSamplerShard(sampler, 2, 1), collate_fn=collate
    )
    loader.set_epoch(4)
    assert sampler.sampler.epoch == 4
    whole = [batch["index"].tolist() for batch in loader]
    assert whole == list(sampler)[1::2]
    assert len(loader) == len(whole)
    assert all(len(b) * lengths[b].max() <= 800 for b in whole)
    from accelerate import skip_first_batches

    rest = [batch["index"].tolist() for batch in skip_first_batches(loader, 3)]
    assert rest == whole[3:]


def test_structures_longer_than_the_budget_are_announced_once(records):
    config = DPOConfig(per_device_train_batch_residues=150, eval_split=0)
    notes = data_notes(config, RunData(records), Steps.plan(config, 100))
    assert notes == [
        "10 training structure(s) longer than per_device_train_batch_residues 150 (the longest: 173 "
        "residues): each of their pairs is a micro-batch alone"
    ]
    assert data_notes(DPOConfig(eval_split=0), RunData(records), Steps.plan(config, 100)) == []


def test_a_run_that_leaves_a_gpu_idle_is_told_what_fills_it(records, monkeypatch):
    """The start-up notes of a run on CUDA (decided from the device, no GPU needed): fp32 on a GPU that
    computes bf16, and micro-batches of the default 8 pairs, about 1,100 residues here, against the 10,000 or
    more that fill an H100; nothing once the run is in bf16 with batches of residues, or of 64 pairs; on a
    CPU, bf16 only where emulated."""
    data, cuda, cpu = RunData(records), torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: not including_emulation)
    assert device_notes(DPOConfig(eval_split=0), data, cuda) == [
        FP32_ON_A_GPU,
        "a micro-batch of 8 pairs holds about 1,107 residues (structures of 138 on average), a fraction of "
        "what fills a GPU: --per_device_train_batch_residues 10000 or more "
        "(docs/training.md#batches-measured-in-residues)",
    ]
    for filled in ({"per_device_train_batch_residues": 10000}, {"per_device_train_batch_size": 64}):
        assert device_notes(DPOConfig(mixed_precision="bf16", **filled), data, cuda) == []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: False)  # a V100
    assert device_notes(DPOConfig(per_device_train_batch_size=64), data, cuda) == []
    assert device_notes(DPOConfig(), data, cpu) == []
    for native, notes in ((True, []), (False, [BF16_EMULATED])):
        monkeypatch.setattr(dpo_inv.training.trainer, "cpu_computes_bf16", lambda native=native: native)
        assert device_notes(DPOConfig(mixed_precision="bf16"), data, cpu) == notes


@pytest.mark.parametrize("value", [0, -100])
def test_a_budget_of_no_residues_is_refused(value):
    with pytest.raises(
        OptionError, match=re.escape(f"per_device_train_batch_residues must be > 0, got {value}")
    ):
        DPOConfig(per_device_train_batch_residues=value)


def test_the_command_refuses_it_in_one_line():
    result = train_in_process("--per_device_train_batch_residues", "0")
    assert result.returncode == 2
    assert (
        result.stderr == "python -m dpo_inv.run: error: per_device_train_batch_residues must be > 0, got 0\n"
    )


def small_pairs(tmp_path: Path) -> Path:
    """The 16 bundled pairs on the two smallest structures, with absolute structure paths."""
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    path = tmp_path / "small.jsonl"
    path.write_text(
        "".join(
            json.dumps({**row, "pdb_file": str((PAIRS.parent / row["pdb_file"]).resolve())}) + "\n"
            for row in rows
            if any(name in row["pdb_file"] for name in SMALL)
        )
    )
    return path


def data_order(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "data_order.jsonl").read_text().splitlines()]


# 300 residues: 3 pairs of 84-85 residues a micro-batch, 6 micro-batches (3 steps) an epoch; step 5 is in the
# second epoch, and step 2 ends mid-epoch, so the resumed run skips the epoch's first 4 micro-batches
COMMON = ("--eval_split", "0", "--per_device_train_batch_residues", "300", "--gradient_accumulation_steps",
          "2", "--max_steps", "5", "--learning_rate", "3e-4", "--warmup_steps", "1", "--logging_steps", "1",
          "--save_steps", "1", "--save_total_limit", "5", "--seed", "3", "--log_data_order")  # fmt: skip


@pytest.mark.slow
def test_a_run_with_residue_batches_trains_and_resumes_exactly(tmp_path):
    data = small_pairs(tmp_path)
    straight = tmp_path / "straight"
    result = run(tmp_path, "--train_file", str(data), "--output_dir", str(straight), *COMMON)
    log = result.stdout + result.stderr
    assert "batch 300 residues per device (examples × longest length; 2.7 pairs on average), global " in log
    assert "global batch 600 residues; 5 optimizer steps" in log
    order = data_order(straight)
    assert [(line["epoch"], line["batch"]) for line in order] == [(0, b) for b in range(6)] + [
        (1, b) for b in range(4)
    ]
    assert sorted(i for line in order[:6] for i in line["indices"][0]) == list(range(16))
    assert sorted(len(line["indices"][0]) for line in order[:6]) == [1, 3, 3, 3, 3, 3]
    logged = metrics(straight)
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5]
    assert logged[2]["epoch"] == pytest.approx(1.0)

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    result = run(tmp_path, "--train_file", str(data), "--output_dir", str(resumed),
                 "--resume_from_checkpoint", "latest", *COMMON)  # fmt: skip
    assert "Resumed from" in result.stdout + result.stderr
    assert data_order(resumed) == order[4:]  # the same batches, from where the checkpoint left off
    assert [m["step"] for m in metrics(resumed)] == [3, 4, 5]
    for a, b in zip(logged[2:], metrics(resumed), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"])
    expected, actual = weights(straight / "final"), weights(resumed / "final")
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0)
    base = load_model("vanilla/v_48_020").state_dict()
    assert max((expected[k] - base[k]).abs().max().item() for k in expected) > 1e-4  # it trained


@pytest.mark.slow
def test_two_processes_train_on_residue_batches_of_equal_counts(tmp_path):
    """accelerate launch, 2 CPU processes (gloo): 300 residues each, the 16 pairs dealt 3+3, 3+3, 2+2."""
    command, extra_env = launchers(free_port())["accelerate"]
    output = tmp_path / "out"
    result = run(tmp_path, "--train_file", str(small_pairs(tmp_path)), "--output_dir", str(output),
                 "--eval_split", "0", "--per_device_train_batch_residues", "300", "--max_steps", "3",
                 "--logging_steps", "1", "--seed", "5", "--log_data_order",
                 command=command, extra_env=extra_env)  # fmt: skip
    log = result.stdout + result.stderr
    assert "2 process(es) on cpu" in log and "Parameters identical on all 2 process(es)" in log
    assert "batch 300 residues per device" in log and "global batch 600 residues; 3 optimizer steps" in log
    order = [line["indices"] for line in data_order(output)]
    assert sorted([len(rank) for rank in ranks] for ranks in order) == [[2, 2], [3, 3], [3, 3]]
    assert sorted(i for ranks in order for rank in ranks for i in rank) == list(range(16))
    assert [m["step"] for m in metrics(output)] == [1, 2, 3]
