"""A TRL user's first hour: their config (a DPOConfig + ModelConfig YAML with LoRA, a cosine schedule and
tensorboard), their launch line and their habits work, or stop with one line that says what to write."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trl
import yaml
from conftest import ROOT
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import env, small_pairs

from dpo_inv.cli import parse
from dpo_inv.cli import run as run_command
from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import add_adapter, all_linear
from dpo_inv.models.weights import load_model
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.launch import check_processes_asked
from dpo_inv.training.loss import DPOOutput, PairLogps, reward_accuracies
from dpo_inv.training.trainer import build_optimizer
from dpo_inv.training.trl_options import NOT_APPLICABLE

DOCS = ROOT / "docs" / "training.md"


def config_of(*args: str) -> DPOConfig:
    return parse("train", list(args), "python -m dpo_inv.run")[0]


def refusal(capsys, *args: str) -> str:
    """The one line `python -m dpo_inv.run ARGS` stops with (exit status 2), before training."""
    with pytest.raises(SystemExit) as stopped:
        run_command("train", list(args), prog="python -m dpo_inv.run")
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def yaml_file(tmp_path: Path, **options) -> str:
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(options))
    return str(path)


def test_bf16_and_fp16_are_mixed_precision_in_either_spelling(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert config_of("--config", yaml_file(tmp_path, bf16=True)).mixed_precision == "bf16"
    assert config_of("--bf16", "true").mixed_precision == "bf16"
    assert config_of("--bf16").mixed_precision == "bf16"  # a flag alone, as TRL's scripts are run
    assert config_of("--bf16", "false").mixed_precision == "no"
    assert config_of("--mixed_precision", "bf16", "--bf16", "true").mixed_precision == "bf16"
    assert config_of().mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate launch --mixed_precision bf16
    assert config_of().mixed_precision == "bf16"
    assert config_of("--bf16", "false").mixed_precision == "no"
    for args, message in (
        (("--bf16", "true", "--fp16", "true"), "bf16 and fp16 are both true: choose one"),
        (("--bf16", "true", "--mixed_precision", "no"), "bf16 true and mixed_precision no disagree"),
        (("--fp16", "false", "--mixed_precision", "fp16"), "fp16 false and mixed_precision fp16 disagree"),
    ):
        assert message in refusal(capsys, *args)
    # the resolved configuration, written to config.yaml, reads back as it was, and takes an override
    written = yaml_file(tmp_path, **DPOConfig(bf16=True).to_dict())
    assert config_of("--config", written).mixed_precision == "bf16"
    assert config_of("--config", written, "--mixed_precision", "no").mixed_precision == "no"


def test_optim_takes_trls_names_of_adamw(capsys):
    """adamw_torch (the default) and TRL's adamw_torch_fused: one fused AdamW over the trained weights,
    whose steps are the loop's to a unit in the last place; another optimizer stops in one line."""
    assert config_of().optim == "adamw_torch"
    weights = {}
    for optim in ("adamw_torch_fused", "adamw_torch"):
        model = load_model("vanilla/v_48_020")
        config = config_of("--optim", optim, "--weight_decay", "0.01", "--adam_beta2", "0.99")
        optimizer = build_optimizer(config, model)
        assert optimizer.defaults["fused"] is (optim == "adamw_torch_fused")
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 1e-3
            optimizer.step()
        weights[optim] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(weights["adamw_torch_fused"], weights["adamw_torch"], rtol=3e-7, atol=3e-7)
    assert refusal(capsys, "--optim", "adafactor") == (
        "python -m dpo_inv.run: error: optim adafactor does not apply: dpo_inv trains with torch's AdamW, "
        "adamw_torch or adamw_torch_fused; its settings are adam_beta1, adam_beta2, adam_epsilon and "
        "weight_decay"
    )


def test_fp16_and_tf32_on_a_cpu_stop_before_training(capsys, tmp_path):
    out = ("--output_dir", str(tmp_path / "out"))
    assert "mixed_precision fp16 (fp16 true) needs a GPU: on a CPU use bf16" in refusal(
        capsys, "--fp16", *out
    )
    assert "tf32 true needs an NVIDIA GPU (Ampere or newer), not cpu: drop tf32" in refusal(
        capsys, "--tf32", "true", *out
    )
    assert not (tmp_path / "out").exists()


