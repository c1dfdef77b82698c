"""The quickstart notebook runs from top to bottom in a fresh kernel, and is kept without outputs."""

import json

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_the_notebook_is_committed_without_outputs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert code and all(not cell["outputs"] and cell["execution_count"] is None for cell in code)


@pytest.mark.slow
def test_the_quickstart_notebook_runs(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "data").symlink_to(ROOT / "data")  # the notebook reads ../data, writes under examples/
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=900, resources={"metadata": {"path": str(tmp_path / "examples")}}
    ).execute()
    text = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "38 pairs; base model prefers" in text and "tuned model: reward accuracy" in text
    assert (tmp_path / "examples" / "outputs" / "quickstart" / "final" / "config.json").is_file()
