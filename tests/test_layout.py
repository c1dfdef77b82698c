"""The package's layers: each subpackage imports only from itself and the layers before it, the bottom one
the module dpo_inv/errors.py; the commands (dpo_inv/commands/, the runner dpo_inv/cli.py, dpo_inv/run.py)
and the API (dpo_inv/__init__.py) may import anything, and no subpackage imports them."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dpo_inv"
ORDER = ("errors", "structures", "data", "models", "training", "tools", "campaign")  # bottom layer first
TOP = len(ORDER)  # the commands and the API
SUBPACKAGES = ORDER[1:]  # the layers below errors.py


def layer(module: str) -> int:
    """Layer of a module below dpo_inv: the index of its subpackage, TOP for the command modules."""
    first = module.split(".")[1] if "." in module else ""
    return ORDER.index(first) if first in ORDER else TOP


def imported(path: Path, source: str) -> list[str]:
    """Every dpo_inv module or package that ``source`` (the text of ``path``) imports, at any depth."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else ())
            module = ".".join(filter(None, (base, node.module)))
            names += [module] if module != "dpo_inv" else [f"dpo_inv.{a.name}" for a in node.names]
    return [name for name in names if name == "dpo_inv" or name.startswith("dpo_inv.")]


def upward_imports(path: Path, source: str) -> list[str]:
    """Imports of the module at ``path`` that break the layering, one line each."""
    own = layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    if own == TOP:
        return []
    where = path.relative_to(PACKAGE.parent)
    return [
        f"{where} ({ORDER[own]}) imports {name} ({ORDER[layer(name)] if layer(name) < TOP else 'a command'})"
        for name in imported(path, source)
        if layer(name) > own
    ]


def test_subpackages_are_the_layers_and_the_commands():
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert found == {*SUBPACKAGES, "commands"}
    assert {p.name for p in PACKAGE.glob("*.py")} == {
        "__init__.py",
        "__main__.py",
        "cli.py",
        "run.py",
        "errors.py",
    }


def test_no_module_imports_from_a_later_layer_or_a_command():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 30
    problems = [line for path in paths for line in upward_imports(path, path.read_text())]
    assert problems == []


def test_the_check_sees_an_upward_import():
    dataset = PACKAGE / "data" / "dataset.py"
    assert upward_imports(dataset, "from dpo_inv.models.mpnn import ProteinMPNN\n")
    assert upward_imports(dataset, "def f():\n    from dpo_inv import sample\n")
    assert upward_imports(PACKAGE / "models" / "mpnn.py", "from ..training import kto\n")
    assert not upward_imports(dataset, "from dpo_inv.structures import parse\nfrom . import batches\n")
    assert upward_imports(PACKAGE / "errors.py", "from dpo_inv.structures.parse import ALPHABET\n")
    assert not upward_imports(
        PACKAGE / "structures" / "parse.py", "from dpo_inv.errors import StructureError\n"
    )


def test_subpackage_inits_hold_a_docstring_only():
    for name in SUBPACKAGES:
        tree = ast.parse((PACKAGE / name / "__init__.py").read_text())
        assert ast.get_docstring(tree), name
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        assert not imports, name
