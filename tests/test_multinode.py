"""Several nodes on one machine, through the real multi-node launches, with tiny data: torchrun on two
"nodes" (two invocations, one rendezvous) and mpiexec over two PBS "nodes" with the variables PALS exports
on Aurora. Each run matches a one-process run with the same global batch and leaves one metrics.jsonl, the
checkpoints one rank finished and the Arrow cache one rank built, although every node writes to the same
output folder and sees the same cache folder.

A probe (a sitecustomize.py on PYTHONPATH, imported by every Python process started) records, in each
process, the renames, deletions and file writes under the shared folder (Python's audit events) and, at exit,
the launch variables and threads the run settled on."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, Background, needs_program
from test_distributed import free_port
from test_train import env, metrics, run, small_pairs, weights

from dpo_inv.training.checkpoints import checkpoint_problem

PY = sys.executable
CONFIG = str(ROOT / "configs" / "quick_test.yaml")  # as the Aurora script needs one; all that matters is set
# 16 pairs, a global batch of 4: 3 steps of the first epoch; checkpoints 1 to 3, the newest 2 kept
ARGS = ("--eval_split", "0", "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "2",
        "--learning_rate", "3e-4", "--warmup_steps", "0", "--logging_steps", "1", "--seed", "5")  # fmt: skip
GLOBAL_BATCH = 4
CORES = len(os.sched_getaffinity(0))  # a "node"'s cores, shared by its processes (OMP_NUM_THREADS unset)

PROBE = """
import atexit, json, os, sys

ROOT = os.environ["PROBE_ROOT"]


def record(**fields):
    with open(os.environ["PROBE_LOG"], "a") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), **fields}) + "\\n")


def audit(event, args):
    if event not in ("os.rename", "os.replace", "shutil.rmtree", "open") or isinstance(args[0], int):
        return
    path = os.fsdecode(args[0])
    if not path.startswith(ROOT):
        return
    if event == "shutil.rmtree":
        record(event="rmtree", path=path)
    elif event != "open":
        record(event="rename", path=path, to=os.fsdecode(args[1]))
    elif any(c in args[1] for c in "wax+") if args[1] else args[2] & (os.O_WRONLY | os.O_RDWR):
        record(event="write", path=path)


sys.addaudithook(audit)


@atexit.register
def launch():
    if "dpo_inv.training.launch" in sys.modules:
        import torch
        names = ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        record(event="exit", threads=torch.get_num_threads(), **{n: os.environ.get(n) for n in names})
"""

# PALS's mpiexec on Aurora exports these, and no MPI_LOCALRANKID; hydra's mpiexec gives the values
PALS = """#!/bin/sh
export PALS_RANKID=$PMI_RANK PALS_LOCAL_RANKID=$MPI_LOCALRANKID PALS_LOCAL_SIZE=$MPI_LOCALNRANKS \
    PALS_NODEID=$((PMI_RANK / MPI_LOCALNRANKS))
unset MPI_LOCALRANKID MPI_LOCALNRANKS
exec {python} "$@"
"""


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[Path, Path]:
    """The training data and a one-process run on it with the global batch of the multi-node runs."""
    tmp_path = tmp_path_factory.mktemp("single")
    train, output = small_pairs(tmp_path), tmp_path / "out"
    run(tmp_path, "--config", CONFIG, "--train_file", str(train), "--output_dir", str(output), *ARGS,
        "--per_device_train_batch_size", str(GLOBAL_BATCH))  # fmt: skip
    return train, output


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """The folder every node sees (output, cache, working folders), watched by the probe."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "sitecustomize.py").write_text(PROBE)
    (tmp_path / "shared").mkdir()
    return tmp_path / "shared"


@pytest.fixture
def start(tmp_path: Path, shared: Path, background: Background) -> Background:
    """Start a launcher in the background with the probe and without OMP_NUM_THREADS, output to LOG; those
    still going at the end are killed."""
    path = os.pathsep.join(filter(None, [str(tmp_path / "probe"), os.environ.get("PYTHONPATH")]))
    base = {k: v for k, v in env(tmp_path).items() if k != "OMP_NUM_THREADS"}
    probe = {"PYTHONPATH": path, "PROBE_ROOT": str(shared), "PROBE_LOG": str(tmp_path / "probe.jsonl")}

    def start(command: tuple[str, ...], log: Path, cwd: Path = ROOT, **extra_env: str) -> subprocess.Popen:
        return background(command, log, {**base, **probe, **extra_env}, cwd)

    return start


