"""On-policy rounds on real structures with real rewards: a two-process run, a reward that fails and a
resume that finishes, a reward command, the reward rising over rounds; the reward contract's errors."""

import json
import shutil
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLE, ROOT
from safetensors.torch import load_file
from test_distributed import torchrun
from test_tour import shell_blocks
from test_train import env

from dpo_inv.data.records import DataError
from dpo_inv.models.mpnn import derive_seed
from dpo_inv.models.weights import load_model
from dpo_inv.tools.reward_fn import RewardError, compute_rewards
from dpo_inv.tools.rounds import diversity, read_jsonl
from dpo_inv.tools.sample import SampleOptions, sample_structure
from dpo_inv.tools.targets import load_targets

STRUCTURES = EXAMPLE / "structures"
# a reward written by a user, in a file of its own: fewer hydrophobic residues is better
REWARD = """
def hydrophilic(records):
    return [-sum(aa in "AVILMFWYC" for aa in r["sequence"]) / len(r["sequence"]) for r in records]
"""
QUICK = (
    "--num_samples",
    "4",
    "--sampling_batch_size",
    "4",
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--per_device_train_batch_size",
    "2",
    "--save_steps",
    "1",
    "--learning_rate",
    "1e-4",
)


def targets(tmp_path: Path, names: tuple[str, ...] = ("2xcjA", "1lpbA")) -> Path:
    path = tmp_path / "targets.jsonl"
    path.write_text(
        "".join(
            json.dumps({"pdb_file": str(STRUCTURES / f"{n}.pdb.gz"), "chain_id": "A"}) + "\n" for n in names
        )
    )
    return path


def reward_file(tmp_path: Path, text: str = REWARD) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(text)
    return path


