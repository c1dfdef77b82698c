"""One declaration per idea: the option groups commands share (the reward, the pairing, the two decoding
orders), and the former names of propose's options, still taken with a deprecation line."""

import json
from pathlib import Path

import pytest
from conftest import EXAMPLE

import dpo_inv
from dpo_inv.campaign.config import ProposeConfig
from dpo_inv.campaign.propose import settle_campaign
from dpo_inv.cli import parse
from dpo_inv.cli import run as run_command
from dpo_inv.errors import OptionError
from dpo_inv.models.options import DecodingOrderOptions, ScoringOrderOptions
from dpo_inv.tools.adapt import AdaptOptions
from dpo_inv.tools.pairs import PairingOptions, PairsOptions
from dpo_inv.tools.reward_fn import RewardOptions
from dpo_inv.tools.rounds import RoundsConfig
from dpo_inv.tools.sample import SampleOptions
from dpo_inv.tools.scan import ScanOptions
from dpo_inv.tools.score import ScoreOptions
from dpo_inv.training.config import DPOConfig

STRUCTURE = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"
SPACE = ("--positions", "A:8,37", "--allowed_aas", "AVILMFWY", "--max_mutations", "2")
DEPRECATED = [
    "propose: warning: --value_field is deprecated: it is now --score_field (the same option)",
    "propose: warning: --batch_size is deprecated: it is now --num_proposals (the same option)",
]


def test_each_shared_option_is_declared_once_in_its_group():
    groups = {
        RewardOptions: (ProposeConfig, RoundsConfig),
        PairingOptions: (PairsOptions, RoundsConfig),
        DecodingOrderOptions: (DPOConfig, RoundsConfig, SampleOptions),
        ScoringOrderOptions: (ScoreOptions, ScanOptions, AdaptOptions),
    }
    for group, users in groups.items():
        names = set(group.__annotations__)
        for user in users:
            assert issubclass(user, group), (user, group)
            for cls in user.__mro__:
                if cls is not group and not issubclass(group, cls):
                    assert not names & set(vars(cls).get("__annotations__", {})), (cls, names)


def test_training_and_sampling_draw_random_orders_and_adapt_fits_on_a_fixed_one():
    assert DPOConfig().decoding_order == SampleOptions().decoding_order == "random"
    assert AdaptOptions().decoding_order == "left_to_right"
    assert AdaptOptions(decoding_order="random").decoding_order == "random"
    assert ScoreOptions().scoring_order() == ScanOptions().scoring_order() == "random"
    assert ScoreOptions().scoring_order("left_to_right") == "left_to_right"  # a ridge's order
    assert ScoreOptions(decoding_order="random").scoring_order("left_to_right") == "random"


def test_former_names_in_python_on_the_command_line_and_in_a_config_file(tmp_path, capsys):
    config = ProposeConfig(campaign="c", batch_size=7, value_field="DMS_score")
    assert (config.num_proposals, config.score_field, config.batch_size, config.value_field) == (
        7, "DMS_score", None, None
    )  # fmt: skip
    assert capsys.readouterr().err.splitlines() == DEPRECATED
    config, _ = parse("propose", ["--campaign", "c", "--batch_size", "7", "--value_field", "DMS_score"])
    assert (config.num_proposals, config.score_field) == (7, "DMS_score")
    assert capsys.readouterr().err.splitlines() == DEPRECATED
    (tmp_path / "propose.yaml").write_text("campaign: c\nbatch_size: 7\nvalue_field: DMS_score\n")
    config, _ = parse("propose", ["--config", str(tmp_path / "propose.yaml")])
    assert (config.num_proposals, config.score_field) == (7, "DMS_score")
    assert capsys.readouterr().err.splitlines() == DEPRECATED
    config, _ = parse("propose", ["--campaign", "c", "--num_proposals", "7", "--score_field", "DMS_score"])
    assert (config.num_proposals, config.score_field) == (7, "DMS_score")
    assert capsys.readouterr().err == ""
    with pytest.raises(OptionError, match="--batch_size 7 and --num_proposals 8: give --num_proposals alone"):
        ProposeConfig(campaign="c", batch_size=7, num_proposals=8)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse("propose", ["--help"])
    help_text = capsys.readouterr().out
    assert (
        "--num_proposals" in help_text
        and "--batch_size" not in help_text
        and "--value_field" not in help_text
    )


