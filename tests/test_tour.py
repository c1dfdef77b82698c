"""The tour as a newcomer walks it: every shell block of README.md and docs/*.md, run as written, page by
page, in a fresh copy of the repository with `.venv` active and `../shared` beside it; every output a page
shows (a plain fenced block after a shell block) and every number it quotes (QUOTES) must be what the
commands printed. A line that needs a cluster, a GPU, a long run or the test suite itself is left out with
its reason (SKIPPED), as is a command that ran already on an earlier page."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT

PAGES = ["README.md", *(f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md")))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SHELL = ("bash", "sh", "shell")
TIMINGS = {"seconds"}  # keys of a JSON line shown in the docs whose values differ from run to run

# (page, the start of a command line) -> why it is not run
SKIPPED = {
    ("README.md", "make test "): "the test suite itself",
    ("README.md", "make test-fast"): "the test suite itself",
    ("README.md", ".venv/bin/python -m pytest"): "the test suite itself",
    ("README.md", "make stability"): "12 minutes; tests/test_stability.py runs its steps",
    ("README.md", "make kto-example"): "test_unpaired_and_residue.py runs it, checks the accuracy",
    ("README.md", "make residpo-example"): "test_unpaired_and_residue.py runs it, checks the accuracy",
    ("README.md", "make rounds-example"): "test_rounds.py runs it and checks the numbers the README quotes",
    ("docs/rounds.md", "make rounds-example"): "test_rounds.py runs it and checks what the page shows",
    ("docs/losses.md", "make kto-example"): "test_unpaired_and_residue.py runs it, checks the accuracy",
    ("docs/losses.md", "make residpo-example"): "test_unpaired_and_residue.py runs it, checks the accuracy",
    ("README.md", "python -m dpo_inv.run --config configs/example.yaml "): "make example ran it (fp32)",
    ("README.md", "torchrun --nproc_per_node 8"): "8 GPUs",
    ("README.md", "scripts/run_dpo_local.sh 2"): "tests/test_distributed.py runs it with two processes",
    ("README.md", "sbatch"): "a SLURM cluster",
    ("README.md", "qsub"): "a PBS cluster",
    ("README.md", "python scripts/benchmark.py "): "a benchmark: minutes of timing (docs/benchmarks.md)",
    ("README.md", "python scripts/benchmark_data.py"): "a benchmark: minutes of timing (docs/benchmarks.md)",
    ("docs/benchmarks.md", "python scripts/benchmark.py --train_file data/ligand"): "a benchmark: 5 minutes",
    ("docs/benchmarks.md", "python scripts/benchmark.py --mixed_precision bf16"): "a GPU",
    ("docs/benchmarks.md", "python scripts/benchmark.py --dataloader_num_workers"): "a GPU",
    ("docs/benchmarks.md", "python scripts/benchmark.py --find_max_length"): "a GPU",
    ("docs/benchmarks.md", "make setup TORCH="): "a GPU machine's set-up",
    ("docs/benchmarks.md", ".venv/bin/pip install nvidia-ml-py"): "a GPU machine's set-up",
    ("docs/benchmarks.md", "accelerate launch --config_file accelerate_configs/multi"): "several GPUs",
    ("docs/campaigns.md", "python scripts/campaign_benchmark.py --suite"): "the campaign suite: 4-16 minutes",
    ("docs/campaigns.md", "python $B"): "a simulated campaign benchmark: minutes to hours",
    ("docs/campaigns.md", "for scan in"): "simulated campaigns on 12 scans: an hour",
    ("docs/campaigns.md", "python scripts/campaign_benchmark.py --scan"): "simulated campaigns: an hour",
    ("docs/campaigns.md", "done"): "simulated campaigns on 12 scans: an hour",
    ("docs/training.md", "python -m dpo_inv.run --config configs/lora_example"): "make lora-example ran it",
    ("docs/training.md", "python -m dpo_inv score --model outputs/lora_example"): "make lora-example ran it",
    ("docs/sft.md", "python -m dpo_inv.run --loss_type sft"): "200 steps, 10 minutes; sft-example runs 60",
    ("docs/sft.md", "python -m dpo_inv.run --model_name_or_path outputs/sft/final"): "needs the line above",
    ("docs/stability.md", "python scripts/split_by_domain.py"): "make stability's steps (12 minutes)",
    ("docs/stability.md", "python -m dpo_inv pairs outputs/stability"): "make stability's steps (12 minutes)",
    ("docs/stability.md", "python -m dpo_inv.run --config configs/stability.yaml"): "make stability (12 min)",
    ("docs/stability.md", "python -m dpo_inv score --model outputs/stability"): "make stability's model",
    ("docs/stability.md", "python scripts/stability_experiments.py"): "the experiments: hours on 2 cores",
    ("docs/training.md", "python -m dpo_inv.run --config configs/example.yaml --mixed_precision bf16"): (
        "make example ran this config in fp32, the numbers the pages quote (bf16 steps: test_speed, "
        "test_precision)"
    ),
}


def lab(folder: Path) -> None:
    """The lab of the TrpB campaign: the latest round's proposals measured by looking them up in the
    landscape, written as that round's measurements.csv."""
    landscape = folder.parent / "shared" / "campaign" / "trpb"
    sites = json.loads((landscape / "landscape.json").read_text())["site_indices"]
    with open(landscape / "variants.csv") as handle:
        fitness = {row["variant"]: row["fitness"] for row in csv.DictReader(handle)}
    latest = max((folder / "campaigns" / "trpb").glob("round_*"), key=lambda path: int(path.name[6:]))
    with open(latest / "proposals.csv") as handle:
        rows = list(csv.DictReader(handle))
    values = [fitness.get("".join(row["sequence"][i] for i in sites), "NA") for row in rows]
    lines = [f"{row['mutations']},{value}" for row, value in zip(rows, values, strict=True)]
    (latest / "measurements.csv").write_text("mutations,value\n" + "\n".join(lines) + "\n")


