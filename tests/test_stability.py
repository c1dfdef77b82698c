"""Alignment on measured stability: scores to pairs to training, with held-out variants picking best/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, stability_rows, train_in_process
from test_train import env, metrics, run, weights

from dpo_inv.models.weights import load_model
from dpo_inv.tools.score import ScoreConfig, score_file
from dpo_inv.training.checkpoints import TrainerState
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.evaluation import update_best

EVAL_DOMAINS = ("2ysh_A_4-40", "2op7_A_1-39")


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def mean_spearman(tmp_path, model: str, data: str) -> float:
    summary = score_file(ScoreConfig(data=data, output=str(tmp_path / "scores.jsonl"), model=model,
                                cache_dir=str(tmp_path / "cache")))  # fmt: skip
    return summary["spearman_per_structure_mean"]


@pytest.mark.slow
def test_eval_spearman_picks_best_and_agrees_with_the_score_command(tmp_path):
    scored = write(tmp_path / "scored.jsonl", stability_rows(("2ysf_A_7-40",), 400, stride=1))
    pairs = tmp_path / "pairs.jsonl"
    built = subprocess.run(
        [sys.executable, "-m", "dpo_inv", "pairs", scored, "--output", str(pairs), "--strategy",
         "same_position", "--min_margin", "1", "--max_pairs_per_structure", "16", "--cache_dir",
         str(tmp_path / "cache")],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(built.stdout)["pairs"] == 16
    variants = write(tmp_path / "variants.jsonl", stability_rows(EVAL_DOMAINS, 40))
    output = tmp_path / "run"
    result = run(
        tmp_path, "--train_file", str(pairs), "--eval_split", "0", "--eval_variants_file", variants,
        "--eval_on_start", "--metric_for_best_model", "spearman", "--load_best_model_at_end",
        "--max_steps", "4", "--eval_steps", "2",
        "--per_device_train_batch_size", "4", "--learning_rate", "2e-3", "--beta", "1", "--warmup_steps", "0",
        "--output_dir", str(output),
    )  # fmt: skip
    evals = [m for m in metrics(output) if "eval_spearman" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert len({round(m["eval_spearman"], 4) for m in evals}) == 3  # training changed the ranking
    assert "mean Spearman per structure" in result.stdout + result.stderr

    # the trainer's eval_spearman is what the score command reports for the same model and file
    assert evals[0]["eval_spearman"] == pytest.approx(
        mean_spearman(tmp_path, "vanilla/v_48_020", variants), abs=1e-4
    )
    best = max(evals, key=lambda m: m["eval_spearman"])
    assert mean_spearman(tmp_path, str(output / "best"), variants) == pytest.approx(
        best["eval_spearman"], abs=1e-4
    )
    assert f"best eval_spearman {best['eval_spearman']:.4f} at step {best['step']}: that model saved" in (
        result.stdout + result.stderr
    )
    final = weights(output / "final")  # load_best_model_at_end: final/ is the best model
    for key, value in weights(output / "best").items():
        torch.testing.assert_close(final[key], value, atol=0, rtol=0)
    if best["step"] == 0:  # the starting model stays in best/ when training never beats it
        base = load_model("vanilla/v_48_020").state_dict()
        for key, value in weights(output / "best").items():
            torch.testing.assert_close(value, base[key])

    # design ability on the variants' backbones: the wild type's log p per residue is the score command's
    # for the first record of each domain (same seeded decoding order), and greedy recovery is logged
    rows = [json.loads(line) for line in Path(variants).read_text().splitlines()]
    natives = [{**r, "sequence": r["wildtype_seq"], "wildtype_seq": None} for r in rows]
    score_file(ScoreConfig(data=write(tmp_path / "natives.jsonl", natives), output=str(tmp_path / "n.jsonl"),
                           cache_dir=str(tmp_path / "cache")))  # fmt: skip
    scored = [json.loads(line) for line in (tmp_path / "n.jsonl").read_text().splitlines()]
    first = [next(r for r in scored if r["domain"] == domain) for domain in EVAL_DOMAINS]
    expected = sum(r["logp"] for r in first) / sum(r["logp"] / r["logp_per_residue"] for r in first)
    assert evals[0]["eval_native_logp"] == pytest.approx(expected, abs=1e-4)
    assert all(0.2 < m["eval_native_recovery"] < 0.8 for m in evals)
    assert "native recovery" in result.stdout + result.stderr


def test_recovery_tolerance_keeps_the_best_ranking_that_keeps_design_ability():
    config = DPOConfig(eval_split=0, eval_variants_file="v.jsonl", eval_on_start=True,
                       metric_for_best_model="spearman", recovery_tolerance=0.02)  # fmt: skip
    state = TrainerState()
    evals = [
        (0, 0.60, 0.45, True),
        (50, 0.70, 0.42, False),
        (100, 0.65, 0.44, True),
        (150, 0.64, 0.46, False),
    ]
    for step, spearman, recovery, better in evals:
        state.global_step = step
        metrics = {"eval_spearman": spearman, "eval_native_recovery": recovery}
        assert update_best(config, metrics, state) == better, step
    assert (state.start_recovery, state.best_metric, state.best_step) == (0.45, 0.65, 100)
    with pytest.raises(ValueError, match="recovery_tolerance needs eval_variants_file and eval_on_start"):
        DPOConfig(eval_split=0, eval_variants_file="v.jsonl", recovery_tolerance=0.02)


@pytest.mark.slow
def test_bad_variants_and_metric_options_stop_with_one_line(tmp_path):
    variants = stability_rows(EVAL_DOMAINS[:1], 3)
    variants[1] = {**variants[1], "label": "high"}
    del variants[2]["wildtype_seq"]
    path = write(tmp_path / "variants.jsonl", variants)
    command = ["--config", "configs/quick_test.yaml", "--output_dir", str(tmp_path / "out"),
               "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    result = train_in_process(*command, "--eval_variants_file", path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error = "python -m dpo_inv.run: error:"
    assert result.stderr.strip().splitlines()[-2:] == [
        f"{error} {path}:2: label must be a finite number (higher = better), got 'high'",
        f"{error} {path}:3: missing wildtype_seq: a labelled variant needs its wild type",
    ]
    result = train_in_process(*command, "--metric_for_best_model", "spearman")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("metric_for_best_model eval_spearman needs an eval_variants_file")
    )
