"""Real two-process runs on CPU (gloo) through every launcher that runs without GPUs: each matches a
one-process run with the same global batch."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, needs_program, stability_rows
from test_train import metrics, run, small_pairs, weights

PY = sys.executable
QUICK = "configs/quick_test.yaml"  # the scripts take a config; every setting that matters is overridden


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun() -> tuple[str, ...]:
    """Two local processes through torchrun, on a free port; the module and its arguments follow."""
    return (PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port())


def launchers(port: str) -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    module = ("-m", "dpo_inv.run")
    accelerate = (PY, "-m", "accelerate.commands.launch", "--main_process_port", port)
    scripts = {"PYTHON": PY, "MASTER_PORT": port}
    return {
        "torchrun": ((PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                      *module), {}),
        # Accelerate starts local processes through torchrun with --multi_gpu (--cpu means one process)
        "accelerate": ((*accelerate, "--multi_gpu", "--num_processes", "2", *module), {}),
        "accelerate_config": ((*accelerate, "--config_file", "accelerate_configs/cpu_multiprocess.yaml",
                               *module), {}),
        "mpiexec": (("mpiexec", "-n", "2", PY, *module), {"MASTER_PORT": port}),
        "aurora_script": (("scripts/run_dpo_aurora.sh",),
                          {**scripts, "RANKS_PER_NODE": "2", "CONFIG": QUICK}),
        # an NVIDIA PBS cluster's script, its GPUs per node given; a SLURM job of 2 tasks (tests/bin/srun)
        "pbs_script": (("scripts/run_dpo_pbs.sh",), {**scripts, "GPUS_PER_NODE": "2", "CONFIG": QUICK}),
        "slurm_script": (("scripts/run_dpo_slurm.sh",),
                         {**scripts, "CONFIG": QUICK, "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
                          "SLURM_JOB_NODELIST": "localhost", "PATH": f"{ROOT / 'tests' / 'bin'}:{PATH}"}),
        "local_script": (("scripts/run_dpo_local.sh", "2", QUICK), scripts),
    }  # fmt: skip


LAUNCHERS_ON_MPIEXEC = ("mpiexec", "aurora_script", "pbs_script")
PATH = os.environ["PATH"]
COMMON = ("--max_steps", "4", "--learning_rate", "3e-4", "--warmup_steps", "0", "--logging_steps", "1",
          "--eval_steps", "4", "--per_device_eval_batch_size", "2", "--seed", "5", "--log_data_order",
          "--eval_split", "0")  # fmt: skip


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    train, evaluation = small_pairs(tmp_path), small_pairs(tmp_path, "eval.jsonl", limit=7)
    variants = tmp_path / "variants.jsonl"  # two structures: each rank scores one
    variants.write_text(
        "".join(json.dumps(r) + "\n" for r in stability_rows(("2ysf_A_7-40", "2ysh_A_4-40"), 20))
    )
    output = tmp_path / "out"
    run(tmp_path, "--train_file", str(train), "--eval_file", str(evaluation), "--output_dir", str(output),
        "--eval_variants_file", str(variants), "--per_device_train_batch_size", "4", *COMMON)  # fmt: skip
    assert "eval_spearman" in metrics(output)[-1]
    return train, evaluation, variants, output


def data_order(output) -> list[list[list[int]]]:
    return [json.loads(line)["indices"] for line in (output / "data_order.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(launchers("0")))
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, single_process, name):
    if name in LAUNCHERS_ON_MPIEXEC:
        needs_program("mpiexec")
    train, evaluation, variants, single = single_process
    command, extra_env = launchers(free_port())[name]
    output = tmp_path / "out"
    result = run(tmp_path, "--train_file", str(train), "--eval_file", str(evaluation),
                 "--eval_variants_file", str(variants), "--output_dir", str(output),
                 "--per_device_train_batch_size", "2", *COMMON,
                 command=command, extra_env=extra_env)  # fmt: skip
    log = result.stdout + result.stderr
    assert "2 process(es) on cpu" in log and "gloo backend" in log
    threads = int(re.search(r"(\d+) thread\(s\) each", log)[1])  # the two processes share the cores
    assert threads == 1 or 2 * threads <= len(os.sched_getaffinity(0)), threads
    assert "Parameters identical on all 2 process(es)" in log

    # the ranks trained on disjoint shards that together are the one-process batches, i.e. all the data
    two, one = data_order(output), data_order(single)
    assert len(two) == len(one) == 4
    for ranks, (whole,) in zip(two, one, strict=True):
        assert len(ranks) == 2 and not set(ranks[0]) & set(ranks[1])
        assert sorted(ranks[0] + ranks[1]) == sorted(whole)
    assert sorted(i for ranks in two for rank in ranks for i in rank) == list(range(16))

    # logged metrics (gathered over both ranks, rank 0 alone writing) and weights match one process
    assert [m["step"] for m in metrics(output)] == [m["step"] for m in metrics(single)]
    for a, b in zip(metrics(single), metrics(output), strict=True):
        for key in a:
            if key != "samples_per_second":
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    expected, actual = weights(single / "final"), weights(output / "final")
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-4)
    written = [
        "best",
        "checkpoints",
        "config.yaml",
        "data_order.jsonl",
        "final",
        "metrics.jsonl",
        "plots",
        "run.lock",
    ]
    assert sorted(p.name for p in output.iterdir()) == written


@pytest.mark.slow
def test_a_rank_that_cannot_reach_the_master_fails_naming_the_address(tmp_path):
    port = free_port()
    result = subprocess.run(
        [PY, "-m", "dpo_inv.run", "--max_steps", "1", "--ddp_timeout", "3", "--output_dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_PORT": port},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    expected = f"rank 1 of 2 (mpich) could not join the process group at 127.0.0.1:{port} with gloo"
    assert expected in result.stderr
