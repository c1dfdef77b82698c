"""A designer's round trip from a folder of one's own, with relative paths and no file edited: sample,
score the samples, make pairs, train, sample again with the trained model."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, STRUCTURES, command_in_process


def command(cwd: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m dpo_inv NAME ...` in the folder ``cwd``."""
    result = command_in_process(name, *args, cwd=cwd)
    assert result.returncode == 0, (name, result.stderr[-2000:])
    return result


@pytest.mark.slow
def test_sample_score_pairs_train_sample_from_another_folder(tmp_path):
    work = tmp_path / "project"
    (work / "structures").mkdir(parents=True)
    shutil.copy(STRUCTURES / "2xcjA.pdb.gz", work / "structures")
    assert not work.is_relative_to(ROOT)
    cache = ("--cache_dir", "cache")
    command(work, "sample", "--structure", "structures/2xcjA.pdb.gz", "--num_samples", "6",
            "--temperature", "1", "--output_dir", "designs")  # fmt: skip
    command(work, "score", "--data", "designs/samples.jsonl", "--output", "scored/samples.jsonl", *cache)
    scored = [json.loads(line) for line in (work / "scored" / "samples.jsonl").read_text().splitlines()]
    assert [row["structure"] for row in scored] == ["../structures/2xcjA.pdb.gz"] * 6
    summary = json.loads(command(work, "pairs", "scored/samples.jsonl", "--output", "pairs/train.jsonl",
                                 "--score_field", "logp", *cache).stdout)  # fmt: skip
    assert summary["pairs"] == 3
    trained = command(work, "train", "--train_file", "pairs/train.jsonl", "--max_steps", "2",
                      "--per_device_train_batch_size", "2", "--output_dir", "runs/dpo", *cache)  # fmt: skip
    assert "Note: eval_split=0.1 holds out whole structures and the training data has one" in trained.stdout
    command(work, "sample", "--model", "runs/dpo/final", "--structure", "structures/2xcjA.pdb.gz",
            "--num_samples", "2", "--output_dir", "designs-2")  # fmt: skip
    again = [json.loads(line) for line in (work / "designs-2" / "samples.jsonl").read_text().splitlines()]
    assert len(again) == 2 and all(len(row["sequence"]) == 84 for row in again)
