"""The Python API (`import dpo_inv`): the names, the same numbers as the commands, data in memory
validated as files are, training on a DataFrame, rounds with a reward defined in Python, adaptation of a
model object."""

import dataclasses
import inspect
import json
import os
import subprocess
import types
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import EXAMPLE, stability_rows
from test_adapt import DOMAIN
from test_distributed import torchrun
from test_train import env

import dpo_inv
from dpo_inv import cli
from dpo_inv.campaign.config import ProposeConfig
from dpo_inv.data.dataset import load_records
from dpo_inv.models.variants import spearman
from dpo_inv.tools.adapt import AdaptConfig, AdaptOptions
from dpo_inv.tools.pairs import PairsConfig, PairsOptions, pairs_file
from dpo_inv.tools.sample import SampleConfig, SampleOptions
from dpo_inv.tools.scan import ScanConfig, ScanOptions
from dpo_inv.tools.score import ScoreConfig, ScoreOptions, score_file

PAIRS = EXAMPLE / "pairs" / "val.jsonl"
STRUCTURE = EXAMPLE / "structures" / "1eteA.pdb.gz"
API = {  # each function, the options it takes, and the options of its command
    dpo_inv.score: (ScoreOptions, ScoreConfig),
    dpo_inv.sample: (SampleOptions, SampleConfig),
    dpo_inv.scan: (ScanOptions, ScanConfig),
    dpo_inv.make_pairs: (PairsOptions, PairsConfig),
    dpo_inv.adapt: (AdaptOptions, AdaptConfig),
    dpo_inv.propose: (ProposeConfig, ProposeConfig),
}


