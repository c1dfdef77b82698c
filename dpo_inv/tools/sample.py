"""Designing sequences for backbone structures: `dpo-inv sample` in Python, and the options, inputs and
outputs of `python -m dpo_inv sample`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import Tensor

from dpo_inv.data.batches import collate
from dpo_inv.data.design import (
    Design,
    parse_positions,
    parse_redesigned_residues,
    parse_tied_positions,
    prepare_design,
    structure_name,
)
from dpo_inv.data.progress import progress
from dpo_inv.data.records import rebase_paths, write_text
from dpo_inv.errors import DataError, OptionError
from dpo_inv.models.mpnn import ProteinMPNN, ProteinMPNNConfig, derive_seed
from dpo_inv.models.options import DecodingOrderOptions, ModelOptions, check_signs
from dpo_inv.models.sampling import allowed_tokens, sample_sequences
from dpo_inv.models.weights import (
    as_model,
    load_model,
    read_config,
)
from dpo_inv.structures.context import empty_context_note
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS
from dpo_inv.training.launch import resolve_device


@dataclass
class SampleFiles:
    """What `python -m dpo_inv sample` reads and writes."""

    output_dir: str = field(metadata={"help": "Where <structure name>.fa and samples.jsonl are written."})
    model: str = field(
        default="vanilla/v_48_020",
        metadata={
            "help": "Official name (vanilla/v_48_020, ligand/v_32_010_25, ...), official .pt file or saved "
            "directory. A LigandMPNN model designs around the structure's ligands, metals and nucleic acids."
        },
    )
    structure: str | None = field(
        default=None, metadata={"help": "PDB or mmCIF file to design, optionally gzipped."}
    )
    structure_list: str | None = field(
        default=None,
        metadata={"help": "Text file with one structure path per line (relative to the file's folder)."},
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "Replace the samples of a structure sampled into output_dir before (else refused)."
        },
    )


@dataclass(kw_only=True)
class SampleOptions(ModelOptions, DecodingOrderOptions):
    """How sequences are sampled: the options of `sample` in Python, and the command's besides its files."""

    design_chains: list[str] = field(
        default_factory=list, metadata={"help": "Chains to design; default: every chain not fixed."}
    )
    fixed_chains: list[str] = field(
        default_factory=list, metadata={"help": "Chains the model sees with their native sequence."}
    )
    fixed_positions: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Designed-chain residues that keep their native amino acid, by author number: "
            '"A:1-10,15 B:3,52A" (ranges inclusive, in file order).'
        },
    )
    redesigned_residues: str = field(
        default="",
        metadata={
            "help": "Only these residues are designed, every other residue of the designed chains keeps "
            'its native amino acid, as LigandMPNN: "A12 A13 B52A" (or "A:12-20,25").'
        },
    )
    max_mutations: int | None = field(
        default=None,
        metadata={"help": "At most this many residues of a sample differ from the native sequence."},
    )
    tied_positions: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Designed residues that get one amino acid, as ProteinMPNN's tied positions: "
            '"A:1-10=B:1-10 A:15=C:15" ties A1 to B1, ..., A10 to B10, and A15 to C15 (author numbers, '
            "equally many residues on each side)."
        },
    )
    homo_oligomer: bool = field(
        default=False,
        metadata={
            "help": "Tie every designed chain residue by residue (chains of equal length), as ProteinMPNN."
        },
    )
    num_samples: int = field(default=8, metadata={"help": "Sequences per structure."})
    temperature: float = field(
        default=0.1,
        metadata={
            "help": "Sampling temperature; 0 = the most likely amino acid at each step of the decoding "
            "order: with random orders each sample still differs, with --decoding_order left_to_right all "
            "are one deterministic design."
        },
    )
    omit_aas: str = field(default="", metadata={"help": "Amino acids never sampled, e.g. CM (X never is)."})
    bias_aas: str = field(
        default="", metadata={"help": 'Added to the logits per amino acid, e.g. "W:-1,K:0.5".'}
    )
    batch_size: int = field(default=8, metadata={"help": "Samples decoded together."})
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the decoding orders and draws; batch k uses one from (seed, k)."},
    )

    def __post_init__(self) -> None:
        check_signs(self, positive=("num_samples", "batch_size"), non_negative=("temperature", "seed"))
        if self.max_mutations is not None and self.max_mutations < 1:
            raise OptionError(f"--max_mutations {self.max_mutations}: give a positive number")
        if self.redesigned_residues and self.fixed_positions:
            raise OptionError("give --fixed_positions or --redesigned_residues, not both")


@dataclass
class SampleConfig(SampleOptions, SampleFiles):
    """`python -m dpo_inv sample`: its files, then its options."""

    def __post_init__(self) -> None:
        if self.structure is None and self.structure_list is None:
            raise OptionError("give --structure or --structure_list")
        super().__post_init__()


