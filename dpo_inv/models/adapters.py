"""LoRA adapters (peft) on ProteinMPNN and LigandMPNN: attaching them for training, the reference they
leave (the base model, adapters switched off), and the folder an adapter is saved in, which names its
base model and records what that base's weights were."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from torch import Tensor, nn

from dpo_inv.errors import OptionError
from dpo_inv.models.mpnn import ProteinMPNN, ProteinMPNNConfig

ADAPTER_CONFIG = "adapter_config.json"  # peft's: the adapter's settings and base_model_name_or_path
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "base_model.json"  # the base's weights, summarised: an adapter is refused on other weights
# the linear maps of every message-passing layer (encoder, decoder, LigandMPNN's context layers) and the
# output head
DEFAULT_TARGETS = ("W1", "W2", "W3", "W11", "W12", "W13", "W_in", "W_out")
ALL_LINEAR = "all-linear"  # peft's name for every linear map but the output head
OUTPUT_HEAD = "W_out"


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA adapters, with the names of TRL's ModelConfig: what training, rounds and adapt take."""

    use_peft: bool = field(
        default=False,
        metadata={
            "help": "Train a LoRA adapter (peft) instead of every weight; the reference is then the base "
            "model with the adapter switched off, no second copy. The saved models are adapter folders, "
            "which every command takes as a model; `python -m dpo_inv merge` writes the full model. With "
            "model_name_or_path an adapter folder, that adapter trains on."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale: the update is scaled by alpha/r."})
    lora_dropout: float = field(
        default=0.05,
        metadata={
            "help": "Dropout on the adapters' inputs; none where the policy's dropout is disabled "
            "(disable_dropout, as TRL disables every dropout), nor on the maps the layers apply in blocks "
            "(W1, W3)."
        },
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "The linear maps that get adapters, by name or its last part, or all-linear (peft's: "
            "every linear map but the output head W_out); default: "
            f"{' '.join(DEFAULT_TARGETS)} (every message-passing layer's maps and the output head; for "
            "adapt, the maps of the layers it trains)."
        },
    )
    lora_modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Modules trained in full beside the adapters; saved with the adapter."},
    )

    def check_lora(self) -> None:
        """Refuse a rank or scale that is not positive, or a dropout outside [0, 1)."""
        for name in ("lora_r", "lora_alpha"):
            if getattr(self, name) <= 0:
                raise OptionError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise OptionError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")

    def adapter(self, model: ProteinMPNN, targets: Sequence[str] | str | None = None) -> PeftModel:
        """`model` with a new adapter of these settings (on `targets` where lora_target_modules is unset)."""
        return add_adapter(model, self.lora_r, self.lora_alpha, self.lora_dropout,
                           self.lora_target_modules or targets, self.lora_modules_to_save)  # fmt: skip


@contextmanager
def quiet() -> Iterator[None]:
    """No FutureWarning of the Transformers deprecations peft calls into (is_gradient_checkpointing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def is_adapter(path: str | os.PathLike) -> bool:
    """Whether `path` is an adapter folder (peft's adapter_config.json in it)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | os.PathLike) -> str:
    """The name or path of the model an adapter folder was trained on."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def summary(model: nn.Module) -> dict[str, list[float]]:
    """Each weight tensor's sum and norm (of the model without adapters): what an adapter's base was,
    compared within a tolerance, since the same weights summed on another device differ in the last bits."""
    weights = {}
    for name, t in model.state_dict().items():  # of a model carrying adapters: its base layers' weights
        if t.is_floating_point() and "lora_" not in name and ".modules_to_save." not in name:
            name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
            weights[name] = [float(t.double().sum()), float(t.double().norm())]
    return weights


def same_weights(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), rtol=1e-5, atol=1e-6) for k in a)


def module_names(
    model: ProteinMPNN, names: Sequence[str], option: str, kind: type[nn.Module] = nn.Module
) -> list[str]:
    """`names`, each the name (or the last part of the name) of at least one `kind` of module of the
    model; an unknown one is refused, naming those there are."""
    known = [name for name, module in model.named_modules() if name and isinstance(module, kind)]
    for wanted in names:
        if not any(name == wanted or name.endswith(f".{wanted}") for name in known):
            endings = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in known}))
            what = "linear map" if kind is nn.Linear else "module"
            raise OptionError(
                f"{option}: {wanted!r} is not a {what} of {model.config.name_or_path}; its {what}s are "
                f"{endings} (or full names such as decoder_layers.0.W1)"
            )
    return list(names)


def all_linear(model: ProteinMPNN) -> list[str]:
    """peft's all-linear: every linear map but the output head, by the last part of its name (the last two
    where the last is the head's: dense.W_out)."""
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != OUTPUT_HEAD]
    return sorted({".".join(name.split(".")[-1 - (name.endswith(f".{OUTPUT_HEAD}")) :]) for name in linear})


