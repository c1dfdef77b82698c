"""The device check, `scripts/gpu_check.sh`, on the CPU: what a GPU session runs once in its few minutes must
work there the first time — its matrix of benchmark processes, their status lines and the table it prints
last (tiny, `SMOKE=1`; the CUDA graphs, the fused kernels' layers and the compiled run need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

RUNS = ["pairs fp32", "L30 fp32", "pairs bf16", "L30 bf16"]


def test_the_device_check_runs_its_matrix_and_prints_its_table(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "SMOKE": "1",
        "PRECOMPUTE": "false",
        "OUT": str(out),
        "WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
    }
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr

    lines = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    statuses = [line for line in lines if "gpu_check_status" in line]
    # one process per precision and mode, fp32 with the kernels off only (they run on bf16 and fp16)
    assert [(line["gpu_check_status"], line["fused"]) for line in statuses] == [
        ("ok", "off"),
        ("ok", "off"),
        ("ok", "on"),
    ]
    assert all(line["measured"] == len(line["expect"]) == 2 for line in statuses)
    rows = {(line["run"], line["fused"]): line for line in lines if "run" in line}
    assert set(rows) == {(run, "off") for run in RUNS} | {("pairs bf16", "on"), ("L30 bf16", "on")}
    for row in rows.values():
        assert row["fused_kernels"] == (row["fused"] == "on")
        assert row["pairs_per_second"] > 0 and row["megabytes_moved_per_pair"]["total"] > 0

    table = result.stdout[result.stdout.index("\ndevice: ") :].split("\n")[1:]
    assert table[0].startswith(f"device: {rows['pairs fp32', 'off']['device']}")
    assert table[1].split()[:2] == ["run", "batch"]
    cells = {" ".join(line.split()[:2]): line.split()[2:] for line in table[2:] if line.strip()}
    assert list(cells) == RUNS
    for run, (batch, off, on, *_, speedup) in cells.items():
        assert batch == "2" and float(off) == pytest.approx(rows[run, "off"]["pairs_per_second"], abs=0.01)
        if "fp32" in run:
            assert on == speedup == "-"
        else:
            assert float(on) == pytest.approx(rows[run, "on"]["pairs_per_second"], abs=0.01)
            # of the measured rows, not of the cells' two decimals (at 0.03 pairs/s those are 10% apart)
            ratio = rows[run, "on"]["pairs_per_second"] / rows[run, "off"]["pairs_per_second"]
            assert float(speedup.rstrip("x")) == pytest.approx(ratio, abs=0.01)