def rounds(
    tmp_path: Path, *args: str, launcher: tuple[str, ...] = (), check: bool = True, threads: int | None = None
):
    command = launcher or (sys.executable,)
    result = subprocess.run(
        [*command, "-m", "dpo_inv", "rounds", "--cache_dir", str(tmp_path / "cache"), *args],
        cwd=ROOT,
        env={**env(tmp_path), **({"OMP_NUM_THREADS": str(threads)} if threads else {})},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_two_processes_shard_the_targets_and_write_one_record(tmp_path):
    output = tmp_path / "out"
    launcher = torchrun()
    rounds(
        tmp_path,
        "--targets_file",
        str(targets(tmp_path)),
        "--reward",
        f"{reward_file(tmp_path)}:hydrophilic",
        "--output_dir",
        str(output),
        "--num_rounds",
        "1",
        *QUICK,
        launcher=launcher,
    )
    lines = read_jsonl(output / "rounds.jsonl")
    assert [line["round"] for line in lines] == [0, 1]
    assert lines[0]["num_samples"] == 8 and lines[0]["train_steps"] == 2 and lines[1]["num_pairs"] is None
    assert (output / "round-0" / "final" / "model.safetensors").is_file()
    assert (output / "round-0" / "pairs.jsonl").is_file() and (output / "plots" / "rounds.png").is_file()
    # each target's samples are those of its own seed, whichever rank drew them
    samples = read_jsonl(output / "round-0" / "samples.jsonl")
    loaded = load_targets(targets(tmp_path))
    model = load_model("vanilla/v_48_020")
    for index, design in enumerate(loaded.designs):
        options = SampleOptions(
            num_samples=4,
            batch_size=4,
            temperature=0.2,
            seed=derive_seed(42, 0, index),
        )
        with torch.no_grad():
            expected = [r["sequence"] for r in sample_structure(model, design, options, torch.zeros(21))]
        assert [s["sequence"] for s in samples if s["target"] == index] == expected
    assert all(
        s["reward"] == pytest.approx(-sum(a in "AVILMFWYC" for a in s["sequence"]) / len(s["sequence"]))
        for s in samples
    )


@pytest.mark.slow
def test_a_failing_reward_keeps_the_samples_and_resume_finishes(tmp_path):
    failing = (
        REWARD
        + """
calls = []
def flaky(records):  # fails in round 1, the second call of the process
    calls.append(len(records))
    if len(calls) == 2:
        raise RuntimeError("the structure predictor ran out of memory")
    return hydrophilic(records)
"""
    )
    output, reward = tmp_path / "out", reward_file(tmp_path, failing)
    args = (
        "--targets_file",
        str(targets(tmp_path)),
        "--output_dir",
        str(output),
        "--num_rounds",
        "2",
        *QUICK,
    )
    result = rounds(tmp_path, *args, "--reward", f"{reward}:flaky", check=False)
    assert result.returncode == 2
    expected = (
        f"round 1: reward {reward}:flaky raised RuntimeError: the structure predictor ran out of memory"
    )
    saved_in = f". The samples are saved in {output / 'round-1' / 'samples.jsonl'}"
    assert result.stdout.strip().splitlines()[-1].startswith(expected + saved_in)
    assert "Traceback" not in result.stderr
    saved = read_jsonl(output / "round-1" / "samples.jsonl")
    assert len(saved) == 8 and all("reward" not in s for s in saved)
    assert len(read_jsonl(output / "rounds.jsonl")) == 1  # round 0 only: round 1 is not finished
    rounds(tmp_path, *args, "--reward", f"{reward}:hydrophilic", "--resume_from_checkpoint", "latest")
    lines = read_jsonl(output / "rounds.jsonl")
    assert [line["round"] for line in lines] == [0, 1, 2]
    assert [s["sequence"] for s in read_jsonl(output / "round-1" / "samples.jsonl")] == [
        s["sequence"] for s in saved
    ]
    again = rounds(
        tmp_path,
        "--targets_file",
        str(targets(tmp_path)),
        "--reward",
        "x.py:f",
        "--output_dir",
        str(output),
        check=False,
    )
    assert again.returncode == 2 and "holds the rounds of another run" in again.stderr
    interrupted = tmp_path / "interrupted"  # a run whose reward failed in round 0 left only its samples
    (interrupted / "round-0").mkdir(parents=True)
    shutil.copy(output / "round-0" / "samples.jsonl", interrupted / "round-0")
    again = rounds(tmp_path, "--targets_file", str(targets(tmp_path)), "--reward", "x.py:f", "--output_dir",
                   str(interrupted), check=False)  # fmt: skip
    assert again.returncode == 2 and "holds the rounds of another run" in again.stderr


@pytest.mark.slow
def test_reward_command_and_its_errors(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(
        "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)\n"
        "    print(json.dumps(r['sequence'].count('K') / len(r['sequence'])))\n"
    )
    output = tmp_path / "out"
    rounds(
        tmp_path,
        "--targets_file",
        str(targets(tmp_path, ("2xcjA",))),
        "--reward_command",
        f"{sys.executable} {script}",
        "--output_dir",
        str(output),
        "--num_rounds",
        "1",
        *QUICK,
    )
    samples = read_jsonl(output / "round-0" / "samples.jsonl")
    assert [s["reward"] for s in samples] == [s["sequence"].count("K") / len(s["sequence"]) for s in samples]
    records = [
        {"pdb_file": "/x/1abc.pdb", "design_chains": ["A"], "fixed_chains": [], "sequence": "ACDEFGHIK"}
    ] * 2
    with pytest.raises(RewardError, match="returned 1 values for 2 records"):
        compute_rewards(records, None, "echo 1")
    with pytest.raises(RewardError, match=r"gave nan for record 2 \(1abc.pdb, sequence ACDEFGHIK...\)"):
        compute_rewards(records, None, "printf '1\\nNaN\\n'")
    with pytest.raises(RewardError, match="exited with status 3: broken"):
        compute_rewards(records, None, "echo broken >&2; exit 3")
    with pytest.raises(RewardError, match="has no function missing"):
        compute_rewards(records, "dpo_inv.tools.rewards:missing", None)
    with pytest.raises(RewardError, match="give path/to/file.py:function"):
        compute_rewards(records, "dpo_inv.tools.rewards", None)


@pytest.mark.slow
def test_bad_targets_and_options_exit_2_with_one_line_each(tmp_path):
    bad = tmp_path / "targets.jsonl"
    bad.write_text(
        json.dumps({"pdb_file": str(STRUCTURES / "2xcjA.pdb.gz"), "chain_id": "Z"})
        + "\n"
        + json.dumps({"pdb_file": "missing.pdb"})
        + "\n"
    )
    with pytest.raises(DataError) as err:
        load_targets(bad)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{bad}:1: ") and "chain" in lines[0]
    assert lines[1].startswith(f"{bad}:2: structure file not found")
    result = rounds(
        tmp_path,
        "--targets_file",
        str(bad),
        "--reward",
        "dpo_inv.tools.rewards:exposed_hydrophobic",
        "--output_dir",
        str(tmp_path / "out"),
        check=False,
    )
    said = [f"python -m dpo_inv rounds: error: {line}" for line in lines]  # each line so prefixed
    assert result.returncode == 2 and result.stderr.strip().splitlines() == said
    result = rounds(tmp_path, "--targets_file", str(bad), check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "error: give either reward (a Python function) or reward_command (a shell command)"
    )


def test_diversity_is_the_mean_identity_within_targets():
    samples = [
        {"target": 0, "sequence": "AAAA"},
        {"target": 0, "sequence": "AAAC"},
        {"target": 0, "sequence": "CCCC"},
        {"target": 1, "sequence": "KK"},
        {"target": 1, "sequence": "KK"},
    ]
    assert diversity(samples) == pytest.approx(((0.75 + 0 + 0.25) / 3 + 1) / 2)


def three_places(value: float) -> str:
    """A logged value (four decimals) as the pages write it: three, the half rounded up."""
    return str(Decimal(str(value)).quantize(Decimal("0.001"), ROUND_HALF_UP))


@pytest.mark.slow
def test_the_example_raises_the_reward_over_rounds_as_the_pages_show(tmp_path):
    """`make rounds-example` on two threads, as the pages' numbers were measured (the tour leaves it to this
    test): the mean reward of the samples rises, recovery stays; rounds.jsonl holds the lines docs/rounds.md
    shows (but for their seconds; on a CPU of another kind, a value may differ in its last digit), and the
    README and the page quote its numbers."""
    output = tmp_path / "out"
    rounds(tmp_path, "--config", "configs/rounds_example.yaml", "--output_dir", str(output), threads=2)
    lines = read_jsonl(output / "rounds.jsonl")
    assert len(lines) == 3
    assert lines[-1]["mean_reward"] > lines[0]["mean_reward"] + 0.03
    assert abs(lines[-1]["recovery"] - lines[0]["recovery"]) < 0.05
    (shown,) = [shown for block, shown in shell_blocks("docs/rounds.md") if "make rounds-example" in block]
    shown_lines = [json.loads(text) for text in shown.splitlines()]
    assert [line.keys() for line in lines] == [line.keys() for line in shown_lines]
    for line, shown_line in zip(lines, shown_lines, strict=True):
        for key, value in line.items():  # another CPU's vector arithmetic can break a near tie in sampling
            shown = shown_line[key]
            same = value == shown or isinstance(value, float) and abs(value - shown) <= 1e-3
            assert key == "seconds" or same, (line["round"], key, value, shown)
    first, last = (three_places(-line["mean_reward"]) for line in (lines[0], lines[-1]))
    said = f"rose from −{first} to −{last} while the native-sequence recovery of the samples stayed at "
    said += three_places(lines[-1]["recovery"])
    for page in ("README.md", "docs/rounds.md"):
        assert said in " ".join((ROOT / page).read_text().split()), page


@pytest.mark.slow
def test_lora_rounds_train_one_adapter_on_and_resume_to_the_same_adapter(tmp_path):
    """With use_peft every round trains the same adapter further (the reference: the base, adapters off); a
    run resumed after round 0 starts round 1 from round 0's adapter and ends where the straight run ends."""
    straight, resumed, reward = tmp_path / "straight", tmp_path / "resumed", reward_file(tmp_path)
    args = ("--targets_file", str(targets(tmp_path)), "--reward", f"{reward}:hydrophilic", "--num_rounds",
            "2", *QUICK, "--use_peft", "true", "--lora_r", "4", "--learning_rate", "3e-3")  # fmt: skip
    rounds(tmp_path, *args, "--output_dir", str(straight))
    adapters = [load_file(straight / f"round-{k}" / "final" / "adapter_model.safetensors") for k in (0, 1)]
    assert all(name.startswith("base_model.model.") for name in adapters[0])
    assert any(not torch.equal(adapters[0][name], adapters[1][name]) for name in adapters[0])

    (resumed / "round-0").mkdir(parents=True)
    shutil.copytree(straight / "round-0" / "final", resumed / "round-0" / "final")
    (resumed / "rounds.jsonl").write_text((straight / "rounds.jsonl").read_text().splitlines()[0] + "\n")
    result = rounds(tmp_path, *args, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest")
    assert f"Resuming after round 0, from {resumed / 'round-0' / 'final'}" in result.stdout
    again = load_file(resumed / "round-1" / "final" / "adapter_model.safetensors")
    for name, value in adapters[1].items():
        torch.testing.assert_close(again[name], value, atol=1e-6, rtol=0)