def finished(runs: dict[Path, subprocess.Popen]) -> list[str]:
    """The output (LOG -> launcher) of launchers that all end well; the first to fail fails the test at once
    (the others would wait for it), as does a run still going after 5 minutes."""
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in runs.values()):
        failed = [log for log, p in runs.items() if p.poll() not in (None, 0)]
        assert not failed and time.monotonic() < deadline, (failed or list(runs))[0].read_text()[-5000:]
        time.sleep(0.2)
    for log, process in runs.items():
        assert process.returncode == 0, log.read_text()[-5000:]
    return [log.read_text() for log in runs]


def probed(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]


def hydra_version() -> str:
    """What `mpiexec --version` says; MPICH's hydra names itself."""
    return subprocess.run(["mpiexec", "--version"], capture_output=True, text=True).stdout


def run_args(shared: Path, train: Path, per_device_batch: int) -> tuple[str, ...]:
    """After --config: the Aurora script puts its CONFIG first."""
    return ("--train_file", str(train), "--output_dir", str(shared / "out"), "--cache_dir",
            str(shared / "cache"), *ARGS, "--per_device_train_batch_size", str(per_device_batch))  # fmt: skip


def assert_one_writer_and_one_run(shared: Path, single: Path, events: list[dict], world_size: int) -> None:
    """The shared folders as one process would have left them, each written by rank 0 alone but for each
    rank's random state in the checkpoints; weights and logged metrics as in the one-process run."""
    output, cache = shared / "out", shared / "cache"
    assert not list(shared.rglob("*.tmp")), list(shared.rglob("*.tmp"))
    assert list(shared.rglob("metrics.jsonl")) == [output / "metrics.jsonl"]
    assert [m["step"] for m in metrics(output)] == [1, 2, 3]  # each step logged once
    for a, b in zip(metrics(single), metrics(output), strict=True):
        for key in a.keys() - {"samples_per_second"}:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    expected, actual = weights(single / "final"), weights(output / "final")
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-4)

    checkpoints = output / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-3"]
    for step in ("step-2", "step-3"):
        assert checkpoint_problem(checkpoints / step) is None
        states = sorted(p.name for p in (checkpoints / step).glob("random_states_*.pkl"))
        assert states == [f"random_states_{r}.pkl" for r in range(world_size)]
    finished_by = [(e["rank"], Path(e["to"]).name) for e in events
                   if e["event"] == "rename" and Path(e["to"]).parent == checkpoints]  # fmt: skip
    assert finished_by == [("0", "step-1"), ("0", "step-2"), ("0", "step-3")]
    assert [e for e in events if e["event"] == "rmtree" and e["rank"] != "0"] == []
    for e in events:
        if e["event"] == "write" and e["rank"] != "0":
            assert Path(e["path"]).name == f"random_states_{e['rank']}.pkl", e

    # the Arrow cache: one folder of structures and one of records (the pairs), each saved once, by rank 0
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["records", "structures"]
    saved = [(e["rank"], Path(e["to"]).name) for e in events
             if e["event"] == "rename" and Path(e["to"]).parent == cache]  # fmt: skip
    assert sorted(saved) == sorted(("0", p.name) for p in cache.iterdir())


