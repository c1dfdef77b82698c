"""LoRA adapters (use_peft): they act in every layer, the reference is the base with them switched off (one
model in memory), a run saves an adapter folder that resumes exactly, that every command takes as a model
and that `merge` turns into a full model the stock ProteinMPNN script designs with; bad settings are one
line."""

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLE, STRUCTURES, command_in_process, gunzip, train_in_process
from safetensors.torch import load_file
from test_distributed import torchrun
from test_stock_tools import design
from test_train import metrics, run, small_pairs

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import load_records
from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import DEFAULT_TARGETS, WithoutAdapters, add_adapter, load_adapter, save_adapter
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.weights import load_adapters, load_model
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loss import batch_ranks, pair_logps
from dpo_inv.training.trainer import load_models


def batch_of(path: Path, cache: Path, count: int) -> dict[str, torch.Tensor]:
    data = ExampleDataset(load_records(str(path), cache_dir=cache))
    return collate([data[i] for i in range(count)])


def logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = pair_logps(model, batch, batch_ranks(batch, 0, 1, "random"))
    return torch.stack([out.chosen, out.rejected])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, data, extra",
    [
        ("vanilla/v_48_020", None, ("edge_embedding", "linear")),
        ("ligand/v_32_010_25", "ligand/val.jsonl", ()),
    ],
)
def test_adapters_act_in_every_layer_and_switch_off_to_the_base(tmp_path, name, data, extra):
    """With nonzero adapters on every linear map (those the layers apply in blocks included), the model
    scores as its merged weights do; switched off, exactly as the base."""
    path = EXAMPLE / data if data else small_pairs(tmp_path, limit=2)
    batch = batch_of(path, tmp_path / "cache", 2)
    base = load_model(name)
    adapted = add_adapter(load_model(name), 4, 8, 0.0, (*DEFAULT_TARGETS, *extra))
    torch.manual_seed(0)
    for parameter_name, parameter in adapted.named_parameters():
        if "lora_B" in parameter_name:
            torch.nn.init.normal_(parameter, std=0.05)
    adapted.eval()
    with_adapters, without = logps(adapted, batch), logps(WithoutAdapters(adapted), batch)
    assert (with_adapters - logps(base, batch)).abs().max() > 0.1
    torch.testing.assert_close(without, logps(base, batch), atol=1e-5, rtol=1e-6)
    adapted.train()
    logps(WithoutAdapters(adapted), batch)
    assert adapted.training  # the reference pass leaves the policy in training mode
    adapted.eval()
    save_adapter(adapted, tmp_path / "adapter")
    merged = load_model(tmp_path / "adapter")
    torch.testing.assert_close(logps(merged, batch), with_adapters, atol=1e-4, rtol=1e-5)


def models_in_memory() -> int:
    gc.collect()
    return sum(type(o) is ProteinMPNN for o in gc.get_objects())


def test_a_lora_run_holds_one_copy_of_the_base_weights():
    before = models_in_memory()
    policy, reference = load_models(DPOConfig(use_peft=True), torch.device("cpu"))
    assert isinstance(reference, WithoutAdapters) and models_in_memory() - before == 1
    assert not list(reference.parameters())  # the policy is not its submodule
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    del policy, reference
    full = load_models(DPOConfig(), torch.device("cpu"))
    assert models_in_memory() - before == 2
    del full


def test_bad_adapter_settings_name_the_fix(tmp_path):
    with pytest.raises(OptionError, match=r"lora_target_modules: 'W9' is not a linear map .*W_in"):
        add_adapter(load_model("vanilla/v_48_020"), 4, 8, 0.0, ["W9"])
    adapted = add_adapter(load_model("vanilla/v_48_020"), 4, 8, 0.0)
    for parameter_name, parameter in adapted.named_parameters():
        if "lora_B" in parameter_name:
            torch.nn.init.normal_(parameter, std=0.05)
    save_adapter(adapted, tmp_path / "adapter")
    merged = load_model(tmp_path / "adapter")
    with pytest.raises(OptionError, match="the adapter is already merged into"):
        load_adapter(tmp_path / "adapter", merged)
    with pytest.raises(OptionError, match="whose weights differ from those of vanilla/v_48_010"):
        load_adapter(tmp_path / "adapter", load_model("vanilla/v_48_010"))