def add_adapter(
    model: ProteinMPNN,
    r: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str] | str | None = None,
    modules_to_save: Sequence[str] | None = None,
) -> PeftModel:
    """`model` with a new LoRA adapter (rank r, scale alpha/r) on `targets`: names or their last parts, or
    a regular expression that whole names match (default: `DEFAULT_TARGETS`); the base weights frozen,
    `modules_to_save` trained in full beside it."""
    name = model.config.name_or_path
    base = str(Path(name).resolve()) if Path(name).exists() else name  # loads from any working directory
    targets = targets or DEFAULT_TARGETS
    if targets in (ALL_LINEAR, [ALL_LINEAR]):
        targets = all_linear(model)
    if not isinstance(targets, str):  # a regular expression is peft's to match
        targets = module_names(model, targets, "lora_target_modules", nn.Linear)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        modules_to_save=module_names(model, modules_to_save or (), "lora_modules_to_save") or None,
        base_model_name_or_path=base,
    )
    weights = summary(model)
    with quiet():
        adapted = get_peft_model(model, config)
    adapted.base_summary = weights
    return adapted


def without_adapter_dropout(adapted: PeftModel) -> None:
    """No dropout on the adapters' inputs: the identity, as peft builds it for lora_dropout 0 (dropout of
    p = 0 would still copy every input it keeps for the backward pass)."""
    for module in adapted.modules():
        if hasattr(module, "lora_dropout"):
            for name in module.lora_dropout:
                module.lora_dropout[name] = nn.Identity()


def trainable_parameters(adapted: PeftModel) -> str:
    """What an adapter trains, for the log: its rank, targets and parameter counts."""
    config = adapted.peft_config["default"]
    trainable, total = adapted.get_nb_trainable_parameters()
    targets = " ".join(sorted(config.target_modules))
    return (
        f"LoRA r={config.r} alpha={config.lora_alpha} on {targets}: {trainable:,} trainable parameters of "
        f"{total:,} ({100 * trainable / total:.1f}%)"
    )


def check_base(path: Path, base: ProteinMPNN) -> dict[str, list[float]]:
    """Refuse an adapter folder on a base whose weights are not those it was trained on (among them, a
    model the adapter is already merged into); returns the base's summary."""
    weights = summary(base)
    recorded = json.loads((path / BASE_FILE).read_text()) if (path / BASE_FILE).is_file() else None
    if recorded is not None and not same_weights(weights, recorded["weights"]):
        name = base.config.name_or_path
        if str(path.resolve()) in getattr(base.config, "merged_adapters", []):
            raise OptionError(
                f"{path}: the adapter is already merged into {name}; use {name} alone, or the adapter on "
                f"its base {recorded['name_or_path']}"
            )
        raise OptionError(
            f"{path}: the adapter was trained on {recorded['name_or_path']}, whose weights differ from "
            f"those of {name} now; give the adapter its own base model"
        )
    return weights


def load_adapter(
    path: str | os.PathLike, base: ProteinMPNN, trainable: bool = False, name: str = "default"
) -> PeftModel:
    """The adapter saved in `path` on `base` (its weights checked against those it was trained on)."""
    path = Path(path)
    weights = check_base(path, base)
    with quiet():
        adapted = PeftModel.from_pretrained(base, path, adapter_name=name, is_trainable=trainable)
    adapted.base_summary = weights
    return adapted


def merge(adapted: PeftModel, path: str | os.PathLike) -> ProteinMPNN:
    """The full model of an adapter folder `path` loaded on its base: the adapter's deltas added to the
    base weights, the folder named in the config (``merged_adapters``) so that it is not added twice."""
    merged = adapted.merge_and_unload()
    merged_before = getattr(merged.config, "merged_adapters", [])
    merged.config.merged_adapters = [*merged_before, str(Path(path).resolve())]
    merged.config.name_or_path = os.fspath(path)
    return merged


def save_adapter(adapted: PeftModel, directory: str | os.PathLike, is_main_process: bool = True) -> None:
    """peft's adapter folder (adapter_config.json, adapter_model.safetensors) and the base's summary."""
    # no embedding layers to save: without this, peft looks the base model up on the Hugging Face Hub
    adapted.save_pretrained(directory, is_main_process=is_main_process, save_embedding_layers=False)
    if is_main_process:
        base = adapted.peft_config["default"].base_model_name_or_path
        (Path(directory) / BASE_FILE).write_text(
            json.dumps({"name_or_path": base, "weights": adapted.base_summary})
        )


def load_adapter_weights(adapted: PeftModel, directory: str | os.PathLike) -> None:
    """Put the adapter weights saved in `directory` (by `save_adapter`, from this model) into `adapted`."""
    state = load_file(Path(directory) / ADAPTER_WEIGHTS, device=str(next(adapted.parameters()).device))
    set_peft_model_state_dict(adapted, state)


class WithoutAdapters(nn.Module):
    """The reference of a LoRA policy: the policy's own base weights, its adapters switched off, in eval
    mode (no backbone noise, no dropout); no second copy of the model."""

    def __init__(self, policy: PeftModel) -> None:
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: nothing here to train, move or save

    @property
    def config(self) -> ProteinMPNNConfig:
        return self.policy.config

    def forward(self, **inputs: Tensor) -> Tensor:
        training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                return self.policy(**inputs)
        finally:
            self.policy.train(training)
