"""Runs that do not end well, on real processes and signals: walltime signals, partial or damaged
checkpoints, diverging training, a rank that fails, stops responding or is killed, a full disk, two jobs
on one output folder."""

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil
import pytest
import torch
from conftest import ROOT, Background, needs_program
from safetensors.torch import load_file
from test_distributed import LAUNCHERS_ON_MPIEXEC, free_port, launchers
from test_train import env, metrics, run, small_pairs, weights

from dpo_inv.models.weights import _packaged_path, load_model
from dpo_inv.training.checkpoints import checkpoint_problem, find_checkpoint, sorted_checkpoints
from dpo_inv.training.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_NOT_SAVED

PY = sys.executable
TRAIN = (PY, "-m", "dpo_inv.run")
ARGS = ("--eval_split", "0", "--per_device_train_batch_size", "2", "--learning_rate", "3e-4",
        "--warmup_ratio", "0", "--logging_steps", "1", "--save_steps", "100", "--seed", "3")  # fmt: skip
Start = Callable[..., subprocess.Popen]


def torchrun(*options: str) -> tuple[str, ...]:
    """Two processes through torchrun on a free port."""
    return (PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
            *options)  # fmt: skip


@pytest.fixture
def start(tmp_path: Path, background: Background) -> Start:
    """Start a run in the background, its output going to LOG.log (default: OUTPUT_DIR.log); runs still
    going at the end are killed."""

    def start(
        output: Path,
        *args: str,
        command: Sequence[str] = TRAIN,
        extra_env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:
        return background(
            [*command, "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(output), *args],
            Path(f"{log or output}.log"),
            {**env(tmp_path), **(extra_env or {})},
        )

    return start


def start_ranks(start: Start, num_processes: int, output: Path, *args: str) -> list[subprocess.Popen]:
    """The ranks of one run, started without a launcher (one process runs alone), output to RANK{R}.log."""
    launch = {"WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    return [
        start(output, *args, log=output.parent / f"rank{rank}",
              extra_env={**launch, "RANK": str(rank)} if num_processes > 1 else {})
        for rank in range(num_processes)
    ]  # fmt: skip


def output_of(output: Path) -> str:
    return Path(f"{output}.log").read_text()


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, output: Path) -> None:
    """Poll until `condition` holds, failing with the run's output if it ends or takes over two minutes."""
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, output_of(output)[-3000:]
        assert time.monotonic() < deadline, output_of(output)[-3000:]
        time.sleep(0.05)


def wait_for_a_logged_step(process: subprocess.Popen, output: Path, log: Path | None = None) -> None:
    metrics_file = output / "metrics.jsonl"
    wait_for(lambda: metrics_file.is_file() and metrics_file.stat().st_size > 0, process, log or output)


def checkpoints(output: Path) -> list[str]:
    return sorted(p.name for p in (output / "checkpoints").iterdir())


def assert_same_weights(expected: Path, actual: Path) -> None:
    a, b = weights(expected), weights(actual)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_sigterm_stops_at_a_step_with_a_checkpoint_and_resume_ends_as_an_uninterrupted_run(tmp_path, start):
    args = ("--train_file", str(small_pairs(tmp_path)), "--max_steps", "8", *ARGS)
    interrupted = tmp_path / "interrupted"
    process = start(interrupted, *args)
    wait_for_a_logged_step(process, interrupted)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == EXIT_INTERRUPTED
    output = output_of(interrupted)
    step = metrics(interrupted)[-1]["step"]
    assert 2 <= step < 8  # step 1 was logged before the signal: the next step boundary is 2 or later
    assert "rank 0: received SIGTERM, stopping after this optimizer step with a checkpoint" in output
    checkpoint = interrupted / "checkpoints" / f"step-{step}"
    resume = f"To finish, run again with --output_dir {interrupted} --resume_from_checkpoint latest"
    assert f"Stopped at step {step} of 8 on SIGTERM or SIGUSR1 (the job is near its walltime); " \
           f"checkpoint {checkpoint}. {resume}" in output  # fmt: skip
    assert checkpoints(interrupted) == [f"step-{step}"] and checkpoint_problem(checkpoint) is None
    assert not (interrupted / "final").exists()

    result = run(tmp_path, *args, "--output_dir", str(interrupted), "--resume_from_checkpoint", "latest")
    assert f"Resumed from {checkpoint} at step {step}" in result.stdout
    straight = tmp_path / "straight"
    run(tmp_path, *args, "--output_dir", str(straight))
    assert [m["step"] for m in metrics(interrupted)] == [*range(1, 9)]
    for a, b in zip(metrics(straight), metrics(interrupted), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["skipped_steps"] == a["skipped_steps"] == 0
    assert_same_weights(straight / "final", interrupted / "final")


@pytest.mark.slow
def test_a_second_signal_ends_the_process_at_once(tmp_path, start):
    output = tmp_path / "out"
    # large batches: a step takes long enough for the second signal to come before the first one's stop
    process = start(output, "--train_file", str(small_pairs(tmp_path)), "--max_steps", "50", *ARGS,
                    "--per_device_train_batch_size", "8")  # fmt: skip
    wait_for_a_logged_step(process, output)
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: "received SIGTERM" in output_of(output), process, output)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert process.wait(timeout=30) == -signal.SIGTERM
    assert time.monotonic() - sent < 5
    assert "Stopped at step" not in output_of(output) and sorted_checkpoints(output) == []


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_with_one_checkpoint(tmp_path, start):
    output = tmp_path / "out"
    process = start(output, "--train_file", str(small_pairs(tmp_path)), "--max_steps", "8", *ARGS,
                    "--per_device_train_batch_size", "1", command=(*torchrun(), *TRAIN[1:]))  # fmt: skip
    wait_for_a_logged_step(process, output)
    children = psutil.Process(process.pid).children(recursive=True)
    ranks = {child.environ().get("RANK"): child for child in children}
    ranks["1"].send_signal(signal.SIGUSR1)  # the signal reaches rank 1 only
    assert process.wait(timeout=120) != 0
    log = output_of(output)
    assert "rank 1: received SIGUSR1" in log and "rank 0: received" not in log
    # torchrun reports each rank's exit status; it ends the ranks still running when the first one exits
    exit_codes = set(re.findall(r"exitcode\s*: (-?\d+)", log))
    assert str(EXIT_INTERRUPTED) in exit_codes and exit_codes <= {str(EXIT_INTERRUPTED), str(-signal.SIGTERM)}
    step = metrics(output)[-1]["step"]
    assert f"Stopped at step {step} of 8 on SIGTERM or SIGUSR1" in log
    assert checkpoints(output) == [f"step-{step}"]
    checkpoint = output / "checkpoints" / f"step-{step}"
    assert checkpoint_problem(checkpoint) is None
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= {
        p.name for p in checkpoint.iterdir()
    }


@pytest.mark.slow
def test_partial_and_damaged_checkpoints_are_never_resumed_from_or_kept(tmp_path):
    data, evaluation = small_pairs(tmp_path), small_pairs(tmp_path, "eval.jsonl", limit=2)
    args = ("--train_file", str(data), "--eval_file", str(evaluation), "--eval_steps", "3",
            "--max_steps", "6", *ARGS, "--save_steps", "1")  # fmt: skip
    straight = tmp_path / "straight"
    run(tmp_path, *args, "--output_dir", str(straight), "--save_total_limit", "6")
    assert checkpoints(straight) == [f"step-{n}" for n in range(1, 7)]

    # what saves killed at various points, or a damaged disk, leave behind
    output = tmp_path / "out"
    source, target = straight / "checkpoints", output / "checkpoints"
    shutil.copytree(source / "step-2", target / "step-2")
    shutil.copytree(source / "step-3", target / "step-3.tmp")  # killed before the rename
    shutil.copytree(source / "step-4", target / "step-4")
    (target / "step-4" / "trainer_state.json").unlink()  # a step directory without its trainer state
    shutil.copytree(source / "step-5", target / "step-5")
    optimizer = target / "step-5" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])  # a truncated file
    shutil.copytree(source / "step-6", target / "step-6")
    state = target / "step-6" / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # a truncated trainer state
    assert sorted_checkpoints(output) == [target / "step-2"]
    with pytest.raises(FileNotFoundError, match="optimizer.bin has 1000 bytes"):
        find_checkpoint(output, str(target / "step-5"))

    result = run(tmp_path, *args, "--output_dir", str(output), "--resume_from_checkpoint", "latest",
                 "--save_total_limit", "2")  # fmt: skip
    assert f"Resumed from {target / 'step-2'} at step 2" in result.stdout
    # the leftover is gone, the damaged steps were saved again in place, the oldest pruned
    assert checkpoints(output) == ["step-5", "step-6"]
    assert sorted_checkpoints(output) == [target / "step-5", target / "step-6"]
    assert_same_weights(straight / "final", output / "final")
    assert_same_weights(straight / "best", output / "best")

    # resumed from an older checkpoint, the run keeps the checkpoint it has just written, not the higher steps
    run(tmp_path, *args, "--output_dir", str(output), "--resume_from_checkpoint", str(source / "step-3"),
        "--max_steps", "4", "--save_total_limit", "1")  # fmt: skip
    assert checkpoints(output) == ["step-4"] and (output / "best" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [1, 2])
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, start, num_processes):
    output = tmp_path / "out"
    ranks = start_ranks(start, num_processes, output, "--train_file", str(small_pairs(tmp_path)),
                        "--max_steps", "20", *ARGS, "--per_device_train_batch_size", str(2 // num_processes),
                        "--learning_rate", "1e4", "--max_consecutive_nonfinite", "3")  # fmt: skip
    # every rank takes the same decision at every step, or they would part and wait on each other
    assert [rank.wait(timeout=300) for rank in ranks] == [EXIT_NONFINITE] * num_processes
    logged = metrics(output)
    assert [m["skipped_steps"] for m in logged] == [0, 1, 1, 1]  # a learning rate of 1e4 diverges at once
    assert math.isfinite(logged[0]["loss"]) and not any(math.isfinite(m["loss"]) for m in logged[1:])
    log = output_of(tmp_path / "rank0")
    message = "Stopped at step 4: the loss or the gradient norm was not finite in 3 optimizer steps in a row"
    assert message in log and "(the weights are those of step 1)" in log
    assert "learning rate" in log and "beta" in log and "mixed precision" in log
    assert checkpoints(output) == ["step-4"]
    checkpoint = load_file(output / "checkpoints" / "step-4" / "model.safetensors")
    base = load_model("vanilla/v_48_020").state_dict()
    assert all(bool(value.isfinite().all()) for value in checkpoint.values())
    assert max((checkpoint[k] - base[k]).abs().max().item() for k in checkpoint) > 1  # step 1 moved them


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_job_with_its_message(tmp_path, start):
    """Rank 1 runs where the model file is not (as on a node without it): the job ends at once."""
    nodes = tmp_path / "nodes"
    (nodes / "node1").mkdir(parents=True)
    (nodes / "node0").mkdir()
    shutil.copy(_packaged_path("vanilla", "v_48_020"), nodes / "node0" / "model.pt")
    in_node_dir = f'cd "$0/node$LOCAL_RANK" && exec {PY} -m dpo_inv.run "$@"'
    output = tmp_path / "out"
    began = time.monotonic()
    process = start(output, "--train_file", str(small_pairs(tmp_path)), "--model_name_or_path", "model.pt",
                    "--max_steps", "4", *ARGS, "--ddp_timeout", "60",
                    command=(*torchrun("--no-python"), "sh", "-c", in_node_dir, str(nodes)),
                    extra_env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert process.wait(timeout=120) != 0
    assert time.monotonic() - began < 60
    said = "rank 1: python -m dpo_inv.run: error: cannot load ProteinMPNN from 'model.pt'"
    assert said in output_of(output)


@pytest.mark.slow
def test_a_rank_that_stops_responding_ends_the_job_within_ddp_timeout(tmp_path, start):
    """Without a launcher to end the others: rank 1 is stopped (SIGSTOP), rank 0 fails after ddp_timeout."""
    output = tmp_path / "out"
    ranks = start_ranks(start, 2, output, "--train_file", str(small_pairs(tmp_path)), "--max_steps", "50",
                        *ARGS, "--ddp_timeout", "10")  # fmt: skip
    wait_for_a_logged_step(ranks[0], output, log=tmp_path / "rank0")
    ranks[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    assert ranks[0].wait(timeout=60) == 1
    assert time.monotonic() - stopped < 10 + 10
    rank0 = output_of(tmp_path / "rank0")
    assert (
        "rank 0: python -m dpo_inv.run: error: a bug in dpo_inv, not in your input: RuntimeError: " in rank0
        and "Timed out waiting 10000ms" in rank0
    )


@pytest.mark.slow
def test_resume_latest_starts_a_new_run_then_resumes_it(tmp_path):
    """A job script may pass --resume_from_checkpoint latest on every submission, the first one included."""
    output = tmp_path / "out"
    args = ("--train_file", str(small_pairs(tmp_path)), "--output_dir", str(output),
            "--resume_from_checkpoint", "latest", *ARGS, "--save_steps", "1")  # fmt: skip
    first = run(tmp_path, *args, "--max_steps", "2")
    assert f"No checkpoint in {output / 'checkpoints'} yet: starting from step 0" in first.stdout
    second = run(tmp_path, *args, "--max_steps", "3")
    assert f"Resumed from {output / 'checkpoints' / 'step-2'} at step 2" in second.stdout
    assert [m["step"] for m in metrics(output)] == [1, 2, 3]
    shutil.rmtree(output / "checkpoints" / "step-2")
    (output / "checkpoints" / "step-3" / "trainer_state.json").unlink()  # only a damaged one is left
    with pytest.raises(FileNotFoundError, match="only damaged ones; give a checkpoint directory"):
        find_checkpoint(output, "latest")


@pytest.mark.slow
def test_a_second_job_on_the_same_output_dir_refuses_naming_the_first(tmp_path, start):
    """Two jobs on one output_dir would interleave their checkpoints: the second stops at once (exit 2),
    naming the first; the lock goes with the first job however it ends."""
    data, output = str(small_pairs(tmp_path)), tmp_path / "out"
    first = start(output, "--train_file", data, "--max_steps", "500", *ARGS)
    wait_for_a_logged_step(first, output)
    second = subprocess.run(
        [*TRAIN, "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(output), "--train_file", data,
         "--max_steps", "2", *ARGS],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert second.returncode == EXIT_BAD_INPUT, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert (
        second.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"python -m dpo_inv.run: error: {output} is in use by another job (pid {first.pid} on "
            f"{socket.gethostname()}, started "
        )
    )
    assert f"see {output / 'run.lock'}): wait for it to end, or give another output_dir" in second.stderr
    assert first.poll() is None and [m["step"] for m in metrics(output)] == list(
        range(1, len(metrics(output)) + 1)
    )
    os.killpg(first.pid, signal.SIGKILL)  # as the OOM killer would
    first.wait()
    run(tmp_path, "--output_dir", str(output), "--train_file", data, "--max_steps", "1", *ARGS,
        "--resume_from_checkpoint", "latest")  # fmt: skip


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 30 MiB file system: room for one checkpoint (20 MiB) and not for a second beside it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_while_saving_ends_the_run_in_one_line_with_the_previous_checkpoint_resumable(
    tmp_path, small_disk
):
    data, output = str(small_pairs(tmp_path)), small_disk / "out"
    args = ("--train_file", data, "--max_steps", "3", *ARGS, "--save_steps", "1", "--save_total_limit", "1")
    result = subprocess.run(
        [*TRAIN, "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(output), *args],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == EXIT_NOT_SAVED, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    message = [line for line in result.stdout.splitlines() if line.startswith("Could not write")]
    assert len(message) == 1
    assert message[0].startswith(f"Could not write {output / 'checkpoints' / 'step-2'}: ")
    assert message[0].endswith(
        "(a full disk or quota is the usual cause). The checkpoint step-1 is complete: make room, then run "
        f"again with --output_dir {output} --resume_from_checkpoint latest"
    )
    assert checkpoints(output) == ["step-1"] and checkpoint_problem(output / "checkpoints" / "step-1") is None
    moved = tmp_path / "out"  # room made: the run goes on elsewhere
    shutil.copytree(output, moved)
    resumed = run(tmp_path, "--output_dir", str(moved), *args, "--resume_from_checkpoint", "latest")
    assert f"Resumed from {moved / 'checkpoints' / 'step-1'} at step 1" in resumed.stdout
    assert [m["step"] for m in metrics(moved)] == [1, 2, 3] and checkpoints(moved) == ["step-3"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "mpiexec"])
def test_a_killed_rank_ends_the_whole_job_within_ddp_timeout(tmp_path, start, launcher):
    """SIGKILL (what the OOM killer sends) to rank 1 mid-run: its launcher ends the job, and says which."""
    if launcher in LAUNCHERS_ON_MPIEXEC:
        needs_program("mpiexec")
    command, extra_env = launchers(free_port())[launcher]
    output = tmp_path / "out"
    job = start(output, "--train_file", str(small_pairs(tmp_path)), "--max_steps", "500", *ARGS,
                "--ddp_timeout", "60", command=command, extra_env=extra_env)  # fmt: skip
    wait_for_a_logged_step(job, output)
    ranks = {}
    for child in psutil.Process(job.pid).children(recursive=True):
        environ = child.environ()
        if "dpo_inv.run" in child.cmdline():
            ranks[environ.get("RANK", environ.get("PMI_RANK"))] = child
    assert set(ranks) == {"0", "1"}
    killed = time.monotonic()
    ranks["1"].kill()
    assert job.wait(timeout=120) != 0
    assert time.monotonic() - killed < 60
    # the launcher names the process that was killed; MPICH names the first rank it finds ended by a signal,
    # which is rank 0 where its own clean-up (SIGKILL to the job's other ranks) came first
    named, log = [ranks["1"], *([ranks["0"]] if launcher in LAUNCHERS_ON_MPIEXEC else [])], output_of(output)
    assert any(str(rank.pid) in log for rank in named), log[-2000:]
    assert not ranks["0"].is_running()
