"""The launch environment, settled before the Accelerator is built.

torchrun and `accelerate launch` export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
mpiexec/mpirun (MPICH and PALS on Aurora, Open MPI, MVAPICH) and SLURM's srun export their own variables;
they are mapped to torch.distributed's here. Variables already set always win.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import re
import shlex
import time
import warnings
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from dpo_inv.errors import OptionError

# (rank, world size, local rank candidates, local size candidates) per launcher, in order of precedence
LAUNCHERS = {
    "mpich": ("PMI_RANK", "PMI_SIZE", ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID"),
              ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS")),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",),
                ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
}  # fmt: skip
DEFAULT_PORT = "29500"


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # torchrun (also accelerate launch), mpich, openmpi, mvapich, slurm or none
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node
    master_addr: str
    master_port: str


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'x1001c0s[1-3,7]b0n0,gpu07' (no scontrol needed)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist)
    if match is None:
        return nodelist
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def master_address(env: MutableMapping[str, str]) -> str:
    """The first host of the PBS node file or the SLURM node list, else this machine."""
    nodefile = env.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as handle:
            for line in handle:
                if line.strip():
                    return line.strip()
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return first_slurm_host(nodelist)
    return "127.0.0.1"


def setup_environment(env: MutableMapping[str, str] | None = None) -> LaunchInfo:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher's
    variables where they are not set already; returns what was found."""
    env = os.environ if env is None else env
    launcher = "none"
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
    else:
        for name, (rank, size, local_ranks, local_sizes) in LAUNCHERS.items():
            if rank in env and size in env:
                launcher = name
                env.setdefault("RANK", env[rank])
                env.setdefault("WORLD_SIZE", env[size])
                for names, target in ((local_ranks, "LOCAL_RANK"), (local_sizes, "LOCAL_WORLD_SIZE")):
                    value = next((env[v] for v in names if v in env), None)
                    if value is not None:
                        env.setdefault(target, value)
                break
    if launcher != "none":
        # when nothing says otherwise, every process is taken to run on this node
        env.setdefault("LOCAL_RANK", env["RANK"])
        env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
        env.setdefault("MASTER_ADDR", master_address(env))
        env.setdefault("MASTER_PORT", DEFAULT_PORT)
    return LaunchInfo(
        launcher=launcher,
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env.get("MASTER_PORT", DEFAULT_PORT),
    )


def accelerate_launch_args(pid: int | None = None) -> list[str] | None:
    """The arguments after `accelerate launch` where process ``pid`` (default: this one's parent) is that
    command, which starts one process itself (its single-process launcher); else None (torchrun,
    mpiexec, a shell)."""
    try:
        argv = Path(f"/proc/{os.getppid() if pid is None else pid}/cmdline").read_bytes().decode().split("\0")
    except (OSError, UnicodeDecodeError):
        return None
    for i, arg in enumerate(argv):
        if arg == "accelerate.commands.launch":
            return argv[i + 1 : -1]
        if Path(arg).name == "accelerate" and argv[i + 1 : i + 2] == ["launch"]:
            return argv[i + 2 : -1]
    return None


def check_processes_asked(world_size: int, pid: int | None = None) -> None:
    """Refuse a run of another number of processes than `accelerate launch --num_processes N` (process
    ``pid``, default: this one's parent) asked for: without several GPUs it starts one process; the error
    gives the line that starts N."""
    args = accelerate_launch_args(pid)
    if args is None:
        return
    from accelerate.commands.launch import launch_command_parser

    try:
        asked = launch_command_parser().parse_known_args(args)[0].num_processes
    except SystemExit:
        return
    if asked is None or asked == world_size:
        return
    devices = torch.cuda.device_count() or (torch.xpu.device_count() if hasattr(torch, "xpu") else 0)
    if devices:
        options = [a for a in args if not a.startswith("--num_processes")]
        line = shlex.join(["accelerate", "launch", "--num_processes", str(devices), *options])
        why = f"this machine has {devices} GPU(s), one process each"
    else:
        line = shlex.join(["accelerate", "launch", "--multi_gpu", *(a for a in args if a != "--cpu")])
        why = "without several GPUs, Accelerate starts one unless given --multi_gpu (on a CPU: gloo)"
    raise OptionError(
        f"accelerate launch --num_processes {asked} started {world_size} process(es): {why}; run: {line}"
    )