LORA = (
    "--use_peft",
    "true",
    "--lora_r",
    "4",
    "--lora_alpha",
    "8",
    "--eval_split",
    "0",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "2",
    "--max_steps",
    "4",
    "--learning_rate",
    "3e-3",
    "--warmup_steps",
    "1",
    "--logging_steps",
    "1",
    "--save_steps",
    "1",
    "--save_total_limit",
    "4",
    "--seed",
    "3",
)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_saves_an_adapter_and_merges_for_the_stock_script(tmp_path):
    data = small_pairs(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    threads = {"OMP_NUM_THREADS": "1"}  # both runs alike, however busy the machine (sums round by threads)
    result = run(tmp_path, "--train_file", str(data), "--output_dir", str(straight), *LORA, extra_env=threads)
    assert "LoRA r=4 alpha=8 on W1 W11 W12 W13 W2 W3 W_in W_out" in result.stdout
    assert "reference the base model, adapters off" in result.stdout
    logged = metrics(straight)
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # the adapters start at zero
    assert logged[-1]["rewards/margins"] > logged[0]["rewards/margins"]
    final = straight / "final"
    assert sorted(p.name for p in final.iterdir() if p.suffix != ".md") == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "base_model.json",
    ]
    assert (
        json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "vanilla/v_48_020"
    )

    shutil.copytree(straight / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    run(
        tmp_path,
        "--train_file",
        str(data),
        "--output_dir",
        str(resumed),
        "--resume_from_checkpoint",
        "latest",
        *LORA,
        extra_env=threads,
    )
    expected, actual = (
        load_file(final / "adapter_model.safetensors"),
        load_file(resumed / "final" / "adapter_model.safetensors"),
    )
    assert expected.keys() == actual.keys() and len(expected) == 2 * (8 * 3 + 5 * 3 + 1)  # A, B per map
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0)

    scored = command_in_process(
        "score",
        "--model",
        str(final),
        "--reference",
        "vanilla/v_48_020",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "scored.jsonl"),
        "--cache_dir",
        str(tmp_path / "c"),
    )
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["mean_margin"] > 0

    merged = tmp_path / "merged"
    result = command_in_process("merge", str(final), "--output", str(merged))
    assert result.returncode == 0, result.stderr
    assert f"full model in {merged}" in result.stdout
    again = command_in_process("merge", str(final), "--output", str(merged))
    assert again.returncode == 2 and again.stderr.strip().endswith(
        "exists and is not empty; give a new folder"
    )
    assert len(again.stderr.strip().splitlines()) == 1
    designs = design(
        "protein_mpnn_run", merged, gunzip(STRUCTURES / "2xcjA.pdb.gz", tmp_path), tmp_path / "x"
    )
    assert len(designs) > 1 and all(len(seq) == 84 for _, seq in designs[1:])

    bad = train_in_process("--train_file", str(data), "--output_dir", str(tmp_path / "bad"), *LORA,
                           "--lora_target_modules", "W9")  # fmt: skip
    assert bad.returncode == 2 and "lora_target_modules: 'W9' is not a linear map" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_lora_on_two_processes_matches_one_process(tmp_path):
    data = small_pairs(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    run(tmp_path, "--train_file", str(data), "--output_dir", str(one), *LORA)
    result = run(
        tmp_path,
        "--train_file",
        str(data),
        "--output_dir",
        str(two),
        *LORA,
        "--per_device_train_batch_size",
        "1",
        command=(*torchrun(), "-m", "dpo_inv.run"),
    )
    assert "Parameters identical on all 2 process(es)" in result.stdout + result.stderr
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    expected = load_file(one / "final" / "adapter_model.safetensors")
    actual = load_file(two / "final" / "adapter_model.safetensors")
    for key in expected:  # Adam's first steps on the zero-started B matrices magnify summation-order noise
        torch.testing.assert_close(actual[key], expected[key], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "train_file, options",
    [
        ("labels/train.jsonl", ("--loss_type", "kto")),
        ("pairs/train_residue.jsonl", ("--loss_type", "residpo", "--residue_margin", "0.5")),
        ("structures", ("--loss_type", "sft", "--per_device_train_batch_size", "1")),
    ],
)
def test_kto_residpo_and_sft_train_adapters(tmp_path, train_file, options):
    output = tmp_path / "run"
    train = EXAMPLE / train_file
    if train_file == "structures":
        train = tmp_path / "structures"
        train.mkdir()
        shutil.copy(STRUCTURES / "2xcjA.pdb.gz", train)
    run(
        tmp_path, "--train_file", str(train), "--output_dir", str(output), *LORA, *options, "--max_steps", "2"
    )
    assert (output / "final" / "adapter_model.safetensors").is_file()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics(output) if "loss" in m)