def test_strategies_as_transformers_takes_them(capsys):
    steps = config_of("--eval_strategy", "steps", "--save_strategy", "steps", "--logging_steps", "5")
    assert (steps.eval_steps, steps.save_steps) == (5, 500)  # Transformers' defaults
    default = config_of()
    assert (default.eval_strategy, default.save_strategy, default.logging_strategy) == (
        "epoch",
        "epoch",
        "steps",
    )
    given = config_of("--eval_steps", "3", "--save_steps", "4")
    assert (given.eval_strategy, given.eval_steps, given.save_strategy, given.save_steps) == (
        "steps",
        3,
        "steps",
        4,
    )
    assert config_of("--eval_strategy", "no", "--save_strategy", "no").eval_strategy == "no"
    assert "eval_steps 3 is for eval_strategy steps, not epoch" in refusal(
        capsys, "--eval_strategy", "epoch", "--eval_steps", "3"
    )
    assert "load_best_model_at_end needs evaluations" in refusal(
        capsys, "--eval_strategy", "no", "--load_best_model_at_end", "true"
    )
    assert dataclasses.replace(steps, seed=1).eval_steps == 5  # resolving twice changes nothing


def test_gradient_checkpointing_as_trls_recipes_write_it(tmp_path, capsys):
    recipe = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    config = config_of("--config", yaml_file(tmp_path, **recipe))
    assert (config.activation_checkpointing, config.checkpointed_every) == (True, 1)
    assert config.gradient_checkpointing is None and config.gradient_checkpointing_kwargs is None
    config = config_of("--gradient_checkpointing", "--gradient_checkpointing_kwargs", '{"every_n_layers": 2}')
    assert config.checkpointed_every == 2
    assert config_of("--activation_checkpointing", "true").checkpointed_every == 1
    assert config_of("--activation_checkpointing_kwargs", '{"every_n_layers": 2}').checkpointed_every is None
    refused = {
        ("--gradient_checkpointing_kwargs", '{"use_reentrant": true}'): "use_reentrant true: a layer takes",
        ("--activation_checkpointing_kwargs", '{"every_n_layers": 0}'): "every_n_layers must be a whole",
        ("--activation_checkpointing_kwargs", "{every_n_layers: 2}"): "is not JSON",
        ("--activation_checkpointing_kwargs", '{"offload": true}'): "dpo_inv takes every_n_layers and",
        ("--gradient_checkpointing", "false", "--activation_checkpointing"): "gradient_checkpointing and "
        "activation_checkpointing disagree",
        ("--fused_kernels", "true"): "activation_checkpointing and fused_kernels: the fused kernels already",
        ("--cuda_graphs", "true"): "cuda_graphs does not go with activation_checkpointing",
    }  # fmt: skip
    for args, message in refused.items():
        assert message in refusal(capsys, "--gradient_checkpointing", *args), args


def test_resume_true_warmup_fraction_and_adam_settings(tmp_path):
    assert (
        config_of("--config", yaml_file(tmp_path, resume_from_checkpoint=True)).resume_from_checkpoint
        == "latest"
    )
    assert config_of("--resume_from_checkpoint", "false").resume_from_checkpoint is None
    config = config_of("--warmup_steps", "0.1", "--adam_beta2", "0.98")
    assert (config.warmup(200), DPOConfig(warmup_steps=7).warmup(200), DPOConfig().warmup(200)) == (20, 7, 20)
    # 0 is no warm-up, as in Transformers: only an unset warmup_steps leaves it to warmup_ratio
    assert config_of("--warmup_steps", "0").warmup(200) == 0
    assert DPOConfig(warmup_steps=0, warmup_ratio=0.5).warmup(9) == 0
    with pytest.raises(OptionError, match="warmup_steps must be a whole number of steps, or below 1"):
        DPOConfig(warmup_steps=2.5)
    with pytest.raises(OptionError, match="adam_beta2 must be < 1"):
        DPOConfig(adam_beta2=1.0)


