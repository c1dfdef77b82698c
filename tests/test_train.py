"""End-to-end training runs on real data: outputs, checkpoints, exact resume, learning."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import EXAMPLE, ROOT, SHARED_DATA, needs_program, train_in_process
from safetensors.torch import load_file

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import load_records
from dpo_inv.models.weights import load_model
from dpo_inv.tools.score import ScoreConfig, score_file
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loading import RunData, split_by_structure
from dpo_inv.training.loss import batch_ranks, pair_logps
from dpo_inv.training.trainer import Steps, data_notes

SMALL_STRUCTURES = ("2xcjA", "1lpbA")  # 84 and 85 residues: quick to train on


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


ALONE = (sys.executable, "-m", "dpo_inv.run")  # a run in a process of its own


def run(
    tmp_path: Path, *args: str, command: tuple[str, ...] = (), extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Train, and assert it ended with status 0: in the test's process (`command_in_process`, from the
    repository's folder, with `extra_env` set while it runs), or in the processes `command` starts (ALONE, or
    a launcher that ends by running dpo_inv.run) where what a process does is what the test is about."""
    options = ("--cache_dir", str(tmp_path / "cache"), *args)
    if command:
        result = subprocess.run([*command, *options], cwd=ROOT, env={**env(tmp_path), **(extra_env or {})},
                                capture_output=True, text=True, timeout=900)  # fmt: skip
    else:
        with mock.patch.dict(os.environ, extra_env or {}):
            result = train_in_process(*options)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def small_pairs(tmp_path: Path, name: str = "small.jsonl", limit: int | None = None) -> Path:
    rows = []
    for line in (SHARED_DATA / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        if any(s in row["pdb_file"] for s in SMALL_STRUCTURES):
            rows.append({**row, "pdb_file": str((SHARED_DATA / row["pdb_file"]).resolve())})
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]))
    return path


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


COMMON = (
    "--eval_split", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
    "--max_steps", "6", "--learning_rate", "3e-4", "--warmup_steps", "2", "--logging_steps", "1",
    "--save_steps", "1", "--seed", "3",
)  # fmt: skip


