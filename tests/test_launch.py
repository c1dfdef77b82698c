"""Launch-environment mapping for mpiexec (MPICH/PALS, Open MPI, MVAPICH), SLURM and torchrun."""

import os
import subprocess
import sys
import time

import pytest

from dpo_inv.training.launch import (
    busy_cores,
    cpu_computes_bf16,
    device_backend,
    first_slurm_host,
    setup_environment,
    threads_per_process,
)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"PMI_RANK": "7", "PMI_SIZE": "12", "PALS_LOCAL_RANKID": "1"}, ("mpich", "7", "12", "1")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, ("mpich", "3", "4", "1")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "0"}, ("mpich", "3", "4", "0")),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
         ("openmpi", "5", "8", "1")),
        ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"},
         ("mvapich", "2", "4", "0")),
        ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, ("slurm", "9", "16", "1")),
    ],
)  # fmt: skip
def test_launchers_map_to_torch_variables(env, expected):
    info = setup_environment(env)
    assert (info.launcher, env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == expected
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert (info.rank, info.world_size) == (int(expected[1]), int(expected[2]))


def test_explicit_variables_win():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "LOCAL_RANK": "5", "MASTER_ADDR": "node9", "MASTER_PORT": "1234"}
    setup_environment(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "1",
        "5",
        "node9",
        "1234",
    )
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PMI_RANK": "1", "PMI_SIZE": "4"}
    assert setup_environment(torchrun).launcher == "torchrun" and torchrun["WORLD_SIZE"] == "2"


def test_master_from_pbs_nodefile_or_slurm_nodelist(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4102c5s0b0n0.hostmgmt\nx4102c5s0b0n0.hostmgmt\nx4102c5s1b0n0.hostmgmt\n")
    env = {"PMI_RANK": "0", "PMI_SIZE": "24", "PBS_NODEFILE": str(nodefile)}
    assert setup_environment(env).master_addr == "x4102c5s0b0n0.hostmgmt"
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[012-015,020]"}
    assert setup_environment(env).master_addr == "gpu012"
    assert first_slurm_host("nid001000") == "nid001000"
    assert first_slurm_host("x1001c0s[1-3,7]b0n0,other") == "x1001c0s1b0n0"


def test_single_process_needs_nothing():
    env: dict[str, str] = {}
    info = setup_environment(env)
    assert info.launcher == "none" and info.world_size == 1 and env == {}


def test_backend_on_this_machine():
    assert device_backend() == ("cpu", "gloo")
    assert device_backend("mpi") == ("cpu", "mpi")


@pytest.mark.parametrize(
    "env, local_world_size",
    [
        ({"PMI_RANK": "3", "PMI_SIZE": "12", "PALS_LOCAL_SIZE": "6"}, 6),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, 2),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}, 4),
        ({"PMI_RANK": "1", "PMI_SIZE": "3"}, 3),  # nothing says: all on this node
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 2),  # torchrun
    ],
)  # fmt: skip
def test_processes_per_node(env, local_world_size):
    assert setup_environment(env).local_world_size == local_world_size


def test_threads_share_the_cores_unless_set():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_process(1, {}, busy=0) == cores
    assert threads_per_process(2, {}, busy=0) == max(1, cores // 2)
    assert threads_per_process(4 * cores, {}, busy=0) == 1
    assert threads_per_process(2, {"OMP_NUM_THREADS": "3"}, busy=cores) == 3  # the user's (or launcher's)
    assert threads_per_process(1, {"SLURM_CPUS_PER_TASK": "1"}, busy=0) == 1


def test_cores_that_other_work_keeps_busy_are_left_to_it():
    """One process beside a neighbour computing on every core: one thread (two would spin, waiting)."""
    cores = len(os.sched_getaffinity(0))
    assert threads_per_process(1, {}, busy=cores) == 1
    assert threads_per_process(1, {}, busy=1) == max(1, cores - 1)
    assert threads_per_process(2, {}, busy=1) == max(1, cores // 2)  # the other rank is not other work
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert busy_cores() >= 1
    finally:
        neighbour.kill()
        neighbour.wait()


FAULTS_OF_LATER_TENSORS = """
import resource, sys, torch
from dpo_inv.training.launch import return_freed_memory, reuse_freed_memory
if sys.argv[1] == "reuse":
    reuse_freed_memory()
size = int(sys.argv[2])
for _ in range(3):  # a freed block may not fit the next (memalign slack, small objects in it)
    torch.ones(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # by now the heap holds two such blocks: pages mapped afresh, or reused
    torch.ones(size)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
held = int(open("/proc/self/statm").read().split()[1]) * 4096
return_freed_memory()
print(faults, held, int(open("/proc/self/statm").read().split()[1]) * 4096)
"""


@pytest.mark.slow
def test_training_reuses_the_memory_torch_frees():
    """With glibc's defaults a freed 200 MB tensor goes back to the system and the next one faults its
    50,000 pages in again; after `reuse_freed_memory` (which the trainer, adapt and propose call) the same
    tensor made again and again reuses them (checked over 24 heap layouts: the fourth to sixth fault none),
    and so does a 2.4 GB one (a step of LigandMPNN on the ligand example frees 17 GB); `return_freed_memory`
    (at the end of a run) gives them back."""

    def run(setting: str, floats: int) -> tuple[int, int, int]:
        printed = subprocess.run([sys.executable, "-c", FAULTS_OF_LATER_TENSORS, setting, str(floats)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
        faults, held, after = map(int, printed.split())
        return faults, held, after

    assert run("default", 50_000_000)[0] > 3 * 40_000
    assert run("reuse", 50_000_000)[0] < 1_000
    faults, held, after = run("reuse", 600_000_000)
    assert faults < 1_000 and held > 4.8e9 and after < held - 4.8e9


def test_native_bf16_is_read_off_the_cpu_flags():
    """Intel's AVX-512 BF16 or AMX, or AMD's AVX-512 BF16: native; without either bf16 autocast is emulated,
    which the trainer says in a note (8.5 times slower than fp32 on one machine of this kind)."""
    flags = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f{}\n\nprocessor\t: 1\n"
    assert cpu_computes_bf16(flags.format(" avx512_bf16")) is True
    assert cpu_computes_bf16(flags.format(" amx_bf16 amx_tile")) is True
    assert cpu_computes_bf16(flags.format("")) is False
    assert cpu_computes_bf16(flags.format(" avx512_bf16x")) is False  # whole flags only
    assert cpu_computes_bf16("") is False