def parse_bias(spec: str) -> Tensor:
    """``"W:-1,K:0.5"`` -> a bias ``[21]`` on the logits."""
    bias = torch.zeros(len(ALPHABET))
    for item in filter(None, (s.strip() for s in spec.split(","))):
        letter, _, value = item.partition(":")
        letter = letter.strip().upper()
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if letter not in AMINO_ACIDS or not np.isfinite(number):
            raise OptionError(f"--bias_aas: {item!r} is not AMINO_ACID:NUMBER such as W:-1")
        bias[ALPHABET.index(letter)] = number
    return bias


def read_structure_list(path: Path) -> list[Path]:
    """Structure paths listed one per line (blank lines and # comments skipped); all must exist."""
    if not path.is_file():
        raise DataError(f"{path}: structure list not found")
    structures = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        structure = Path(entry) if Path(entry).is_absolute() else path.parent / entry
        if not structure.is_file():
            raise DataError(f"{path}:{number}: structure file not found: {structure}")
        structures.append(structure)
    if not structures:
        raise DataError(f"{path}: no structure paths")
    return structures


def sample_structure(
    model: ProteinMPNN, design: Design, config: SampleOptions, bias: Tensor
) -> list[dict[str, Any]]:
    """Records of ``config.num_samples`` samples of one structure, in batches of ``config.batch_size``."""
    batch = collate([design.example])
    designed = (batch["decode_mask"] * batch["mask"])[0].bool()
    native = batch["native"][0]
    num_designed = len(design.example["mutable"])
    records = []
    tied = torch.from_numpy(design.tied)[None]
    for k, start in enumerate(range(0, config.num_samples, config.batch_size)):
        n = min(config.batch_size, config.num_samples - start)
        samples = sample_sequences(
            model,
            batch,
            n,
            config.temperature,
            [derive_seed(config.seed, k)],
            config.omit_aas,
            bias,
            tied,
            config.decoding_order,
            config.max_mutations,
        )
        pairs = zip(samples.tokens[0].cpu(), samples.log_probs[0].cpu(), strict=True)
        for i, (tokens, log_probs) in enumerate(pairs):
            records.append(
                {
                    "structure": str(design.path),
                    "design_chains": design.design_chains,
                    "fixed_chains": list(config.fixed_chains),
                    "sample": start + i + 1,
                    "temperature": config.temperature,
                    "seed": config.seed,
                    "sequence": "".join(ALPHABET[t] for t in tokens[:num_designed]),
                    "log_likelihood": float(log_probs[designed].mean()),
                    "recovery": float((tokens == native)[designed].float().mean()),
                }
            )
    return records


def chain_split(sequence: str, lengths: Sequence[int]) -> str:
    """The designed chains' sequence with ProteinMPNN's `/` between chains."""
    ends = np.cumsum(lengths)
    return "/".join(sequence[end - n : end] for n, end in zip(lengths, ends, strict=True))


def run_settings(config: SampleConfig) -> str:
    """The settings of a run as header fields: the model, temperature, seed and number of samples, and each
    other option that is set."""
    settings = {"model": config.model, "T": f"{config.temperature:g}", "seed": config.seed,
                "num_samples": config.num_samples, "fixed_chains": ",".join(config.fixed_chains),
                "fixed_positions": " ".join(config.fixed_positions), "omit_aas": config.omit_aas,
                "bias_aas": config.bias_aas, "tied_positions": " ".join(config.tied_positions),
                "homo_oligomer": "true" if config.homo_oligomer else "",
                "decoding_order": config.decoding_order if config.decoding_order != "random" else "",
                "redesigned_residues": config.redesigned_residues,
                "max_mutations": "" if config.max_mutations is None else config.max_mutations}  # fmt: skip
    return "|".join(f"{key}={value}" for key, value in settings.items() if value != "")


def write_fasta(handle: TextIO, design: Design, records: list[dict[str, Any]], settings: str) -> None:
    """The native sequence under a header of the run's settings, then one record per sample, as
    ProteinMPNN writes them: the designed chains separated by `/`, under a header of the sample's fields."""
    native = "".join(ALPHABET[t] for t in design.example["native"][: len(design.example["mutable"])])
    chains = ",".join(design.design_chains)
    handle.write(f">{design.name}|native|chains={chains}|{settings}\n")
    handle.write(chain_split(native, design.chain_lengths) + "\n")
    for r in records:
        handle.write(
            f">{design.name}|chains={chains}|sample={r['sample']}|T={r['temperature']:g}"
            f"|seed={r['seed']}|log_likelihood={r['log_likelihood']:.3f}|recovery={r['recovery']:.3f}\n"
            f"{chain_split(r['sequence'], design.chain_lengths)}\n"
        )


