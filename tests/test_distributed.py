"""Real two-process runs on CPU (gloo): the same training as one process with the same global batch."""

import socket
import sys

import pytest
import torch
from test_train import metrics, run, small_pairs, weights


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun() -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        free_port(),
    )


def accelerate_launch() -> tuple[str, ...]:
    """Accelerate starts several local processes through torchrun only with --multi_gpu (its --cpu flag
    means one process, or mpirun with a host file); on a machine without GPUs dpo_inv then uses gloo."""
    return (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", free_port())  # fmt: skip


COMMON = ("--max_steps", "4", "--learning_rate", "3e-4", "--warmup_steps", "0", "--logging_steps", "1",
          "--eval_steps", "4", "--per_device_eval_batch_size", "2", "--seed", "5")  # fmt: skip


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    train, evaluation = small_pairs(tmp_path), small_pairs(tmp_path, "eval.jsonl", limit=7)
    output = tmp_path / "out"
    run(tmp_path, "--train_file", str(train), "--eval_file", str(evaluation), "--output_dir", str(output),
        "--per_device_train_batch_size", "4", *COMMON)  # fmt: skip
    return train, evaluation, output


@pytest.mark.parametrize("launcher", [torchrun, accelerate_launch], ids=["torchrun", "accelerate"])
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, single_process, launcher):
    train, evaluation, single = single_process
    output = tmp_path / "out"
    result = run(tmp_path, "--train_file", str(train), "--eval_file", str(evaluation), "--output_dir",
                 str(output), "--per_device_train_batch_size", "2", *COMMON, launcher=launcher())  # fmt: skip
    assert "2 process(es)" in result.stdout + result.stderr
    one, two = metrics(single), metrics(output)
    assert [m["step"] for m in two] == [m["step"] for m in one]  # rank 0 alone wrote metrics.jsonl
    for a, b in zip(one, two, strict=True):
        for key in a:
            if key not in ("pairs_per_second",):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    evals = [m for m in two if "eval_loss" in m]
    assert len(evals) == 1 and evals[0]["eval_logps/chosen"] < 0  # 7 eval pairs, each counted once
    expected, actual = weights(single / "final"), weights(output / "final")
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-4)