def test_trl_options_that_do_not_apply_say_why_in_a_file_and_on_the_command_line(tmp_path, capsys):
    cases = {
        "max_length": "max_length does not apply: no tokenizer",
        "padding_free": "padding_free does not apply: batches are padded to their longest structure",
        "ref_model": "ref_model does not apply: write ref_model_name_or_path",
        "activation_offloading": "activation_offloading does not apply: activations stay on the device",
    }
    for key, message in cases.items():
        path = yaml_file(tmp_path, **{key: 1})
        line = refusal(capsys, "--config", path)
        assert line == f"python -m dpo_inv.run: error: {path}: {key} does not apply: {NOT_APPLICABLE[key]}"
        assert message in line
        assert refusal(capsys, f"--{key}", "1") == f"python -m dpo_inv.run: error: --{line.split(': ', 3)[3]}"
    assert "unknown key padding_fre (did you mean padding_free?)" in refusal(
        capsys, "--config", yaml_file(tmp_path, padding_fre=True)
    )


def test_a_typo_on_the_command_line_is_not_taken_for_an_option(capsys):
    line = refusal(capsys, "--learnig_rate", "1e-4")
    assert line.endswith("error: unknown option --learnig_rate (did you mean --learning_rate?)")
    line = refusal(capsys, "--learning_rat", "1e-4")  # not argparse's prefix of --learning_rate
    assert line.endswith("error: unknown option --learning_rat (did you mean --learning_rate?)")


def test_the_docs_table_covers_every_option_of_trls_dpoconfig_and_modelconfig():
    rows = dict(
        re.findall(r"^\| `([a-z0-9_]+)` \| (used|translated|refused \| .*?) \|", DOCS.read_text(), re.M)
    )
    ours = {f.name for f in dataclasses.fields(DPOConfig)} | {"debug"}  # --debug is the runner's
    for cls in (trl.DPOConfig, trl.ModelConfig):
        for spec in dataclasses.fields(cls):
            assert spec.name in rows, f"docs/training.md has no row for TRL's {spec.name}"
            if spec.name in ours:
                assert rows[spec.name] in ("used", "translated"), spec.name
            else:
                assert rows[spec.name] == f"refused | {NOT_APPLICABLE[spec.name]}", spec.name
    assert {name for name, row in rows.items() if row.startswith("refused")} == set(NOT_APPLICABLE)
    assert not set(NOT_APPLICABLE) & ours


