"""The runner: parses a command's options (`dpo_inv.commands` lists the commands), runs it and owns its
exit status and its one-line errors.

A command is a module of `dpo_inv.commands`: its docstring (the `--help` text), `Config` (the dataclass of
its options), `run(config)`, and optionally `POSITIONAL = (field, METAVAR, what)`, a field that may also be
given as the one positional argument, and `EPILOG`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import traceback
from types import ModuleType
from typing import Any, NoReturn

import torch
import yaml
from trl import TrlParser

from dpo_inv.data.progress import quiet_datasets
from dpo_inv.errors import BadInput, DataError
from dpo_inv.training.exits import EXIT_BAD_INPUT
from dpo_inv.training.launch import setup_environment, threads_per_process
from dpo_inv.training.stopping import TrainingStopped, leave_process_group
from dpo_inv.training.trl_options import NOT_APPLICABLE, not_applicable

# A path the user named that is not there or cannot be used; any OSError naming its path (disk full) too.
PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
BUG_FRAMES = 3  # the frames of a bug's traceback printed without --debug


def is_bad_input(err: BaseException) -> bool:
    """A `BadInput` (its kinds in `dpo_inv.errors`), or an OSError about a path; anything else is a bug."""
    path_error = isinstance(err, PATH_ERRORS) or (isinstance(err, OSError) and err.filename is not None)
    return isinstance(err, BadInput) or path_error


def error_lines(prog: str, message: str, where: str = "") -> str:
    """Every line of ``message`` after the one prefix of every error line: `[rank R: ]PROG: error: `."""
    return "".join(f"{where}{prog}: error: {line}\n" for line in message.splitlines() or [""])


def prog_of(command: str, prog: str) -> str:
    """How the user ran the command: `dpo-inv score`, `python -m dpo_inv score`, `python -m dpo_inv.run`."""
    return prog if prog.endswith(".run") else f"{prog} {command}"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the command's docstring kept as written."""


def command_parser(command: ModuleType, prog: str) -> TrlParser:
    """The parser of a command: the fields of its `Config`, TRL's `--config FILE.yaml`, `--debug`, the
    positional argument if it has one; a short usage line, and `--no_X` described as what it does."""
    positional = getattr(command, "POSITIONAL", None)
    first = positional[1] if positional else "[--config FILE.yaml]"
    usage = f"%(prog)s {first} [--option value ...] (--help: all)"
    parser = TrlParser(
        dataclass_types=[command.Config], prog=prog, description=command.__doc__,
        epilog=getattr(command, "EPILOG", None), formatter_class=HelpFormatter, usage=usage,
        allow_abbrev=False,  # --learning_rat is a typo, not learning_rate
    )  # fmt: skip
    for action in parser._actions:
        if isinstance(action, argparse._StoreFalseAction) and action.option_strings[0].startswith("--no_"):
            action.help, action.default = f"Turn --{action.dest} off.", argparse.SUPPRESS
        if getattr(action.type, "__name__", None) == "string_to_bool" and action.nargs is None:
            action.nargs, action.const = "?", True  # `--bf16` alone, for a flag whose default is None
    parser.add_argument(
        "--debug",
        action="store_true",
        help="Print the whole traceback: of bad input too, of a bug in dpo_inv all its frames.",
    )
    if positional:
        parser.add_argument("positional", nargs="?", metavar=positional[1], help=f"The {positional[2]}.")
    return parser