def records(path: Path) -> list[dict]:
    """The records of a JSON lines file with absolute structure paths (as a notebook would hold them)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{**row, "pdb_file": str((path.parent / row["pdb_file"]).resolve())} for row in rows]


def test_every_name_is_importable_documented_and_typed():
    from dpo_inv import DPOConfig, RoundsConfig, load_model, make_pairs, rounds, sample, score, train  # noqa: F401

    for name in dpo_inv.__all__:
        value = getattr(dpo_inv, name)
        assert not isinstance(value, types.ModuleType), name
        assert inspect.getdoc(value), name
    for function in (*API, dpo_inv.train, dpo_inv.rounds, dpo_inv.load_model):
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, function.__name__
        assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values())


def test_the_functions_take_the_commands_options_with_their_defaults():
    """By construction: a function passes its keyword options to the dataclass its command's options derive
    from, so no default is written twice; an argument before them (the model) defaults as the command's
    option does; an unknown option is a TypeError that names it."""
    for function, (options, config) in API.items():
        assert issubclass(config, options), function.__name__
        parameters = inspect.signature(function).parameters
        assert list(parameters.values())[-1].kind is inspect.Parameter.VAR_KEYWORD, function.__name__
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        for name in set(parameters) & set(defaults):  # the arguments before the options: the model, ...
            assert parameters[name].default in (inspect.Parameter.empty, defaults[name]), function.__name__
        required = [p for p in parameters.values() if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        with pytest.raises(TypeError, match="num_sampels"):  # before any model or file is read
            function(*["missing"] * len(required), num_sampels=3)


def test_records_in_memory_load_as_the_file_does(tmp_path):
    rows = records(PAIRS)[:6]
    expected = load_records(PAIRS, tmp_path / "cache").records.to_dict()
    expected = {name: column[:6] for name, column in expected.items()}
    for data in (rows, pd.DataFrame(rows), datasets.Dataset.from_list(rows)):
        assert load_records(data, tmp_path / "cache").records.to_dict() == expected, type(data).__name__
    bad = pd.DataFrame(rows, index=range(10, 16))
    bad.loc[12, "preferred_seq"] = "ACDZ"
    bad.loc[14, "pdb_file"] = "missing.pdb"
    with pytest.raises(dpo_inv.DataError) as error:
        dpo_inv.score("vanilla/v_48_020", bad)
    lines = str(error.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("records record 12: preferred_seq has characters outside")
    assert lines[1].startswith(f"records record 14: structure file not found: {Path.cwd() / 'missing.pdb'}")


@pytest.mark.slow
def test_score_gives_the_numbers_of_the_command(tmp_path):
    pairs, output = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in records(PAIRS)[:8]))
    summary = score_file(ScoreConfig(data=str(pairs), output=str(output), reference="vanilla/v_48_020"))
    expected = [json.loads(line) for line in output.read_text().splitlines()]
    model = dpo_inv.load_model("vanilla/v_48_020")
    frame = dpo_inv.score(model, pd.DataFrame(records(pairs)), reference=model)
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(expected) == 8
    # the summary the command prints comes with the records
    assert frame.attrs["summary"].items() <= summary.items() and "accuracy" in frame.attrs["summary"]
    for name in ("preferred_logp", "unpreferred_logp", "preferred_reward"):
        assert frame[name].tolist() == [row[name] for row in expected], name
    assert dpo_inv.score("vanilla/v_48_020", str(pairs))[3]["preferred_logp"] == expected[3]["preferred_logp"]


def test_sample_gives_the_sequences_of_the_command(tmp_path):
    options = ["--num_samples", "3", "--output_dir", str(tmp_path), "--seed", "5"]
    cli.run("sample", ["--structure", str(STRUCTURE), *options])
    expected = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    designs = dpo_inv.sample("vanilla/v_48_020", STRUCTURE, num_samples=3, seed=5)
    assert designs == expected
    # the samples chain into scoring and pairing in memory
    scored = dpo_inv.score("vanilla/v_48_020", designs)
    assert [row["sequence"] for row in scored] == [row["sequence"] for row in designs]
    assert all(-4 < row["logp_per_residue"] < 0 for row in scored)
    pairs = dpo_inv.make_pairs([{**row, "score": row["recovery"]} for row in designs], strategy="all")
    assert pairs and all(row["pdb_file"] == str(STRUCTURE) for row in pairs)


def test_make_pairs_in_memory_matches_the_command(tmp_path):
    scored = [{**row, "score": i % 4} for i, row in enumerate(stability_rows((DOMAIN,), per_domain=30))]
    data = tmp_path / "scored.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in scored))
    output = tmp_path / "out" / "pairs.jsonl"
    options = {"strategy": "same_position", "min_margin": 1.0, "max_pairs_per_structure": 20}
    summary = pairs_file(PairsConfig(output=str(output), data=str(data), **options))
    expected = [json.loads(line) for line in output.read_text().splitlines()]
    pairs = dpo_inv.make_pairs(pd.DataFrame(scored), **options)
    assert len(pairs) == summary["pairs"] == len(expected) > 0
    assert pairs.drop(columns="pdb_file").to_dict("records") == [
        {k: v for k, v in row.items() if k != "pdb_file"} for row in expected
    ]
    assert (output.parent / expected[0]["pdb_file"]).resolve() == Path(pairs.pdb_file[0])


@pytest.mark.slow
def test_train_on_a_dataframe_returns_the_model_and_its_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # records in memory: structure paths relative to the working directory
    rows = [
        {**row, "pdb_file": os.path.relpath(row["pdb_file"], tmp_path)}
        for row in records(EXAMPLE / "pairs" / "train.jsonl")[:8]
    ]
    config = dpo_inv.DPOConfig(
        output_dir="out",
        max_steps=2,
        per_device_train_batch_size=4,
        report_to="none",
        logging_steps=1,
        eval_split=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    assert config.report_to == ["none"]
    model, metrics = dpo_inv.train(config, train_dataset=pd.DataFrame(rows), eval_dataset=records(PAIRS)[:4])
    assert isinstance(model, dpo_inv.ProteinMPNN) and not model.training
    assert 0 < metrics["loss"] < 1 and "eval_loss" in metrics and "eval_recovery" in metrics
    saved = dpo_inv.load_model(tmp_path / "out" / "final")
    assert all(
        torch.equal(a, b)
        for a, b in zip(saved.state_dict().values(), model.state_dict().values(), strict=True)
    )
    # config.yaml names the data, saved with absolute paths: the command line can train on it again
    again, _ = cli.parse("train", ["--config", str(tmp_path / "out" / "config.yaml")])
    assert Path(again.train_file) == Path("out/train_dataset.jsonl")
    first = json.loads(Path(again.train_file).read_text().splitlines()[0])
    assert first["pdb_file"] == str(EXAMPLE.resolve() / "structures" / Path(rows[0]["pdb_file"]).name)
    # a second job in the process, in another precision, as a notebook's next cell: refused for its data,
    # not by Accelerate for the first job's precision
    bad = pd.DataFrame(rows)
    bad.loc[3, "unpreferred_seq"] = "AAA"
    with pytest.raises(dpo_inv.DataError, match=r"^train_dataset record 3: unpreferred_seq has length 3 but"):
        dpo_inv.train(
            dataclasses.replace(config, output_dir="bad", mixed_precision="bf16"), train_dataset=bad
        )
    assert AcceleratorState().mixed_precision == "bf16"


@pytest.mark.slow
def test_rounds_call_a_reward_defined_in_python(tmp_path):
    calls = []

    def hydrophilic(batch: list[dict]) -> list[float]:
        calls.append(len(batch))
        return [-sum(aa in "AVILMFWYC" for aa in r["sequence"]) / len(r["sequence"]) for r in batch]

    targets = tmp_path / "targets.jsonl"
    targets.write_text(json.dumps({"pdb_file": str(STRUCTURE), "chain_id": "A"}) + "\n")
    config = dpo_inv.RoundsConfig(
        targets_file=str(targets),
        output_dir=str(tmp_path / "out"),
        num_rounds=1,
        num_samples=4,
        sampling_batch_size=4,
        max_steps=1,
        report_to="none",
        per_device_train_batch_size=2,
        cache_dir=str(tmp_path / "cache"),
    )
    lines = dpo_inv.rounds(config, reward=hydrophilic)
    assert calls == [4, 4] and [line["round"] for line in lines] == [0, 1]
    samples = [
        json.loads(line) for line in (tmp_path / "out" / "round-0" / "samples.jsonl").read_text().splitlines()
    ]
    assert [s["reward"] for s in samples] == hydrophilic(samples)[:4]
    with pytest.raises(ValueError, match="give either reward"):
        dpo_inv.rounds(
            dataclasses.replace(config, reward="dpo_inv.tools.rewards:exposed_hydrophobic"), hydrophilic
        )


def test_adapt_a_model_object_without_changing_it(tmp_path):
    rows = stability_rows((DOMAIN,), per_domain=40, stride=5)
    model = dpo_inv.load_model("vanilla/v_48_020")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    adapted, report = dpo_inv.adapt(
        pd.DataFrame(rows),
        model,
        output_dir=str(tmp_path / "out"),
        score_field="score",
        max_steps=(5, 10),
        num_folds=3,
        cache_dir=str(tmp_path / "cache"),
    )
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert report["labelled"] == len(rows) and report["data"] == "records"
    assert json.loads((tmp_path / "out" / "adapt.json").read_text())["decision"] == report["decision"]
    saved = dpo_inv.load_model(tmp_path / "out" / "final")
    assert all(
        torch.equal(a, b)
        for a, b in zip(saved.state_dict().values(), adapted.state_dict().values(), strict=True)
    )
    # the returned model and the ridge saved beside it chain into score, in the label's field name
    scored = dpo_inv.score(adapted, pd.DataFrame(rows), ridge=report["final_ridge"], cache_dir=str(tmp_path))
    assert {"delta_logp", "predicted_score"} <= set(scored.columns)
    assert spearman(scored.predicted_score.to_numpy(), scored.score.to_numpy()) > 0.5


SCRIPT = """
import os
import sys
from pathlib import Path