# `make example`, whose numbers the walk checks, runs in fp32, as it does where the CPU emulates bf16 (the
# line the README quotes); the other make targets it runs (`sft-example`, `lora-example`, `ligand-example`,
# whose output it does not check) run as `make` chooses on this CPU: bf16 where the CPU computes it natively
IN_FP32 = {("README.md", "make example")}

# (page, the start of a command line) -> what the user does before it
BEFORE = {
    ("README.md", "python -m dpo_inv propose --campaign campaigns/trpb\n"): lab,
    ("docs/campaigns.md", "python -m dpo_inv propose --campaign campaigns/trpb\n"): lab,
}

# (page, what the page says, what a command printed): the page still says it and a command printed it
QUOTES = [
    (
        "README.md",
        "on six held-out structures the fine-tuned model\nprefers the preferred sequence of 89%",
        "reward accuracy 0.895",
        None,
    ),
    (
        "README.md",
        "`0.823 (start 0.7612, augmented ridge 0.7451, ...)`",
        "cross-validated Spearman 0.823 (start 0.7612, augmented ridge 0.7451,",
        None,
    ),
    ("README.md", 'at `"spearman": 0.805`', '"spearman": 0.805', None),
    ("docs/adapt.md", 'reports `"spearman": 0.805`', '"spearman": 0.805', None),
    (
        "docs/design.md",
        "log_likelihood=-0.801|recovery=0.472",
        "log_likelihood=-0.801|recovery=0.472",
        "outputs/designs/3ny7A.fa",
    ),
]


def shell_blocks(page: str, root: Path = ROOT) -> list[tuple[str, str | None]]:
    """Each shell block of a page and the plain block that follows it (its shown output), if any."""
    blocks = FENCE.findall((root / page).read_text())
    return [
        (text, following[1] if following[0] == "" else None)
        for (language, text), following in zip(blocks, [*blocks[1:], ("x", "")][: len(blocks)], strict=True)
        if language in SHELL
    ]


def skip_reason(page: str, line: str, ran: set[str]) -> str | None:
    """Why a command line is not run, or None."""
    for (where, start), reason in SKIPPED.items():
        if where == page and line.lstrip().startswith(start.rstrip("\n")):
            return reason
    if command(line) in ran and not line.startswith("cd "):
        return "ran above"
    return None


def command(line: str) -> str:
    """A command line without its trailing comment."""
    return re.sub(r"\s+#.*$", "", line)


