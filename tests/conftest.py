"""Shared paths and helpers: tests run on the real structures and pairs under ../shared and data/."""

import contextlib
import gzip
import io
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from dpo_inv.cli import run as run_command

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
STRUCTURES = SHARED / "structures"
SHARED_DATA = SHARED / "data"
EXAMPLE = ROOT / "data"
STABILITY = SHARED / "stability"


def stability_rows(domains: tuple[str, ...], per_domain: int, stride: int = 7) -> list[dict]:
    """Every `stride`-th single mutant of each stability domain, up to `per_domain`, with an absolute
    pdb_file (fields: domain, pdb_file, chain_id, sequence, wildtype_seq, position, score, label)."""
    rows: dict[str, list[dict]] = {d: [] for d in domains}
    for line in (STABILITY / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["domain"] in rows:
            rows[row["domain"]].append({**row, "pdb_file": str(STABILITY / row["pdb_file"])})
    return [r for d in domains for r in rows[d][::stride][:per_domain]]


def gunzip(path: Path, directory: Path) -> Path:
    """Plain-text copy of a gzipped structure (the reference parser reads only plain PDB)."""
    target = directory / path.name.removesuffix(".gz")
    with gzip.open(path, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


# System programs some tests run, and what installs them: such a test skips, saying so, where one is missing
PROGRAMS = {"mpiexec": "MPICH's mpiexec (.ci/run installs it: apt-get install mpich)",
            "g++": "a C++ compiler for torch.compile's CPU code (apt-get install g++)"}  # fmt: skip


def command_in_process(
    command: str, *args: str, prog: str = "python -m dpo_inv", cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`python -m dpo_inv COMMAND ARGS` (`prog` the name it says, "python -m dpo_inv.run" for training) run
    from the folder `cwd` in the test's process, with no interpreter of its own to start and import torch,
    Transformers and TRL (7-10 s on two cores): its exit status and output, as `subprocess.run` gives them;
    torch's threads, which the runner sets, as they were."""
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_command(command, list(args), prog=prog)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def train_in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m dpo_inv.run ARGS` in the test's process (`command_in_process`)."""
    return command_in_process("train", *args, prog="python -m dpo_inv.run")


def needs_program(name: str) -> None:
    """Skip the calling test, naming what to install, when the system program ``name`` is missing."""
    if shutil.which(name) is None:
        pytest.skip(f"no {name} on this machine: needs {PROGRAMS[name]}")


# Under pytest-xdist (`make test` runs two workers) each worker computes on its share of the cores, and so do
# the commands its tests start (OMP_NUM_THREADS, unless set): a run's threads, and so its sums, do not depend
# on what the other worker was doing when it started; a command that asks for more threads (one whose numbers
# a page quotes) lets a thread waiting for a core sleep instead of spinning
def pytest_configure() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The test files that take longest, longest first (`pytest --durations`): `make test` hands whole files to its
# workers in the order collected (--dist loadfile --no-loadscope-reorder), and a long file handed out last
# would run alone at the end while the other worker waits
LONGEST_FILES = ["test_tour.py", "test_unpaired_and_residue.py", "test_propose.py", "test_train.py",
                 "test_rounds.py", "test_peft.py", "test_fused.py", "test_reliability.py",
                 "test_bad_input.py", "test_notebook.py"]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if missing := [name for name in LONGEST_FILES if not (ROOT / "tests" / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FILES names no file {missing}: update it")
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# `make test-fast` (-m "not slow") fails when a test not marked slow runs longer: mark it, or speed it up
UNMARKED_LIMIT_S = float(os.environ.get("UNMARKED_LIMIT_S", 10.0))  # lower in test_fast_suite's own runs
too_slow: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > UNMARKED_LIMIT_S and "slow" not in report.keywords:
        too_slow.append(f"{report.nodeid} took {report.duration:.1f} s")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("markexpr") == "not slow" and too_slow:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if config.getoption("markexpr") == "not slow" and too_slow:
        terminalreporter.section(f"tests not marked slow that took over {UNMARKED_LIMIT_S:.0f} s")
        for line in too_slow:
            terminalreporter.write_line(f"{line}: mark it @pytest.mark.slow, or make it faster")


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


Background = Callable[..., subprocess.Popen]


@pytest.fixture
def background() -> Iterator[Background]:
    """Start commands in the background, each in a session of its own with its output going to a log file;
    those still going at the end of the test are killed with their children."""
    started: list[subprocess.Popen] = []

    def start(command: Sequence[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen:
        with open(log, "w") as handle:
            process = subprocess.Popen(
                list(command),
                cwd=cwd,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