def test_a_campaign_saved_under_the_former_names_goes_on_without_a_warning(tmp_path, capsys):
    (tmp_path / "campaign.json").write_text(
        json.dumps({"structure": str(STRUCTURE), "batch_size": 5, "value_field": "DMS_score"})
    )
    config = settle_campaign(ProposeConfig(campaign=str(tmp_path)))
    assert (config.num_proposals, config.score_field) == (5, "DMS_score")
    assert capsys.readouterr().err == ""


def test_a_round_proposed_with_the_former_names(tmp_path, capsys):
    """The command and `dpo_inv.propose(..., batch_size=...)` as documented before the rename: the same
    round, and one deprecation line each."""
    campaign = tmp_path / "c"
    start = ["--structure", str(STRUCTURE), "--chain_id", "A", *SPACE, "--adapt", "no"]
    run_command(
        "propose", ["--campaign", str(campaign), *start, "--batch_size", "5", "--value_field", "value"]
    )
    out, err = capsys.readouterr()
    assert json.loads(out)["proposed"] == 5 and err.splitlines() == DEPRECATED
    assert json.loads((campaign / "campaign.json").read_text())["num_proposals"] == 5
    space = {"positions": "A:8,37", "allowed_aas": "AVILMFWY", "max_mutations": 2, "adapt": "no"}
    summary = dpo_inv.propose(
        tmp_path / "python", structure=str(STRUCTURE), chain_id=["A"], batch_size=5, **space
    )
    assert summary["proposed"] == 5 and capsys.readouterr().err.splitlines() == DEPRECATED[1:]
    python = (tmp_path / "python" / "round_1" / "proposals.csv").read_text()
    assert python == (campaign / "round_1" / "proposals.csv").read_text()


def reward_file(tmp_path: Path) -> str:
    (tmp_path / "reward.py").write_text("def value(records):\n    return [1.0] * len(records)\n")
    return f"{tmp_path / 'reward.py'}:value"


def test_both_rewards_are_refused_by_propose_as_by_rounds(tmp_path, capsys):
    both = ["--reward", reward_file(tmp_path), "--reward_command", "echo 1"]
    said = "error: give either reward (a Python function) or reward_command (a shell command), not both"
    campaign = ["--campaign", str(tmp_path / "c"), "--structure", str(STRUCTURE), "--chain_id", "A"]
    for command, args in (("propose", campaign), ("rounds", ["--targets_file", "targets.jsonl"])):
        with pytest.raises(SystemExit) as exit_:
            run_command(command, [*args, *both])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.splitlines() == [f"dpo-inv {command}: {said}"], err
    assert not (tmp_path / "c").exists()
    with pytest.raises(OptionError, match="not both"):  # a function and a command
        dpo_inv.propose(tmp_path / "c", reward=lambda records: [1.0] * len(records), reward_command="echo 1")
    with pytest.raises(OptionError, match="not both"):
        RoundsConfig(targets_file="targets.jsonl", reward="reward.py:value", reward_command="echo 1")


def test_rounds_take_the_pairing_options_of_pairs_but_same_position(capsys):
    config, _ = parse("rounds", ["--targets_file", "t.jsonl", "--strategy", "top_vs_rest", "--top_k", "2"])
    assert (config.strategy, config.top_k) == ("top_vs_rest", 2)
    refused = {
        "--strategy same_position": "strategy same_position pairs single mutants",
        "--top_k 0": "--top_k must be >= 1, got 0",
        "--min_margin -1": "--min_margin must be a finite number >= 0, got -1.0",
    }
    for args, said in refused.items():
        with pytest.raises(SystemExit) as exit_:
            parse("rounds", ["--targets_file", "t.jsonl", *args.split()])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and said in err and len(err.splitlines()) == 1, err
