"""The starting model is its own reference in every precision: the reference's log-probabilities (live,
precomputed before training, in evaluation; a separate model, or a LoRA policy with its adapters off) are
computed as the policy's are, in its autocast, so the rewards and margins of the step-0 evaluation and of
the first training step (whose metrics come before any update) are exactly 0: the DPO loss is ln 2, KTO's
0.5 with a KL of 0."""

import json
import math
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from conftest import EXAMPLE

import dpo_inv

STRUCTURES = ("2xcjA", "1lpbA")  # the two shortest training structures (84 and 85 residues)
# the ways to train, the options of each, the file of its bundled records, and the loss of the starting model
KINDS = {
    "dpo": ({}, "pairs", math.log(2)),
    "precomputed": ({"precompute_ref_log_probs": True}, "pairs", math.log(2)),
    "lora": ({"use_peft": True}, "pairs", math.log(2)),  # the reference: the policy with its adapters off
    "lora-precomputed": ({"use_peft": True, "precompute_ref_log_probs": True}, "pairs", math.log(2)),
    "kto": ({"loss_type": ["kto"]}, "labels", 0.5),  # 1 - sigmoid(beta (0 - z0)), z0 = KL = 0
}


def records(folder: str, per_structure: int = 2) -> list[dict]:
    """The first `per_structure` records of each of STRUCTURES in the bundled `folder`/train.jsonl (pairs,
    or labelled sequences, desirable and undesirable in turn)."""
    rows: list[dict] = []
    for line in (EXAMPLE / folder / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        name = Path(row["pdb_file"]).name.split(".")[0]
        if name in STRUCTURES and sum(name in r["pdb_file"] for r in rows) < per_structure:
            rows.append({**row, "pdb_file": str((EXAMPLE / folder / row["pdb_file"]).resolve())})
    return rows


@pytest.fixture
def fresh_accelerator():
    """Each run builds its Accelerator, with its own precision, from scratch."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["no", pytest.param("bf16", marks=pytest.mark.slow)])  # 20 s emulated
def test_the_starting_model_has_zero_rewards(tmp_path, precision, kind, fresh_accelerator):
    options, folder, start_loss = KINDS[kind]
    rows = records(folder)
    config = dpo_inv.DPOConfig(
        output_dir=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "cache"),
        report_to="none",
        mixed_precision=precision,
        eval_split=0.0,
        max_steps=1,
        per_device_train_batch_size=len(rows),
        per_device_eval_batch_size=len(rows),
        logging_steps=1,
        eval_on_start=True,
        save_steps=100,
        **options,
    )
    dpo_inv.train(config, train_dataset=rows, eval_dataset=rows)
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evaluation, training = logged[0], logged[1]  # step 0's evaluation, the first step's training metrics
    assert evaluation["step"] == 0 and "eval_loss" in evaluation and training["step"] == 1
    for prefix, metrics in (("eval_", evaluation), ("", training)):
        assert metrics[f"{prefix}loss"] == pytest.approx(start_loss, abs=1e-6), (prefix, metrics)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(metrics[f"{prefix}{name}"]) < 1e-6, (prefix + name, metrics)
        if kind == "kto":
            assert metrics[f"{prefix}kl"] == 0.0, metrics
        else:  # no pair's margin is above 0: all are exactly 0
            assert metrics[f"{prefix}rewards/accuracies"] == 0.0, metrics