@pytest.mark.slow
def test_adapt_trains_an_adapter_on_the_head_whose_ridge_scores_through_the_folder(tmp_path):
    output = tmp_path / "adapt"
    result = command_in_process(
        "adapt",
        str(EXAMPLE / "adapt" / "labelled.jsonl"),
        "--output_dir",
        str(output),
        "--use_peft",
        "true",
        "--lora_r",
        "8",
        "--lora_alpha",
        "16",
        "--max_steps",
        "20",
        "50",
    )
    assert result.returncode == 0, result.stderr
    adapter = load_file(output / "final" / "adapter_model.safetensors")
    assert {name.split(".lora_")[0] for name in adapter} == {
        f"base_model.model.decoder_layers.2.{m}" for m in ("W1", "W2", "W3", "dense.W_in", "dense.W_out")
    } | {"base_model.model.W_out"}
    report = json.loads((output / "adapt.json").read_text())
    assert report["cv_spearman_adapted"] > report["cv_spearman_start"]
    scored = command_in_process(
        "score",
        "--model",
        str(output / "final"),
        "--data",
        str(EXAMPLE / "adapt" / "candidates.jsonl"),
        "--output",
        str(tmp_path / "c.jsonl"),
        "--ridge",
        str(output / "augmented_ridge.json"),
    )
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["spearman_of"] == "predicted_label"
    below = command_in_process(
        "adapt",
        str(EXAMPLE / "adapt" / "labelled.jsonl"),
        "--output_dir",
        str(tmp_path / "below"),
        "--use_peft",
        "true",
        "--lora_target_modules",
        "W2",
    )
    assert below.returncode == 2 and "adapt trains the last decoder layer and the output head" in below.stderr


@pytest.mark.slow
def test_one_base_carries_an_adapter_per_objective(tmp_path):
    batch = batch_of(small_pairs(tmp_path, limit=2), tmp_path / "cache", 2)
    merged = {}
    for seed, name in enumerate(("stability", "binding")):
        adapted = add_adapter(load_model("vanilla/v_48_020"), 4, 8, 0.0)
        torch.manual_seed(seed)
        for parameter_name, parameter in adapted.named_parameters():
            if "lora_B" in parameter_name:
                torch.nn.init.normal_(parameter, std=0.05)
        save_adapter(adapted, tmp_path / name)
        merged[name] = logps(load_model(tmp_path / name), batch)
    both = load_adapters({"stability": tmp_path / "stability", "binding": tmp_path / "binding"})
    for name in ("stability", "binding"):
        both.set_adapter(name)
        torch.testing.assert_close(logps(both, batch), merged[name], atol=1e-4, rtol=1e-5)
    other = add_adapter(load_model("vanilla/v_48_010"), 4, 8, 0.0)
    save_adapter(other, tmp_path / "other")
    with pytest.raises(OptionError, match="trained on different base models .*other on vanilla/v_48_010"):
        load_adapters({"stability": tmp_path / "stability", "other": tmp_path / "other"})