def busy_cores(samples: int = 5, interval: float = 0.01) -> int:
    """How many cores other work keeps busy now: the runnable tasks of the machine but this one
    (`/proc/loadavg`), the least of a few samples, so that a passing task does not count; 0 where the
    file is missing."""
    counts = []
    for sample in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except (OSError, IndexError):
            return 0
        counts.append(int(running) - 1)
        if sample + 1 < samples:
            time.sleep(interval)
    return max(0, min(counts))


def threads_per_process(
    local_world_size: int, env: MutableMapping[str, str] | None = None, busy: int | None = None
) -> int:
    """Compute threads for this process: OMP_NUM_THREADS where the user or the launcher set it, else the
    cores this process may run on (its CPU affinity, and SLURM_CPUS_PER_TASK in a SLURM job) shared among
    the processes of this node, less the cores other work keeps busy (``busy``, measured by default:
    threads that wait for a busy core spin and slow everything down several times), at least 1."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    processes = max(1, local_world_size)
    busy = busy_cores() if busy is None else busy
    others = max(0, busy - (processes - 1))  # the node's other ranks are not other work
    threads = max(1, (len(os.sched_getaffinity(0)) - others) // processes)
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit() and int(env["SLURM_CPUS_PER_TASK"]) > 0:
        threads = min(threads, int(env["SLURM_CPUS_PER_TASK"]))
    return threads


@contextmanager
def threads_kept(threads: int) -> Iterator[None]:
    """Set torch's ``threads`` around starting Accelerate, and again on leaving: on CPUs with several
    processes Accelerate sets them to the physical cores over the node's processes (ignoring the CPU
    affinity, SLURM_CPUS_PER_TASK and other work) and warns that OMP_NUM_THREADS is unset; its warning is
    silenced."""
    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset")
        yield
    torch.set_num_threads(threads)


def glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose malloc `reuse_freed_memory` tunes), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def reuse_freed_memory() -> None:
    """Keep the memory torch frees in this process for its next tensors, as jemalloc and tcmalloc do (the
    allocators PyTorch's CPU performance guide recommends): glibc's malloc returns large blocks to the
    system and takes them back page by page, so that each CPU training step maps and zeroes the activations
    of the step before afresh (77,000 page faults a step for SFT on four chains, see docs/sft.md; a third of
    LigandMPNN's step on the ligand example, whose activations take 17 GB). The process keeps its peak
    memory until `return_freed_memory`. Nothing where the C library is not glibc."""
    if (libc := glibc()) is None:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    libc.mallopt(m_mmap_max, 0)  # every block from the heap, none mapped on its own
    libc.mallopt(m_trim_threshold, -1)  # the heap's free top never trimmed (-1: off)


def return_freed_memory() -> None:
    """Give the memory freed since `reuse_freed_memory` back to the system, at the end of a run, for what
    the process (a notebook, a script) does next."""
    if (libc := glibc()) is not None:
        libc.malloc_trim(0)


def cpu_computes_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes in bf16 natively (AVX-512 BF16 or AMX, from Linux's /proc/cpuinfo, or
    ``cpuinfo``'s text); None where that cannot be read. Without it bf16 autocast is emulated, and slower
    than fp32 (docs/benchmarks.md)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    first = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    return first is not None and bool({"avx512_bf16", "amx_bf16"} & set(first[1].split()))


def device_backend(requested: str | None = None) -> tuple[str, str | None]:
    """(device type, process-group backend): cuda → nccl, Intel XPU → xccl when torch has it natively,
    else ccl from the `[xpu]` extra, cpu → gloo. `requested` overrides the backend."""
    if torch.cuda.is_available():
        return "cuda", requested or "nccl"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        if requested or torch.distributed.is_backend_available("xccl"):
            return "xpu", requested or "xccl"
        for module in ("intel_extension_for_pytorch", "oneccl_bindings_for_pytorch"):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ImportError(
                    f"this torch has no native xccl backend and {module} is missing: install the [xpu] extra "
                    "(intel-extension-for-pytorch, oneccl_bind_pt) or a torch with xccl"
                ) from err
        return "xpu", "ccl"
    return "cpu", requested or "gloo"


def resolve_device(name: str | None) -> torch.device:
    """The device `name` (cpu, cuda, cuda:1, xpu, ...), or the best available: CUDA, Intel XPU, CPU."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return torch.device("xpu")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise OptionError(f"--device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--device {name}: CUDA is not available")
    return device


def say(accelerator: Accelerator, message: str) -> None:
    """Print `message` once per job, on rank 0: a job over several nodes writes one log (Accelerate's
    print prints once per node)."""
    if accelerator.is_main_process:
        print(message, flush=True)