def prepare_designs(
    model_config: ProteinMPNNConfig, paths: Sequence[Path], config: SampleOptions
) -> tuple[list[Design], Tensor]:
    """The designs of the structures at `paths` as the model of `model_config` reads them, and the logit
    bias; every input is checked here, before any sampling."""
    fixed = parse_positions(config.fixed_positions)
    redesigned = parse_redesigned_residues(config.redesigned_residues) if config.redesigned_residues else None
    ties = parse_tied_positions(config.tied_positions)
    if ties and config.homo_oligomer:
        raise OptionError("give --tied_positions or --homo_oligomer, not both")
    bias = parse_bias(config.bias_aas)
    allowed_tokens(config.omit_aas)
    options = config.parse_options(model_config)
    designs = [
        prepare_design(
            p,
            config.design_chains,
            config.fixed_chains,
            fixed,
            options,
            ties,
            config.homo_oligomer,
            redesigned,
        )
        for p in paths
    ]
    note = empty_context_note({d.name: d.num_context_atoms for d in designs}, options)
    if note:
        print(f"note: {note}")
    return designs, bias


def sample(
    model: ProteinMPNN | str, structure: str | os.PathLike | Sequence[str | os.PathLike], **options: Any
) -> list[dict[str, Any]]:
    """Design sequences for one backbone structure (PDB or mmCIF, optionally gzipped) or several, by
    autoregressive sampling from `model` (a model, or a name or path :func:`load_model` takes), with the
    records `python -m dpo_inv sample` writes to samples.jsonl (same seed, same sequences).

    Each record holds `structure` (the path as given), `design_chains`, `fixed_chains`, `sample` (from 1),
    `temperature`, `seed`, `sequence` (the designed chains, in order), `log_likelihood` (mean log p of the
    designed residues) and `recovery` (their fraction of native residues). `fixed_positions` are author
    residue numbers such as `"A:1-10,15 B:3"`, `redesigned_residues` the only ones designed, as LigandMPNN
    (`"A12 A13 B52A"`), `max_mutations` the most residues a sample changes, `tied_positions` such as
    `"A:1-10=B:1-10"` (one amino acid per tie); `options` are the command's others (:class:`SampleOptions`:
    `num_samples`, `temperature`, `design_chains`, `fixed_positions`, ...), with its defaults.
    """
    paths = [structure] if isinstance(structure, (str, os.PathLike)) else list(structure)
    config = SampleOptions(**options)
    policy = as_model(model)
    designs, bias = prepare_designs(policy.config, [Path(p) for p in paths], config)
    policy = policy.to(resolve_device(config.device)).eval()
    return [record for design in designs for record in sample_structure(policy, design, config, bias)]


def keep_other_structures(path: Path, names: set[str]) -> None:
    """Drop from the samples file at ``path`` (if any) the samples of the structures named ``names``, which
    are sampled again; other structures' samples stay."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if structure_name(Path(json.loads(line)["structure"])) not in names]
    if len(kept) < len(lines):
        write_text(path, "".join(kept))


def sample_file(config: SampleConfig) -> None:
    """`python -m dpo_inv sample`: design every structure of ``config``; write the FASTA files and add the
    samples to ``samples.jsonl`` (one folder may hold several structures' samples, as ProteinMPNN's
    `seqs/`; a structure sampled there before is refused without ``overwrite``). Every input is checked
    before the model is loaded, so a bad one stops the run before any sampling."""
    paths = [Path(config.structure)] if config.structure else []
    if config.structure_list:
        paths += read_structure_list(Path(config.structure_list))
    output = Path(config.output_dir)
    designs, bias = prepare_designs(read_config(config.model), paths, config)
    names = [d.name for d in designs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise OptionError(
            f"several structures are named {', '.join(duplicates)}: their .fa files would clash"
        )
    sampled = [name for name in names if (output / f"{name}.fa").exists()]
    if sampled and not config.overwrite:
        raise OptionError(
            f"{output} holds the samples of {', '.join(sampled)} from an earlier run; give another "
            "--output_dir, or --overwrite to replace them"
        )
    model = load_model(config.model).to(resolve_device(config.device)).eval()
    output.mkdir(parents=True, exist_ok=True)
    keep_other_structures(output / "samples.jsonl", set(names))
    settings = run_settings(config)
    with (
        open(output / "samples.jsonl", "a", encoding="utf-8") as jsonl,
        progress(designs, desc="Sampling", unit="structure", disable=len(designs) < 2) as bar,
    ):
        for design in bar:
            records = sample_structure(model, design, config, bias)
            fasta = output / f"{design.name}.fa"
            with open(fasta, "w", encoding="utf-8") as handle:
                write_fasta(handle, design, records, settings)
            jsonl.writelines(json.dumps(r) + "\n" for r in rebase_paths(records, Path.cwd(), output))
            bar.write(
                f"{design.name}: {len(records)} samples of chains {','.join(design.design_chains)}, "
                f"mean log-likelihood {np.mean([r['log_likelihood'] for r in records]):.3f}, "
                f"mean recovery {np.mean([r['recovery'] for r in records]):.3f} -> {fasta}"
            )