@pytest.mark.slow
def test_torchrun_on_two_nodes_matches_one_process(tmp_path, single_process, shared, start):
    """`torchrun --nnodes 2 --nproc_per_node 1 --node_rank R` started twice, each "node" in its own working
    folder, with the static rendezvous of docs/launching.md: both processes have LOCAL_RANK 0."""
    train, single = single_process
    port, ranks = free_port(), (0, 1)
    nodes = [shared / f"node{r}" for r in ranks]
    runs = {}
    for rank, node in zip(ranks, nodes, strict=True):
        node.mkdir()
        command = (PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
                   str(rank), "--master_addr", "127.0.0.1", "--master_port", port, "-m", "dpo_inv.run",
                   "--config", CONFIG, *run_args(shared, train, GLOBAL_BATCH // 2))  # fmt: skip
        log = tmp_path / f"node{rank}.log"
        runs[log] = start(command, log, cwd=node)
    log, other = finished(runs)
    # the two "nodes" share this machine's cores: each may measure the other as busy work (launch.busy_cores)
    threads = re.search(
        r"2 process\(es\) on cpu:0 \(gloo backend, torchrun launch, (\d+) thread\(s\) each\)", log
    )
    assert threads and 1 <= int(threads[1]) <= CORES
    assert "Parameters identical on all 2 process(es)" in log
    assert "Parameters identical" not in other and "Done:" not in other  # rank 0 alone speaks
    assert all(not any(node.iterdir()) for node in nodes)  # nothing written into the working folders

    events = probed(tmp_path)
    exits = sorted((e["rank"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["threads"]) for e in events
                   if e["event"] == "exit")  # fmt: skip
    assert [e[:3] for e in exits] == [("0", "0", "1"), ("1", "0", "1")]  # one process per node
    assert exits[0][3] == int(threads[1]) and 1 <= exits[1][3] <= CORES
    assert_one_writer_and_one_run(shared, single, events, world_size=2)


@pytest.mark.slow
def test_mpiexec_on_two_pbs_nodes_with_pals_variables(tmp_path, single_process, shared, start):
    """scripts/run_dpo_aurora.sh with RANKS_PER_NODE=2 in a "PBS job" of two nodes (localhost and 127.0.0.1
    in $PBS_NODEFILE, which hydra reads): `mpiexec -n 4 -ppn 2 PYTHON -m dpo_inv.run ...`, PYTHON a wrapper
    exporting what PALS exports. Hydra starts both nodes' ranks with fork (HYDRA_LAUNCHER), not ssh; without
    PBS_JOBID, as PALS's --cpu-bind is not hydra's. Local ranks 0, 1, 0, 1, as on Aurora's 12 per node."""
    needs_program("mpiexec")
    if "HYDRA" not in hydra_version():
        pytest.skip("this mpiexec is not MPICH's (hydra): needs apt-get install mpich")
    train, single = single_process
    nodefile, wrapper = tmp_path / "nodefile", tmp_path / "pals_python"
    nodefile.write_text("localhost\n127.0.0.1\n")
    wrapper.write_text(PALS.format(python=PY))
    wrapper.chmod(0o755)
    workdir = shared / "workdir"  # the job's folder, where the script goes
    workdir.mkdir()
    pbs = {"PBS_ENVIRONMENT": "PBS_BATCH", "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(workdir),
           "HYDRA_RMK": "pbs", "HYDRA_LAUNCHER": "fork", "RANKS_PER_NODE": "2", "CONFIG": CONFIG,
           "PYTHON": str(wrapper), "MASTER_PORT": free_port()}  # fmt: skip
    command = (str(ROOT / "scripts" / "run_dpo_aurora.sh"), *run_args(shared, train, GLOBAL_BATCH // 4))
    (log,) = finished({tmp_path / "mpiexec.log": start(command, tmp_path / "mpiexec.log", **pbs)})
    assert "dpo_inv on 2 node(s) x 2 ranks = 4, master localhost:" in log
    threads = max(1, CORES // 2)
    assert f"4 process(es) on cpu:0 (gloo backend, mpich launch, {threads} thread(s) each)" in log
    for line in ("Parameters identical on all 4 process(es)", "Done: model saved to", "Policy vanilla"):
        assert log.count(line) == 1, line  # once in the job's one log, not once per node
    assert not any(workdir.iterdir())

    events = probed(tmp_path)
    exits = sorted((e["rank"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"], e["MASTER_ADDR"],
                    e["threads"]) for e in events if e["event"] == "exit")  # fmt: skip
    assert exits == [(str(r), str(r % 2), "2", "4", "localhost", threads) for r in range(4)]
    assert_one_writer_and_one_run(shared, single, events, world_size=4)