def exit_bad_input(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 and one line, as argparse's errors end (without their usage text)."""
    parser.exit(EXIT_BAD_INPUT, error_lines(parser.prog, message))


def parse(command: str, args: list[str] | None = None, prog: str = "dpo-inv") -> tuple[Any, bool]:
    """A command's options and `--debug`, from `--config FILE.yaml` plus `--field value` overrides (the
    command line wins). A bad value or an unknown key of the file exits with status 2 and one line; an
    unknown key is named with the closest option."""
    module = importlib.import_module(f"dpo_inv.commands.{command}")
    parser = command_parser(module, prog_of(command, prog))
    args = list(sys.argv[1:] if args is None else args)
    try:
        config, namespace, from_file, unknown = parser.parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except (ValueError, OSError, yaml.YAMLError) as err:
        exit_bad_input(parser, " ".join(str(err).split()))
    options = [action.dest for action in parser._actions]
    if unknown:
        named = [text.split("=")[0] for text in unknown if text.startswith("-")]
        if not named:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        exit_bad_input(parser, unknown_line("option", [name.lstrip("-") for name in named], options, "--"))
    keys = [text[2:] for text in from_file if text.startswith("--")]
    if keys:
        path = args[args.index("--config") + 1]
        exit_bad_input(parser, f"{path}: {unknown_line('key', keys, options)}")
    if positional := getattr(module, "POSITIONAL", None):
        field, metavar, what = positional
        if (namespace.positional is None) == (getattr(config, field) is None):
            parser.error(f"give the {what} once: {metavar} or --{field}")
        setattr(config, field, getattr(config, field) or namespace.positional)
    return config, namespace.debug


def unknown_line(kind: str, names: list[str], options: list[str], dashes: str = "") -> str:
    """What to say of unknown keys or options: for a TRL option that does not apply, why and what to write
    instead; else each named with the closest option."""
    for name in names:
        if (reason := not_applicable(name)) is not None:
            return f"{dashes}{reason}"
    known = [*options, *NOT_APPLICABLE]
    named = []
    for name in names:
        close = difflib.get_close_matches(name, known, 1)
        named.append(f"{dashes}{name}" + (f" (did you mean {dashes}{close[0]}?)" if close else ""))
    return f"unknown {kind} {', '.join(named)}"


def run(command: str, args: list[str] | None = None, prog: str = "dpo-inv") -> None:
    """Run a command and exit with its status: 0; a TrainingStopped's status (rank 0 says why);
    EXIT_BAD_INPUT on bad input (`is_bad_input`), with its line (a DataError: one per bad record, said by
    rank 0, which every rank raises together; under a launcher, another bad input is said by each rank
    that meets it, as `rank R: ...`); 1 on anything else, a bug: the last frames of its traceback and a
    line saying so, by each failing rank."""
    config, debug = parse(command, args, prog)
    module = importlib.import_module(f"dpo_inv.commands.{command}")
    # the launcher's variables read, not exported: the command sets its launch environment up itself
    launch = setup_environment(dict(os.environ))
    torch.set_num_threads(threads_per_process(launch.local_world_size))
    rank, ranks = str(launch.rank), launch.world_size
    where = f"rank {rank}: " if ranks > 1 else ""
    try:
        with quiet_datasets():
            module.run(config)
    except TrainingStopped as stopped:
        if rank == "0":
            print(stopped, flush=True)
        leave_process_group()
        leave(stopped.exit_code, ranks)
    except Exception as err:
        if not is_bad_input(err):
            report_bug(err, prog_of(command, prog), where, debug)
            leave(1, ranks)
        if debug:
            traceback.print_exc()
        if isinstance(err, DataError):  # `FILE:LINE: what is wrong; the fix`, a line per bad record
            if rank == "0":
                print(error_lines(prog_of(command, prog), str(err)), end="", file=sys.stderr, flush=True)
            leave_process_group()
        else:
            print(error_lines(prog_of(command, prog), str(err), where), end="", file=sys.stderr, flush=True)
        leave(EXIT_BAD_INPUT, ranks)


def report_bug(err: Exception, prog: str, where: str, debug: bool) -> None:
    """A bug in dpo_inv, not bad input: the last frames of the traceback (all with ``debug``), then the
    line that says so."""
    frames = "all its frames" if debug else f"its last {BUG_FRAMES} frames; --debug prints all"
    print(
        "".join(traceback.format_exception(err, limit=None if debug else -BUG_FRAMES)),
        end="",
        file=sys.stderr,
    )
    message = " | ".join(str(err).splitlines())
    said = (
        f"a bug in dpo_inv, not in your input: {type(err).__name__}: {message}; please report it with the "
        f"traceback above ({frames})"
    )
    print(error_lines(prog, said, where), end="", file=sys.stderr, flush=True)


def leave(status: int, ranks: int) -> NoReturn:
    """Exit with ``status``. One of several processes whose job ended early exits at once, its output
    flushed: the interpreter's shutdown could wait on, or abort in, collectives a stopped or failed rank
    will never complete (the trackers have ended and the checkpoint is written by then)."""
    if ranks > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