def test_all_linear_is_every_linear_map_but_the_output_head():
    model = load_model("vanilla/v_48_020")
    assert "W_out" not in all_linear(model) and "dense.W_out" in all_linear(model)
    linear = {f"base_model.model.{n}" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    adapted = add_adapter(model, 4, 8, 0.0, ["all-linear"])
    wrapped = {name.rsplit(".", 1)[0] for name, _ in adapted.named_modules() if name.endswith(".lora_A")}
    assert wrapped == linear - {"base_model.model.W_out"}


def test_rounding_is_not_counted_as_preference():
    """A policy that equals its reference but for rounding (the same model scored in other batches or
    kernels) has accuracy 0; a margin above rounding counts."""
    reference = PairLogps(
        torch.tensor([-150.0, -90.0]), torch.tensor([-152.0, -91.0]), torch.tensor([100, 60])
    )
    for shift, expected in ((3e-5, [0.0, 0.0]), (-3e-5, [0.0, 0.0]), (0.0, [0.0, 0.0]), (1e-2, [1.0, 1.0])):
        policy = PairLogps(reference.chosen + shift, reference.rejected.clone(), reference.num_positions)
        out = DPOOutput(torch.zeros(2), 0.1 * (policy.chosen - reference.chosen), torch.zeros(2))
        assert reward_accuracies(out, policy, reference, 0.1).tolist() == expected, shift
        assert (out.chosen_rewards > out.rejected_rewards).float().tolist() == [float(shift > 0)] * 2


def test_accelerate_launch_asking_for_two_processes_names_the_line_that_starts_them():
    """The single-process launcher of `accelerate launch --num_processes 2` as the parent: the line."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "/venv/bin/accelerate",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "-m",
            "dpo_inv.run",
            "--config",
            "my.yaml",
        ]  # fmt: skip
    )
    try:
        while not Path(f"/proc/{parent.pid}/cmdline").read_bytes():  # until it runs Python
            time.sleep(0.01)
        with pytest.raises(OptionError) as refused:
            check_processes_asked(1, parent.pid)
        check_processes_asked(2, parent.pid)  # the processes asked for are running
        check_processes_asked(1, os.getpid())  # not started by accelerate launch
    finally:
        parent.kill()
        parent.wait()
    assert str(refused.value) == (
        "accelerate launch --num_processes 2 started 1 process(es): without several GPUs, Accelerate starts "
        "one unless given --multi_gpu (on a CPU: gloo); run: accelerate launch --multi_gpu --num_processes 2 "
        "-m dpo_inv.run --config my.yaml"
    )


@pytest.mark.slow
def test_accelerate_launch_num_processes_as_users_write_it(tmp_path):
    """`accelerate launch --num_processes 2 -m dpo_inv.run --config my.yaml` on a CPU machine stops at
    once with the line that starts two processes."""
    config = yaml_file(tmp_path, train_file=str(small_pairs(tmp_path, limit=4)), max_steps=1,
                       output_dir=str(tmp_path / "out"))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "dpo_inv.run",
         "--config", config],  # fmt: skip
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "error: accelerate launch --num_processes 2 started 1 process(es): without several GPUs, Accelerate "
        f"starts one unless given --multi_gpu (on a CPU: gloo); run: accelerate launch --multi_gpu "
        f"--num_processes 2 -m dpo_inv.run --config {config}"
    ) in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_trl_users_config_trains_resumes_and_reports_as_trl_does(tmp_path):
    """The issue's YAML: LoRA on all linear maps, cosine, tensorboard, TRL's strategies, resume true."""
    output = tmp_path / "out"
    options = {
        "model_name_or_path": "vanilla/v_48_020", "use_peft": True, "lora_r": 8, "lora_alpha": 16,
        "lora_target_modules": "all-linear", "train_file": str(small_pairs(tmp_path, limit=6)),
        "eval_file": str(small_pairs(tmp_path, "eval.jsonl", limit=4)), "per_device_train_batch_size": 2,
        "learning_rate": 1e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "bf16": False,
        "max_steps": 2, "logging_strategy": "steps", "logging_steps": 1, "eval_strategy": "steps",
        "eval_steps": 2, "eval_on_start": True, "save_strategy": "steps", "save_steps": 2,
        "report_to": "tensorboard", "run_name": "trl_user", "output_dir": str(output),
        "resume_from_checkpoint": True, "cache_dir": str(tmp_path / "cache"),
    }  # fmt: skip
    command = [sys.executable, "-m", "dpo_inv.run", "--config", yaml_file(tmp_path, **options)]
    first = subprocess.run(command, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "No checkpoint in" in first.stdout and "starting from step 0" in first.stdout
    assert (
        "LoRA r=8 alpha=16 on W1 W11 W12 W13 W2 W3 W_e W_in dense.W_out edge_embedding linear" in first.stdout
    )
    logged = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    start, step1 = logged[0], next(m for m in logged if m["step"] == 1 and "loss" in m)
    assert start["step"] == 0 and start["eval_rewards/margins"] == 0 and start["eval_rewards/accuracies"] == 0
    assert step1["rewards/margins"] == 0 and step1["rewards/accuracies"] == 0  # before any update
    events = EventAccumulator(str(next((output / "trl_user").glob("events.out.tfevents.*")))).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/rewards/accuracies", "eval/loss", "eval/rewards/accuracies"} <= tags
    card = (output / "final" / "README.md").read_text()
    for said in ("base_model: vanilla/v_48_020", "library_name: peft", "a LoRA adapter (r 8, alpha 16) of",
                 "fine-tuned by DPO with dpo_inv on 6 preference pairs of 1 structure (", "| 2 (",
                 "| eval_loss |", "Cite DPO as", "Cite ProteinMPNN as"):  # fmt: skip
        assert said in card, said
    options["max_steps"] = 3  # the same line again, one step further: resumes from the checkpoint
    second = subprocess.run(
        [sys.executable, "-m", "dpo_inv.run", "--config", yaml_file(tmp_path, **options)],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Resumed from {output / 'checkpoints' / 'step-2'} at step 2" in second.stdout