@pytest.mark.slow
def test_resume_continues_exactly_and_old_checkpoints_are_pruned(tmp_path):
    data = small_pairs(tmp_path)  # 16 pairs: 4 optimizer steps per epoch, so step 6 is in epoch 2
    straight = tmp_path / "straight"
    run(
        tmp_path, "--train_file", str(data), "--output_dir", str(straight), "--save_total_limit", "4", *COMMON
    )
    checkpoints = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert checkpoints == ["step-3", "step-4", "step-5", "step-6"]
    for name in ("config.json", "model.safetensors", "proteinmpnn.pt"):
        assert (straight / "final" / name).is_file()
    assert (straight / "config.yaml").is_file()
    logged = metrics(straight)
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "grad_norm", "learning_rate", "epoch",
            "samples_per_second"} <= set(logged[0])  # fmt: skip
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at the start
    assert logged[-1]["epoch"] == pytest.approx(1.5)

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    result = run(
        tmp_path, "--train_file", str(data), "--output_dir", str(resumed), "--save_total_limit", "4",
        "--resume_from_checkpoint", "latest", *COMMON, command=ALONE,  # its log as a batch job's file has it
    )  # fmt: skip
    assert "Resumed from" in result.stdout + result.stderr
    assert_reads_well_in_a_log(result.stdout + result.stderr)
    assert [m["step"] for m in metrics(resumed)] == [4, 5, 6]
    for a, b in zip(logged[3:], metrics(resumed), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"])
    expected, actual = weights(straight / "final"), weights(resumed / "final")
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0)
    base = load_model("vanilla/v_48_020").state_dict()
    assert (
        max((expected[k] - base[k]).abs().max().item() for k in expected) > 1e-4
    )  # training moved the weights

    scored = subprocess.run(
        [sys.executable, "-m", "dpo_inv", "score", "--model", str(resumed / "final"), "--data", str(data),
         "--output", str(tmp_path / "scores.jsonl"), "--cache_dir", str(tmp_path / "cache")],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert_reads_well_in_a_log(scored.stdout + scored.stderr)
    assert json.loads(scored.stdout)["accuracy"] == round(json.loads(scored.stdout)["accuracy"], 4)


@pytest.mark.slow
def test_a_run_from_step_0_in_a_used_output_dir_logs_only_its_own_steps(tmp_path):
    """A run from step 0 where an earlier run wrote (not resuming, or resuming where that run saved no
    checkpoint yet) starts metrics.jsonl afresh: the file, and the curves `plot` draws from it, hold one run's
    steps, not the earlier run's followed by its own."""
    out = tmp_path / "out"
    args = ("--train_file", str(small_pairs(tmp_path, limit=8)), "--output_dir", str(out), *COMMON)
    args = (*args, "--max_steps", "2", "--save_steps", "2")

    def steps_and_losses() -> list[tuple[int, float]]:
        return [(m["step"], m["loss"]) for m in metrics(out)]

    run(tmp_path, *args)
    first = steps_and_losses()
    assert [step for step, _ in first] == [1, 2]
    run(tmp_path, *args)
    assert steps_and_losses() == first
    shutil.rmtree(out / "checkpoints")
    run(tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert steps_and_losses() == first


def assert_reads_well_in_a_log(log: str) -> None:
    """What a batch job's log file gets: lines, no progress-bar redraws, no bars of short work."""
    assert "\r" not in log
    for noise in ("Loading weights", "Writing model shards", "Saving the dataset", "Loading dataset"):
        assert noise not in log


@pytest.mark.slow
def test_training_learns_the_preference(tmp_path):
    """On held-out structures, reward accuracy rises well above the base model's and eval loss < log 2."""
    train_file, eval_file = EXAMPLE / "pairs" / "train.jsonl", EXAMPLE / "pairs" / "val.jsonl"
    base = load_model("vanilla/v_48_020")
    config = DPOConfig()
    data = ExampleDataset(load_records(eval_file, cache_dir=tmp_path / "cache"))
    with torch.no_grad():
        batch = collate([data[i] for i in range(len(data))])
        logps = pair_logps(base, batch, batch_ranks(batch, config.seed, 1, "random"))
    base_accuracy = (logps.chosen > logps.rejected).float().mean().item()

    output = tmp_path / "run"
    run(
        tmp_path, "--train_file", str(train_file), "--eval_file", str(eval_file), "--output_dir", str(output),
        "--max_steps", "12", "--eval_steps", "12", "--logging_steps", "4",
    )  # fmt: skip
    final = [m for m in metrics(output) if "eval_loss" in m][-1]
    assert final["eval_loss"] < math.log(2) - 0.05
    assert final["eval_rewards/accuracies"] >= base_accuracy + 0.15, (base_accuracy, final)
    assert 0.3 < final["eval_recovery"] < 0.7  # greedy decoding still recovers much of the native sequence
    assert (output / "best" / "model.safetensors").is_file()
    assert (output / "final" / "model.safetensors").is_file()
    plots = {p.name for p in (output / "plots").iterdir()}
    assert {"loss.png", "reward_accuracy.png", "reward_margin.png", "logps.png", "learning_rate.png"} <= plots

    # the score command reports the preference accuracy of the trainer's eval pass
    summary = score_file(
        ScoreConfig(data=str(eval_file), output=str(tmp_path / "scores.jsonl"), model=str(output / "final"),
                    reference="vanilla/v_48_020", seed=config.seed, cache_dir=str(tmp_path / "cache"))
    )  # fmt: skip
    assert summary["accuracy"] == pytest.approx(final["eval_rewards/accuracies"], abs=1e-4)


@pytest.mark.slow
def test_precomputed_reference_log_probs_give_the_same_training(tmp_path):
    data = small_pairs(tmp_path)
    args = ("--train_file", str(data), "--eval_file", str(data), "--per_device_train_batch_size", "4",
            "--max_steps", "2", "--logging_steps", "1", "--eval_steps", "2",
            "--num_decoding_orders", "2")  # fmt: skip
    run(tmp_path, *args, "--output_dir", str(tmp_path / "plain"))
    run(tmp_path, *args, "--output_dir", str(tmp_path / "pre"), "--precompute_ref_log_probs")
    plain, pre = metrics(tmp_path / "plain"), metrics(tmp_path / "pre")
    assert len(plain) == len(pre) == 3
    for a, b in zip(plain, pre, strict=True):
        for key in a:
            if key != "samples_per_second":
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_torch_compile_trains_as_eager_and_saves_plain_models(tmp_path):
    """The trainer's regional torch.compile: the same losses and weights, and saved models without the
    compiler's wrappers in their parameter names. Compiled kernels fuse and round differently from the
    eager reference (log-probs about 3e-6 relative apart), and in some runs the reference's first forward
    after a cold compile computes the neighbour distances of the rows of the second thread up to 3e-4
    apart (at batch 5, about one run in four: a first loss 1.9e-4 off ln 2), so the first step's loss is ln 2
    only to about 1e-4 relative here (once 3.2e-5 off).
    One update (the first step warms up from 0): Adam moves a weight whose gradient is near its epsilon by
    an amount that the last digits of that gradient decide, and a second update shows it."""
    needs_program("g++")
    args = ("--train_file", str(small_pairs(tmp_path, limit=4)), "--eval_split", "0", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-4", "--warmup_steps", "1",
            "--logging_steps", "1")  # fmt: skip
    run(tmp_path, *args, "--output_dir", str(tmp_path / "eager"))
    run(tmp_path, *args, "--output_dir", str(tmp_path / "compiled"), "--torch_compile", command=ALONE)
    for a, b in zip(metrics(tmp_path / "eager"), metrics(tmp_path / "compiled"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    eager, compiled = weights(tmp_path / "eager" / "final"), weights(tmp_path / "compiled" / "final")
    assert compiled.keys() == eager.keys() == load_model("vanilla/v_48_020").state_dict().keys()
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_trackers_write_their_logs(tmp_path):
    """tensorboard and wandb (offline) as a user asks for them: each writes its run."""
    output = tmp_path / "run"
    run(tmp_path, "--train_file", str(small_pairs(tmp_path, limit=4)), "--eval_split", "0",
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1",
        "--output_dir", str(output), "--report_to", "tensorboard", "wandb", "--run_name", "trackers",
        extra_env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"},
        command=ALONE)  # fmt: skip
    events = list((output / "trackers").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    wandb_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("*.wandb"))


def test_a_tracker_that_is_not_installed_stops_before_training(monkeypatch):
    import dpo_inv.training.config

    monkeypatch.setattr(dpo_inv.training.config, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"report_to wandb: not installed; pip install wandb \(the trackers"):
        DPOConfig(report_to=["wandb"])


def test_many_passes_and_a_split_that_leaves_few_structures_are_announced(tmp_path):
    """9 pairs on 3 structures, max_steps 100000: a 1,250-hour run, and eval_split 0.1 holds out a third."""
    rows = [json.loads(line) for line in (EXAMPLE / "pairs" / "train.jsonl").read_text().splitlines()]
    structures = list(dict.fromkeys(row["pdb_file"] for row in rows))[:3]
    nine = [row for s in structures for row in [r for r in rows if r["pdb_file"] == s][:3]]
    path = tmp_path / "nine.jsonl"
    path.write_text("".join(json.dumps({**r, "pdb_file": str(EXAMPLE / "pairs" / r["pdb_file"])}) + "\n"
                            for r in nine))  # fmt: skip
    config = DPOConfig(train_file=str(path), max_steps=100000)
    train, evaluation = split_by_structure(
        load_records(str(path), tmp_path / "cache"), config.eval_split, config.seed
    )
    data = RunData(train, evaluation)
    steps = Steps.plan(config, math.ceil(len(train.records) / config.per_device_train_batch_size))
    assert data_notes(config, data, steps) == [
        "100000 optimizer steps pass over the 6 training pairs 100000 times (more than 100), which overfits "
        "them; lower max_steps or give more data",
        "eval_split=0.1 held out 1 of 3 structures (3 pairs), leaving 2 to train on; give an eval_file, or "
        "eval_split 0 to train on all",
    ]
    hundred = dataclasses.replace(config, max_steps=100)  # 100 passes, no split: nothing to say
    assert data_notes(hundred, RunData(train), Steps.plan(hundred, 1)) == []


def test_plots_draw_a_small_change_small_and_rounds_as_integers(tmp_path):
    """The rounds' recovery went 0.4262, 0.4255, 0.4259: the axis spans a tenth of that, with no offset,
    and the rounds are whole numbers on it."""
    import matplotlib.pyplot as plt

    from dpo_inv.training.plot import plot_rounds, show_changes_at_scale

    figure, axes = plt.subplots()
    axes.plot([0, 1, 2], [0.4262, 0.4255, 0.4259])
    show_changes_at_scale(axes, [0.4262, 0.4255, 0.4259])
    low, high = axes.get_ylim()
    assert high - low == pytest.approx(0.04262) and low < 0.4255 and high > 0.4262
    figure.canvas.draw()
    assert axes.yaxis.get_offset_text().get_text() == ""
    plt.close(figure)
    rounds = [{"round": r, "mean_reward": -0.2 + r / 20, "median_reward": -0.2, "best_reward": 0.0,
               "recovery": 0.426 + r / 10_000, "diversity": 0.7} for r in range(3)]  # fmt: skip
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in rounds))
    assert plot_rounds(tmp_path).is_file()
