"""Configuration: YAML plus command-line overrides, validation, --help, the dpo-inv command."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, command_in_process, train_in_process

import dpo_inv
from dpo_inv.cli import parse
from dpo_inv.commands import COMMANDS
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.exits import EXIT_BAD_INPUT


def parse_train(args: list[str]) -> DPOConfig:
    return parse("train", args)[0]


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"beta": 0.2, "loss_type": ["sigmoid", "hinge"], "loss_weights": [1, 0.5]})
    )
    config = parse_train(["--config", str(path), "--beta", "0.3", "--max_steps", "7", "--reference_free"])
    assert (config.beta, config.max_steps, config.reference_free) == (0.3, 7, True)
    assert config.loss_type == ["sigmoid", "hinge"] and config.loss_weights == [1.0, 0.5]


def test_a_single_value_where_a_list_is_expected(tmp_path):
    """`report_to: none` and `loss_type: ipo`, as Transformers and TRL users write them, in YAML too."""
    path = tmp_path / "c.yaml"
    path.write_text("report_to: none\nloss_type: ipo\nstructure_root: /data\n")
    config = parse_train(["--config", str(path)])
    assert (config.report_to, config.loss_type, config.structure_root) == (["none"], ["ipo"], ["/data"])
    config = parse_train(["--config", str(path), "--report_to", "none", "--loss_type", "sigmoid", "hinge"])
    assert (config.report_to, config.loss_type) == (["none"], ["sigmoid", "hinge"])


def test_an_unknown_tracker_stops_with_the_valid_names():
    result = train_in_process("--report_to", "tensorbord")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "report_to ['tensorbord'] unknown; choose from none, all, aim, tensorboard, wandb" in last


def test_trl_names_and_the_rpo_alpha_alias():
    """rpo_alpha, TRL's former name, becomes TRL's current sft term weighted through loss_weights."""
    config = DPOConfig(loss_type=["sigmoid"], rpo_alpha=0.5)
    assert (config.loss_type, config.loss_weights, config.rpo_alpha) == (["sigmoid", "sft"], [1.0, 0.5], None)
    config = parse_train(["--loss_type", "kto", "--desirable_weight", "1.5", "--undesirable_weight", "0.5"])
    assert config.unpaired and (config.desirable_weight, config.undesirable_weight) == (1.5, 0.5)
    assert not DPOConfig(loss_type=["residpo", "sft"]).unpaired


def test_example_configs_parse():
    for name in ("example", "quick_test", "kto_example", "residpo_example"):
        config = parse_train(["--config", str(ROOT / "configs" / f"{name}.yaml")])
        assert (ROOT / config.train_file).is_file()
    config = parse_train(["--config", str(ROOT / "configs" / "stability.yaml")])
    assert config.metric_for_best_model == "eval_spearman" and config.load_best_model_at_end


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loss_type": ["dpo"]}, "loss_type"),
        ({"loss_type": ["kto", "sigmoid"]}, "stands alone"),
        ({"loss_type": ["kto"], "precompute_ref_log_probs": True}, "needs the reference model"),
        ({"loss_type": ["kto"], "reference_free": True}, "needs the reference model"),
        ({"loss_type": ["residpo"], "precompute_ref_log_probs": True}, "per-position reference"),
        ({"residue_constraint_weight": 0.1}, "belongs to loss_type residpo"),
        ({"loss_type": ["sigmoid", "sft"], "rpo_alpha": 1.0}, "not both"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "one weight per loss_type"),
        ({"reference_free": True, "precompute_ref_log_probs": True}, "exclude each other"),
        ({"loss_type": ["robust"], "label_smoothing": 0.5}, "label_smoothing"),
        ({"metric_for_best_model": "spearman"}, "needs an eval_variants_file"),
        ({"metric_for_best_model": "accuracy"}, "eval_accuracy unknown; choose from eval_loss"),
        (
            {"eval_split": 0, "eval_variants_file": "v.jsonl", "metric_for_best_model": "loss"},
            "needs eval pairs",
        ),
    ],
)
def test_invalid_combinations(fields, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(**fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beta": -0.1}, "beta must be > 0, got -0.1"),
        ({"beta": 0}, "beta must be > 0"),
        ({"learning_rate": -1e-5}, "learning_rate must be > 0"),
        ({"loss_weights": [1.0, -1.0], "loss_type": ["sigmoid", "sft"]}, "loss_weights must be >= 0"),
        ({"rpo_alpha": -0.5}, "rpo_alpha must be >= 0"),
        ({"loss_weights": [0.0]}, "nothing would be trained"),
        ({"loss_type": ["kto"], "desirable_weight": 0, "undesirable_weight": 0}, "nothing would be trained"),
        ({"label_smoothing": 0.6}, "label_smoothing must be < 0.5"),
        ({"weight_decay": -0.01}, "weight_decay must be >= 0"),
        ({"eval_split": 1.0}, "eval_split must be < 1"),
        ({"warmup_ratio": 1.5}, "warmup_ratio must be <= 1"),
        ({"num_train_epochs": 0}, "num_train_epochs must be > 0"),
        ({"max_steps": 0}, "max_steps must be > 0, or -1"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be > 0"),
        ({"num_decoding_orders": 0}, "num_decoding_orders must be > 0"),
        ({"backbone_noise": float("nan")}, "backbone_noise must be >= 0"),
        ({"max_grad_norm": -1}, "max_grad_norm must be >= 0"),
    ],
)
def test_settings_that_would_train_the_wrong_thing_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DPOConfig(**fields)


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("dpo_inv.run", ["--beta", "-0.1"], "beta must be > 0, got -0.1"),
        ("dpo_inv rounds", ["--sampling_temperature", "-1"], "sampling_temperature must be >= 0, got -1.0"),
        ("dpo_inv score", ["--data", "x", "--output", "y", "--num_orders", "0"],
         "num_orders must be > 0, got 0"),
        ("dpo_inv sample", ["--structure", "x", "--output_dir", "o", "--seed", "-1"],
         "seed must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_commands_refuse_them_in_one_line(module, args, message):
    config = ["--config", str(ROOT / "configs" / "rounds_example.yaml")] if module == "dpo_inv rounds" else []
    if module == "dpo_inv.run":
        result = train_in_process(*config, *args)
    else:
        result = command_in_process(module.removeprefix("dpo_inv "), *config, *args)
    assert result.returncode == 2
    assert result.stderr == f"python -m {module}: error: {message}\n"


def test_a_typo_in_the_yaml_file_is_one_line_naming_the_closest_option(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("learning_rat: 1.0e-4\nbeta: 0.2\nsavesteps: 5\nzzz: 1\n")
    result = train_in_process("--config", str(path))
    assert result.returncode == 2
    assert result.stderr == (
        f"python -m dpo_inv.run: error: {path}: unknown key learning_rat (did you mean learning_rate?), "
        "savesteps (did you mean save_steps?), zzz\n"
    )


def test_metric_for_best_model_as_in_transformers():
    config = DPOConfig(metric_for_best_model="rewards/accuracies")
    assert (config.metric_for_best_model, config.greater_is_better) == ("eval_rewards/accuracies", True)
    assert (DPOConfig().metric_for_best_model, DPOConfig().greater_is_better) == ("eval_loss", False)
    only_variants = DPOConfig(eval_split=0, eval_variants_file="v.jsonl")
    assert (only_variants.metric_for_best_model, only_variants.greater_is_better) == ("eval_spearman", True)


@pytest.mark.slow
def test_help_lists_every_field_with_its_default():
    result = subprocess.run([sys.executable, "-m", "dpo_inv.run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for name in DPOConfig.__dataclass_fields__:
        assert f"--{name}" in result.stdout
    assert "(default: 0.1)" in result.stdout
    assert result.stdout.startswith("usage: python -m dpo_inv.run [--config FILE.yaml]")
    assert "--no_ligand_context, --no-ligand-context\n" + 24 * " " + "Turn --ligand_context off.\n" in (
        result.stdout
    )


@pytest.mark.slow
def test_every_command_has_a_description_and_its_name():
    """Each command's `--help` as `python -m dpo_inv` prints it: usage, description, negations; all
    commands in one process (a process each would import torch for each)."""
    commands = [command for command in COMMANDS if command != "train"]
    probe = (
        "import contextlib, io, json, sys\nfrom dpo_inv.commands import main\nhelp = {}\n"
        "for command in sys.argv[1:]:\n    out = io.StringIO()\n"
        "    try:\n        with contextlib.redirect_stdout(out):\n"
        "            main([command, '--help'], 'python -m dpo_inv')\n"
        "    except SystemExit as end:\n        help[command] = (end.code, out.getvalue())\n"
        "print(json.dumps(help))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, *commands], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout)
    assert list(printed) == commands
    for command, (status, text) in printed.items():
        assert status == 0, command
        usage, _, rest = text.partition("\n\n")
        assert usage.startswith(f"usage: python -m dpo_inv {command} ")
        assert rest.startswith(f"`python -m dpo_inv {command}")
        negations = re.findall(r"--no_(\w+), --no-[\w-]+\n\s+(.*)\n", text)
        assert negations or command in ("pairs", "propose", "plot", "scan", "merge")  # none on by default
        assert all(line == f"Turn --{name} off." for name, line in negations)


@pytest.mark.slow
def test_dpo_inv_command():
    """The installed script and `python -m dpo_inv`, each with its own name in the usage line."""
    for command, name in (([str(Path(sys.executable).with_name("dpo-inv"))], "dpo-inv"),
                          ([sys.executable, "-m", "dpo_inv"], "python -m dpo_inv")):  # fmt: skip
        result = subprocess.run([*command, "train", "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "--model_name_or_path" in result.stdout
        assert result.stdout.startswith(f"usage: {name} train ")
    result = subprocess.run([*command, "fly"], capture_output=True, text=True)
    assert result.returncode == EXIT_BAD_INPUT and "usage: python -m dpo_inv COMMAND" in result.stderr


def test_the_front_door_lists_every_command_and_imports_no_torch():
    """`--help` a line per command, `--version`, and a mistyped command named with the closest one, exit
    2: quick, because none of them imports torch (or anything else of the package's work)."""
    probe = (
        "import sys\nfrom dpo_inv.commands import main\ntry:\n    main(sys.argv[1:], 'dpo-inv')\n"
        "except SystemExit as end:\n    print('status', end.code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    run = {args: subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
           for args in (("--help",), ("--version",), ("socre",), ())}  # fmt: skip
    assert all(result.stderr.endswith(" False\n") for result in run.values())  # torch never imported
    listed = re.findall(r"^  (\w+) +\S", run[("--help",)].stdout, re.MULTILINE)
    assert listed == list(COMMANDS) and run[("--help",)].stderr == "status 0 False\n"
    assert run[("--version",)].stdout == f"dpo_inv {dpo_inv.__version__}\n"
    assert run[("socre",)].stderr.splitlines()[-2:] == [
        "dpo-inv: error: unknown command 'socre' (did you mean score?)",
        f"status {EXIT_BAD_INPUT} False",
    ]
    assert "dpo-inv: error: no command given; choose from train, score, scan," in run[()].stderr


def test_the_readme_says_how_long_the_example_trains():
    """The README's first screen names the example's optimizer steps: kept true when the config changes."""
    config = parse_train(["--config", str(ROOT / "configs" / "example.yaml")])
    pairs = len((ROOT / config.train_file).read_text().splitlines())
    steps = math.ceil(pairs / config.per_device_train_batch_size) * int(config.num_train_epochs)
    first_screen = (ROOT / "README.md").read_text().split("\n## ")[0]
    assert f"{steps} optimizer steps" in first_screen