import pandas as pd

import dpo_inv

source, output_dir, cache_dir = map(Path, sys.argv[1:])
pairs = pd.read_json(source, lines=True).head(8)
pairs["pdb_file"] = [str(source.parent / path) for path in pairs.pdb_file]
config = dpo_inv.DPOConfig(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2,
                           logging_steps=1, eval_split=0.0, report_to="none", cache_dir=str(cache_dir))
model, metrics = dpo_inv.train(config, train_dataset=pairs)
sys.stdout.flush()
os.write(1, f"trained: loss {metrics['loss']:.6f}\\n".encode())  # one write: the ranks share the output
"""


@pytest.mark.slow
def test_a_script_calling_train_runs_on_every_process_of_a_launch(tmp_path):
    script = tmp_path / "my_training.py"
    script.write_text(SCRIPT)
    output = tmp_path / "out"
    args = (str(EXAMPLE / "pairs" / "train.jsonl"), str(output), str(tmp_path / "cache"))
    command = [*torchrun(), str(script), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env(tmp_path), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Parameters identical on all 2 process(es)" in result.stdout
    losses = [line for line in result.stdout.splitlines() if line.startswith("trained: loss")]
    assert len(losses) == 2 and losses[0] == losses[1]  # every rank returns the gathered metrics
    assert len((output / "metrics.jsonl").read_text().splitlines()) == 2  # one writer
    assert len((output / "train_dataset.jsonl").read_text().splitlines()) == 8
