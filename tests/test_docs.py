"""README.md and docs/*.md: every relative link resolves; the commands they show agree with the Makefile."""

import re
import shlex
from pathlib import Path

from dpo_inv.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PROGRAM = re.compile(r"(\S*/)?scripts/\S+\.(py|sh)|dpo_inv(\.\w+)*|dpo-inv")

Command = tuple[str, str | None, dict[str, str]]  # program, first positional or --config, options


def code_blocks(text: str) -> list[str]:
    """The text of the fenced code blocks."""
    return [block.split("\n", 1)[1].rsplit("\n", 1)[0] for block in CODE_BLOCK.findall(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return CODE_BLOCK.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    for line in prose(text).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            name, n = anchor(match[1]), 0
            while (name if n == 0 else f"{name}-{n}") in found:
                n += 1
            found.add(name if n == 0 else f"{name}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of a page whose file or heading anchor does not exist, one line each."""
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif fragment and (file.suffix != ".md" or fragment not in anchors(file.read_text())):
            problems.append(f"{page.name}: {target}: no such heading")
    return problems


def parse_command(line: str) -> Command | None:
    """The dpo_inv module or script a shell line runs, its first positional or --config argument, and its
    options (``--name value ...``; a flag's value is '')."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    start = next((i for i, token in enumerate(tokens) if PROGRAM.fullmatch(token)), None)
    if start is None:
        return None
    program = tokens[start]
    if program in ("dpo_inv", "dpo-inv"):  # python -m dpo_inv COMMAND, dpo-inv COMMAND
        if (program == "dpo_inv" and tokens[start - 1 : start] != ["-m"]) or start + 1 == len(tokens):
            return None
        start += 1
        program = f"dpo_inv {tokens[start]}"
    args, options, name = tokens[start + 1 :], {}, None
    for token in args:
        if token.startswith("--"):
            name = token
            options[name] = ""
        elif name:
            options[name] = f"{options[name]} {token}".strip()
    key = args[0] if args and not args[0].startswith("-") else options.get("--config")
    return program, key, options


def doc_commands(text: str) -> list[Command]:
    """Commands in a page's code blocks (backslash continuations joined) and inline code spans."""
    lines = [line for block in code_blocks(text) for line in block.replace("\\\n", " ").splitlines()]
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose(text))]
    return [command for line in lines if (command := parse_command(line))]


def makefile() -> tuple[set[str], list[Command]]:
    """The Makefile's targets, and the commands of its recipes, with ``$(PY)`` as ``python`` and the
    variables that hold a plain value (``STABILITY_DIR := outputs/stability``) filled in."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+) *[?:]?= *([^$\n]*)$", text, re.MULTILINE)) | {"PY": "python"}
    targets = set(re.findall(r"^([\w.-]+):(?!=)", text, re.MULTILINE))
    commands = []
    for line in re.findall(r"^\t(.*)$", text, re.MULTILINE):
        line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), line)
        for part in re.split(r";|&&", line):
            if command := parse_command(part):
                commands.append(command)
    return targets, commands


def disagreements(text: str) -> list[str]:
    """Options a page gives to a command the Makefile runs (same program, same first positional or
    --config) with another value than the Makefile; values with a make or shell variable are not compared."""
    _, recipes = makefile()
    problems = []
    for program, key, options in doc_commands(text):
        for recipe_program, recipe_key, recipe_options in recipes:
            if (program, key) != (recipe_program, recipe_key) or key is None:
                continue
            for name in options.keys() & recipe_options.keys():
                ours, theirs = options[name], recipe_options[name]
                if "$" not in ours + theirs and ours != theirs:
                    problems.append(f"{program} {key}: {name} {ours} (Makefile: {theirs})")
    return problems


def test_every_relative_link_resolves():
    assert len(PAGES) > 5
    assert [problem for page in PAGES for problem in broken_links(page)] == []


def test_commands_agree_with_the_makefile():
    problems = [f"{page.name}: {problem}" for page in PAGES for problem in disagreements(page.read_text())]
    assert problems == []


def test_every_command_shown_exists():
    """Pages, scripts, tests and the Makefile run `python -m dpo_inv COMMAND` (`dpo-inv COMMAND`), `python -m
    dpo_inv.run` or a script of the repository: no other module of the package is a command."""
    files = [*PAGES, ROOT / "Makefile", *(ROOT / "scripts").iterdir(), *(ROOT / "tests").glob("*.py")]
    modules = {
        (path.name, module)
        for path in files
        for module in re.findall(r"""-m["', ]+f?["']?dpo_inv\.\{?(\w+)""", path.read_text())
        if module != "run"
    }
    assert modules == set()
    shown = {program for page in PAGES for program, _, _ in doc_commands(page.read_text())}
    assert {"dpo_inv.run", "dpo_inv score", "dpo_inv adapt", "dpo_inv propose"} <= shown
    commands = {program.split()[1].rstrip(":") for program in shown if program.startswith("dpo_inv ")}
    commands -= {"COMMAND"}
    assert commands <= set(COMMANDS)
    scripts = {program[program.index("scripts/") :] for program in shown if "scripts/" in program}
    assert {script for script in scripts if not (ROOT / script).exists()} == set()


def test_every_make_target_named_exists():
    targets, _ = makefile()
    named = {
        (page.name, target)
        for page in PAGES
        for snippet in code_blocks(page.read_text()) + re.findall(r"`([^`]+)`", prose(page.read_text()))
        for target in re.findall(r"(?:^|\n)make ([\w-]+)", snippet)
    }
    assert {"example", "test", "stability"} <= {target for _, target in named}
    assert {(page, target) for page, target in named if target not in targets} == set()


def test_the_checks_see_a_wrong_link_value_and_target(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# A title: here\n\n[ok](#a-title-here) [file](page.md) [gone](#nowhere) [lost](x.md)\n")
    assert broken_links(page) == ["page.md: #nowhere: no such heading", "page.md: x.md: no such file"]
    pairs = "python -m dpo_inv pairs outputs/stability/data/train.jsonl"
    wrong = f"```bash\n{pairs} \\\n    --strategy same_position --max_pairs_per_structure 9\n```"
    assert [problem.split(" (")[0] for problem in disagreements(wrong)] == [
        "dpo_inv pairs outputs/stability/data/train.jsonl: --max_pairs_per_structure 9"
    ]
    assert disagreements("`python -m dpo_inv.run --config configs/example.yaml --mixed_precision bf16`") == []
    assert "stability" in makefile()[0] and "stabilty" not in makefile()[0]
