"""Configuration: YAML plus command-line overrides, validation, --help, the dpo-inv command."""

import math
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from dpo_inv.training.config import DPOConfig, parse_config


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"beta": 0.2, "loss_type": ["sigmoid", "hinge"], "loss_weights": [1, 0.5]})
    )
    config = parse_config(["--config", str(path), "--beta", "0.3", "--max_steps", "7", "--reference_free"])
    assert (config.beta, config.max_steps, config.reference_free) == (0.3, 7, True)
    assert config.loss_type == ["sigmoid", "hinge"] and config.loss_weights == [1.0, 0.5]


def test_a_single_value_where_a_list_is_expected(tmp_path):
    """`report_to: none` and `loss_type: ipo`, as Transformers and TRL users write them, in YAML too."""
    path = tmp_path / "c.yaml"
    path.write_text("report_to: none\nloss_type: ipo\nstructure_root: /data\n")
    config = parse_config(["--config", str(path)])
    assert (config.report_to, config.loss_type, config.structure_root) == (["none"], ["ipo"], ["/data"])
    config = parse_config(["--config", str(path), "--report_to", "none", "--loss_type", "sigmoid", "hinge"])
    assert (config.report_to, config.loss_type) == (["none"], ["sigmoid", "hinge"])


def test_an_unknown_tracker_stops_with_the_valid_names():
    result = subprocess.run([sys.executable, "-m", "dpo_inv.run", "--report_to", "tensorbord"],
                            cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "report_to ['tensorbord'] unknown; choose from none, all, aim, tensorboard, wandb" in last


def test_trl_names_and_the_rpo_alpha_alias():
    """rpo_alpha, TRL's former name, becomes TRL's current sft term weighted through loss_weights."""
    config = DPOConfig(loss_type=["sigmoid"], rpo_alpha=0.5)
    assert (config.loss_type, config.loss_weights, config.rpo_alpha) == (["sigmoid", "sft"], [1.0, 0.5], None)
    config = parse_config(["--loss_type", "kto", "--desirable_weight", "1.5", "--undesirable_weight", "0.5"])
    assert config.unpaired and (config.desirable_weight, config.undesirable_weight) == (1.5, 0.5)
    assert not DPOConfig(loss_type=["residpo", "sft"]).unpaired


def test_example_configs_parse():
    for name in ("example", "quick_test", "kto_example", "residpo_example"):
        config = parse_config(["--config", str(ROOT / "configs" / f"{name}.yaml")])
        assert (ROOT / config.train_file).is_file()
    config = parse_config(["--config", str(ROOT / "configs" / "stability.yaml")])
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


def test_metric_for_best_model_as_in_transformers():
    config = DPOConfig(metric_for_best_model="rewards/accuracies")
    assert (config.metric_for_best_model, config.greater_is_better) == ("eval_rewards/accuracies", True)
    assert (DPOConfig().metric_for_best_model, DPOConfig().greater_is_better) == ("eval_loss", False)
    only_variants = DPOConfig(eval_split=0, eval_variants_file="v.jsonl")
    assert (only_variants.metric_for_best_model, only_variants.greater_is_better) == ("eval_spearman", True)


def test_help_lists_every_field_with_its_default():
    result = subprocess.run([sys.executable, "-m", "dpo_inv.run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for name in DPOConfig.__dataclass_fields__:
        assert f"--{name}" in result.stdout
    assert "(default: 0.1)" in result.stdout


def test_dpo_inv_command():
    dpo_inv = ROOT / ".venv" / "bin" / "dpo-inv"
    command = [str(dpo_inv)] if dpo_inv.exists() else [sys.executable, "-m", "dpo_inv.cli"]
    result = subprocess.run([*command, "train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--model_name_or_path" in result.stdout
    result = subprocess.run([*command, "fly"], capture_output=True, text=True)
    assert result.returncode != 0 and "usage: dpo-inv" in result.stderr


def test_the_readme_says_how_long_the_example_trains():
    """The README's first screen names the example's optimizer steps: kept true when the config changes."""
    config = parse_config(["--config", str(ROOT / "configs" / "example.yaml")])
    pairs = len((ROOT / config.train_file).read_text().splitlines())
    steps = math.ceil(pairs / config.per_device_train_batch_size) * int(config.num_train_epochs)
    first_screen = (ROOT / "README.md").read_text().split("\n## ")[0]
    assert f"{steps} optimizer steps" in first_screen