def lines_of(block: str) -> list[str]:
    """The command lines of a block, continuations joined, comments and blank lines left out."""
    joined = block.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def shown_line_printed(line: str, printed: str) -> bool:
    """A line a page shows as output is among the printed lines (a JSON line: equal but for timings)."""
    if line in printed:
        return True
    try:
        shown = json.loads(line)
    except json.JSONDecodeError:
        return False
    for candidate in printed.splitlines():
        try:
            found = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        same_keys = isinstance(found, dict) and found.keys() == shown.keys()
        if same_keys and all(found[key] == shown[key] for key in shown.keys() - TIMINGS):
            return True
    return False


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory) -> Path:
    """The repository's files (tracked, and new ones not ignored) copied into a new folder, with `.venv` and
    `../shared` linked beside them, as a user's clone after `make setup`."""
    root = tmp_path_factory.mktemp("tour")
    folder = root / "dpo_inv"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()  # fmt: skip
    for name in files:
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    if (ROOT.parent / "shared").is_dir():
        (root / "shared").symlink_to(ROOT.parent / "shared")
    return folder


@dataclass
class Walk:
    """A newcomer's walk through the pages in one folder: what ran, what it printed, what failed."""

    folder: Path
    env: dict[str, str]
    ran: set[str] = field(default_factory=set)
    printed: str = ""
    left_out: list[str] = field(default_factory=list)
    shown: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def run(self, page: str, lines: list[str]) -> bool:
        """Run command lines as one bash script (so `cd` and variables hold); False when one fails."""
        if not [line for line in lines if not line.startswith("cd ")]:
            return True
        script = "set -eo pipefail\n" + "\n".join(lines) + "\n"
        fp32 = any((page, command(line).strip()) in IN_FP32 for line in lines)
        env = {**self.env, "EXAMPLE_PRECISION": "no"} if fp32 else self.env
        start = time.monotonic()
        result = subprocess.run(["bash", "-c", script], cwd=self.folder, env=env, capture_output=True,
                                text=True, timeout=1800)  # fmt: skip
        output = result.stdout + result.stderr
        print(f"{page}: {time.monotonic() - start:.0f} s: {lines[-1][:80]}", flush=True)
        self.printed += output
        if result.returncode != 0:
            self.failed.append(f"{page}: exit {result.returncode}:\n{script}{output[-2000:]}")
        return result.returncode == 0

    def block(self, page: str, block: str, shown: str | None) -> None:
        """Run a block's lines but those left out (a user's step before a line first), until one fails;
        keep the output it shows to compare."""
        pending: list[str] = []
        left_out = 0
        for line in lines_of(block):
            if reason := skip_reason(page, line, self.ran):
                self.left_out.append(f"{page}: {line[:70]}: {reason}")
                left_out += reason != "ran above"
                continue
            step = next((f for (p, s), f in BEFORE.items() if p == page and line == s.strip()), None)
            if step is not None:
                if not self.run(page, pending):
                    return
                pending = [line for line in pending if line.startswith("cd ")]
                step(self.folder)
            pending.append(line)
            self.ran.add(command(line))
        if not self.run(page, pending):
            return
        if shown and left_out:  # what a line left out would print
            self.left_out.append(f"{page}: the output shown after {lines_of(block)[0][:50]}")
        elif shown:
            self.shown += [(page, line) for line in shown.splitlines() if line not in ("", "...")]


@pytest.mark.slow
def test_every_command_of_the_docs_runs_as_written_and_prints_what_they_quote(fresh_copy):
    venv = Path(sys.executable).parent
    installed = venv.parent / ".installed"
    assert installed.is_file() and all(
        installed.stat().st_mtime >= (ROOT / name).stat().st_mtime for name in ("setup.cfg", "pyproject.toml")
    ), "make setup first: make would reinstall the environment"
    # two threads, as the pages' numbers were measured: on a busy machine a run would take one and round apart
    env = {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv.parent),
           "OMP_NUM_THREADS": "2"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    env.pop("EXAMPLE_PRECISION", None)
    walk = Walk(fresh_copy, env)
    for page in PAGES:
        for block, shown in shell_blocks(page, fresh_copy):
            walk.block(page, block, shown)

    problems = [f"{page} shows a line no command printed: {line}"
                for page, line in walk.shown if not shown_line_printed(line, walk.printed)]  # fmt: skip
    for page, says, printed, file in QUOTES:
        found = (fresh_copy / file).read_text() if file and (fresh_copy / file).is_file() else walk.printed
        if says not in (ROOT / page).read_text():
            problems.append(f"{page} no longer says {says!r} (update QUOTES)")
        elif printed not in found:
            problems.append(f"{page} says {says!r} but {file or 'no command'} printed {printed!r}")
    (fresh_copy.parent / "tour.log").write_text(walk.printed)
    print("\n".join(["left out:", *walk.left_out]))
    assert not walk.failed + problems, "\n\n".join(walk.failed + problems)
