"""Training configuration: a typed dataclass parsed from YAML plus command-line overrides (TrlParser)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from importlib.util import find_spec
from typing import Any, Literal

from accelerate.utils import LoggerType

from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import LoraOptions
from dpo_inv.models.options import DecodingOrderOptions, check_signs
from dpo_inv.models.weights import LIGAND_CONTEXT_HELP, LIGAND_EXCLUDE_HELP
from dpo_inv.training import kto, sft
from dpo_inv.training.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_NOT_SAVED
from dpo_inv.training.loss import LOSS_TYPES, METRICS

TRACKER_PACKAGES = {  # the package each Accelerate tracker needs
    "tensorboard": "tensorboard", "wandb": "wandb", "comet_ml": "comet-ml", "mlflow": "mlflow", "aim": "aim",
    "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio",
}  # fmt: skip
PAIR_METRICS = (
    *(f"eval_{name}" for name in dict.fromkeys(METRICS + kto.METRICS + sft.METRICS)),
    "eval_recovery",
)
PRECISIONS = ("no", "bf16", "fp16")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")  # TRL's names of torch's AdamW, fused and not
SAVE_STEPS = 500  # save_strategy steps without save_steps, as in Transformers
VARIANT_METRICS = ("eval_spearman", "eval_spearman_median", "eval_native_recovery", "eval_native_logp")
EPILOG = (
    f"Exit status: 0 when training finished; {EXIT_BAD_INPUT} on bad input: a bad option, or bad "
    "records, each reported on one line naming the file, the record, what is wrong and the fix; "
    f"{EXIT_INTERRUPTED} when SIGTERM or SIGUSR1 (what PBS and SLURM send before the walltime) stopped it "
    "at an optimizer step with a checkpoint: run again with --resume_from_checkpoint latest to finish; "
    f"{EXIT_NONFINITE} when it stopped with a checkpoint after max_consecutive_nonfinite steps in a row "
    f"with a non-finite loss or gradient norm; {EXIT_NOT_SAVED} when a checkpoint or model could not be "
    "written (a full disk or quota), the previous checkpoint complete; 1 on another error, which each "
    "failing rank reports as a last line 'rank R: ...' on stderr. A second signal ends the process at once."
)


def field_help(text: str, **kwargs) -> dict:
    """A dataclass field's `--help` text, as HfArgumentParser reads it."""
    return {"metadata": {"help": text}, **kwargs}


@dataclass
class DPOConfig(LoraOptions, DecodingOrderOptions):
    """Everything a DPO run needs. Names follow TRL's `DPOConfig` where TRL has the concept."""

    # model
    model_name_or_path: str = field(
        default="vanilla/v_48_020",
        **field_help(
            "Policy weights: an official name (vanilla/v_48_020, soluble/v_48_010, ca/v_48_020, "
            "ligand/v_32_010_25, ...), an official .pt file, or a directory saved by dpo_inv."
        ),
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        **field_help("Reference model weights (same forms); default: the policy's starting weights."),
    )
    disable_dropout: bool | None = field(
        default=None,
        **field_help(
            "Disable dropout in the policy; default: yes (TRL's default), but with loss_type sft no "
            "(ProteinMPNN trains with its dropout)."
        ),
    )
    backbone_noise: float | None = field(
        default=None,
        **field_help(
            "Gaussian noise (Å) added to backbone coordinates of the policy in training; default: 0, but "
            "with loss_type sft the noise the model was trained with (0.20 for v_48_020)."
        ),
    )
    ligand_context: bool = field(default=True, **field_help(LIGAND_CONTEXT_HELP))
    ligand_exclude: list[str] = field(default_factory=list, **field_help(LIGAND_EXCLUDE_HELP))
    # data
    train_file: str = field(
        default="data/pairs/train.jsonl",
        **field_help(
            "Preference pairs (JSON, JSONL, CSV or Parquet); with loss_type kto or apo_zero_unpaired, "
            "labelled sequences (sequence, label: true = desirable); with loss_type sft alone, structure "
            "records (pdb_file and chains; a sequence to train on, else the structure's own) or a folder of "
            "structure files."
        ),
    )
    eval_file: str | None = field(
        default=None,
        **field_help("Evaluation pairs (labelled sequences for kto); default: split eval_split off train."),
    )
    eval_split: float = field(
        default=0.1,
        **field_help(
            "Without eval_file: fraction of training structures (with all their pairs) held out; 0 = none; "
            "none from a single structure."
        ),
    )
    eval_variants_file: str | None = field(
        default=None,
        **field_help(
            "Labelled variants (sequence, wildtype_seq, label: higher = better) scored at each eval: "
            "eval_spearman is the mean over structures of Spearman's correlation of the conditional "
            "delta_logp with the label; their backbones give eval_native_recovery (greedy decoding) and "
            "eval_native_logp (the native sequence's mean log p per residue), the model's design ability. "
            "Every record must be good (on_bad_record does not apply)."
        ),
    )
    cache_dir: str | None = field(
        default=None,
        **field_help("Cache for parsed structures; default: the datasets cache (HF_DATASETS_CACHE)."),
    )
    structure_root: list[str] | None = field(
        default=None,
        **field_help("Folders the structure files must lie in (after resolving links); default: anywhere."),
    )
    on_bad_record: Literal["fail", "skip"] = field(
        default="fail",
        **field_help(
            "fail: report every bad record (up to 20) and stop before training; skip: leave bad records "
            "out, listing each with its reason in output_dir/skipped.jsonl."
        ),
    )
    dataset_num_proc: int | None = field(
        default=None,
        **field_help("Processes parsing structures; default: one per usable CPU, 64+ structures each."),
    )
    dataloader_num_workers: int = field(default=0, **field_help("DataLoader worker processes per rank."))
    # DPO
    beta: float = field(
        default=0.1, **field_help("DPO temperature: how far the policy may move from the reference.")
    )
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        **field_help(
            f"Pairs: one or more of {', '.join(LOSS_TYPES)}, summed with loss_weights (sft: the NLL of the "
            "preferred sequence per residue; residpo: residue-level DPO on per-residue scores). Labelled "
            f"sequences: one of {', '.join(kto.UNPAIRED_LOSS_TYPES)}. sft alone: supervised fine-tuning on "
            "structure records, ProteinMPNN's training objective (label_smoothing_factor, backbone noise)."
        ),
    )
    loss_weights: list[float] | None = field(
        default=None, **field_help("Weights of the loss types; default: all 1.")
    )
    label_smoothing: float = field(
        default=0.0, **field_help("Probability that a label is flipped (conservative DPO; sigmoid, robust).")
    )
    label_smoothing_factor: float = field(
        default=0.1,
        **field_help(
            "sft on structure records: the probability mass spread over the 21 letters of each target, as "
            "ProteinMPNN's training smooths its labels."
        ),
    )
    rpo_alpha: float | None = field(
        default=None,
        **field_help(
            "TRL's former name of an sft term: adds sft to loss_type with this weight in loss_weights (RPO)."
        ),
    )
    residue_margin: float = field(
        default=0.0,
        **field_help(
            "residpo: a position counts when the preferred sequence's residue score beats the other's by "
            "more than this."
        ),
    )
    residue_constraint_weight: float = field(
        default=0.0,
        **field_help(
            "residpo: weight of the mean squared log-ratio of the preferred sequence at the positions it "
            "does not win (at least residue_constraint_threshold), which keeps them near the reference."
        ),
    )
    residue_constraint_threshold: float | None = field(
        default=None,
        **field_help("residpo: least residue score of a constrained position; default: every position."),
    )
    anchor_weight: float = field(
        default=0.0,
        **field_help(
            "Weight of KL(reference || policy) of the per-residue distributions at the residues a pair "
            "does not score (outside mutable_positions), averaged over them: keeps the model's design "
            "ability while same-position pairs move the scored residue."
        ),
    )
    desirable_weight: float = field(
        default=1.0, **field_help("kto: weight of the desirable sequences' losses (TRL's KTOConfig).")
    )
    undesirable_weight: float = field(
        default=1.0, **field_help("kto: weight of the undesirable sequences' losses (TRL's KTOConfig).")
    )
    reference_free: bool = field(default=False, **field_help("Use no reference model (log p_ref = 0)."))
    precompute_ref_log_probs: bool = field(
        default=False,
        **field_help(
            "Score every pair with the reference once before training (each pair then keeps its decoding "
            "orders for all epochs), so training runs no reference forward."
        ),
    )
    num_decoding_orders: int = field(
        default=1,
        **field_help("Decoding orders per pair; log p is averaged over them (less variance, more compute)."),
    )
    # optimisation
    learning_rate: float = field(default=5e-5, **field_help("Peak learning rate (AdamW)."))
    weight_decay: float = field(default=0.0, **field_help("AdamW weight decay."))
    lr_scheduler_type: str = field(
        default="linear",
        **field_help("A transformers.get_scheduler name: linear, cosine, constant_with_warmup, ..."),
    )
    optim: str = field(
        default="adamw_torch",
        **field_help(
            "torch's AdamW as TRL names it: adamw_torch (torch's default implementation) or "
            "adamw_torch_fused (TRL's default: one kernel for all weights; the same numbers to a unit in the "
            "last place)."
        ),
    )
    adam_beta1: float = field(default=0.9, **field_help("AdamW's beta1."))
    adam_beta2: float = field(default=0.999, **field_help("AdamW's beta2."))
    adam_epsilon: float = field(default=1e-8, **field_help("AdamW's epsilon."))
    warmup_ratio: float = field(
        default=0.1, **field_help("Warm-up as a fraction of the optimizer steps, unless warmup_steps is set.")
    )
    warmup_steps: float | None = field(
        default=None,
        **field_help(
            "Warm-up steps, or below 1 a fraction of the optimizer steps, as Transformers takes it; 0 for "
            "none. Set, it replaces warmup_ratio."
        ),
    )
    per_device_train_batch_size: int = field(default=8, **field_help("Pairs per device per micro-batch."))
    pad_to_multiple_of: int | None = field(
        default=None,
        **field_help(
            "Pad each micro-batch's structures to a multiple of this many residues, so that batch shapes "
            "repeat (for cuda_graphs, one graph per shape; and torch_compile); the padding is masked."
        ),
    )
    per_device_train_batch_residues: int | None = field(
        default=None,
        **field_help(
            "Measure micro-batches in residues instead (replaces per_device_train_batch_size): each holds "
            "as many length-grouped examples as fit, counted as memory grows: examples x the longest "
            "structure's length <= this; a structure longer than this is a micro-batch alone. ProteinMPNN "
            "trains with about 10000; on a GPU set 10000 or more."
        ),
    )
    per_device_eval_batch_size: int = field(
        default=16, **field_help("Pairs per device per evaluation batch.")
    )
    gradient_accumulation_steps: int = field(default=1, **field_help("Micro-batches per optimizer step."))
    max_grad_norm: float = field(default=1.0, **field_help("Gradient clipping norm; 0 = no clipping."))
    max_consecutive_nonfinite: int = field(
        default=10,
        **field_help(
            "An optimizer step whose loss or gradient norm is not finite is skipped (counted in "
            "skipped_steps); after this many in a row, training stops with a checkpoint (exit status "
            f"{EXIT_NONFINITE})."
        ),
    )
    num_train_epochs: float = field(default=3, **field_help("Epochs, when max_steps is not set."))
    max_steps: int = field(
        default=-1, **field_help("Optimizer steps in total; > 0 overrides num_train_epochs.")
    )
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None,
        **field_help(
            "Accelerate autocast precision; default: bf16 or fp16 where that flag is true, else what "
            "`accelerate launch --mixed_precision` set, else no."
        ),
    )
    bf16: bool | None = field(
        default=None,
        **field_help("TRL's and Transformers' flag: true is mixed_precision bf16, false is no (fp32)."),
    )
    fp16: bool | None = field(
        default=None,
        **field_help("TRL's and Transformers' flag: true is mixed_precision fp16 (a GPU's), false is no."),
    )
    tf32: bool | None = field(
        default=None,
        **field_help(
            "TensorFloat-32 matrix products on an NVIDIA GPU (Ampere or newer): faster fp32 steps, with "
            "a 10-bit mantissa; default: torch's setting."
        ),
    )
    fused_kernels: bool = field(
        default=False,
        **field_help(
            "With bf16 or fp16 on a CUDA GPU (Triton): each message MLP as one fused kernel that keeps "
            "no per-edge activation in memory (recomputed in the backward pass), and the edges' distance "
            "features as one kernel that writes them in bf16: peak memory down by 40-48 percent on an H100, "
            "the bytes a step moves halved again (docs/benchmarks.md; speed not yet measured for the present "
            "kernels). Same numbers as the plain layers; no effect in fp32 or on a CPU."
        ),
    )
    cuda_graphs: bool = field(
        default=False,
        **field_help(
            "On one NVIDIA GPU: capture each micro-batch shape's forward and backward as a CUDA graph and "
            "replay it, so that a small batch's step is not bound by launching its operators; the same "
            "step, computed as without. Set pad_to_multiple_of (e.g. 64) so that shapes repeat; needs "
            "gradient_accumulation_steps 1, not fp16 or torch_compile."
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        **field_help(
            "Keep only each message-passing layer's inputs in the forward pass and run the layer again in "
            "the backward pass (activation checkpointing): the same gradients in less memory (a quarter "
            "less at ProteinMPNN's batch of 8), each step slower by the policy's forward pass once more "
            "(docs/training.md#memory-activation-checkpointing)."
        ),
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        **field_help(
            "Transformers' options of activation checkpointing, a mapping or its JSON: every_n_layers "
            "(checkpoint every n-th layer, default 1) and use_reentrant (false only)."
        ),
    )
    gradient_checkpointing: bool | None = field(
        default=None, **field_help("TRL's and Transformers' former name of activation_checkpointing.")
    )
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        **field_help("TRL's and Transformers' former name of activation_checkpointing_kwargs."),
    )
    torch_compile: bool = field(
        default=False,
        **field_help(
            "Compile the policy's encoder and decoder layers with torch.compile (regional compilation, "
            "dynamic shapes): faster steps after a one-time compilation of a minute or more."
        ),
    )
    torch_compile_backend: str = field(default="inductor", **field_help("torch.compile backend."))
    torch_compile_mode: str | None = field(
        default=None, **field_help("torch.compile mode: default, reduce-overhead, max-autotune, ...")
    )
    seed: int = field(default=42, **field_help("Seed for data order, decoding orders and the eval split."))
    # logging and checkpoints
    output_dir: str = field(
        default="outputs/dpo", **field_help("Where config, metrics, checkpoints and models go.")
    )
    logging_strategy: Literal["steps", "epoch", "no"] = field(
        default="steps",
        **field_help("Log training metrics every logging_steps, at each epoch's end, or not at all."),
    )
    logging_steps: int = field(default=10, **field_help("Log training metrics every N optimizer steps."))
    logging_first_step: bool = field(default=False, **field_help("Log the first optimizer step too."))
    eval_strategy: Literal["steps", "epoch", "no"] | None = field(
        default=None,
        **field_help(
            "Evaluate every eval_steps (default: logging_steps), at each epoch's end, or not at all "
            "(eval_on_start still evaluates the starting model); default: steps where eval_steps is given, "
            "else epoch. The last step is always evaluated, unless no."
        ),
    )
    eval_steps: int | None = field(
        default=None, **field_help("Evaluate every N optimizer steps (eval_strategy steps).")
    )
    eval_on_start: bool = field(
        default=False,
        **field_help(
            "Evaluate the starting model too, at step 0 (it stays in best/ unless training beats it)."
        ),
    )
    save_strategy: Literal["steps", "epoch", "no"] | None = field(
        default=None,
        **field_help(
            "Checkpoint every save_steps (default: 500, as Transformers), at each epoch's end, or never "
            "(a run stopped by a signal or by non-finite steps still saves one to resume from); default: "
            "steps where save_steps is given, else epoch. The last step is always saved, unless no."
        ),
    )
    save_steps: int | None = field(
        default=None, **field_help("Checkpoint every N optimizer steps (save_strategy steps).")
    )
    metric_for_best_model: str | None = field(
        default=None,
        **field_help(
            "The eval metric that picks the model kept in best/: eval_loss, eval_spearman, "
            "eval_rewards/accuracies, eval_recovery, ... (the eval_ prefix may be left out, as in "
            "Transformers); default: eval_loss, or eval_spearman when eval_variants_file is the only "
            "eval set."
        ),
    )
    recovery_tolerance: float | None = field(
        default=None,
        **field_help(
            "Keep in best/ only a model whose eval_native_recovery is at most this below the starting "
            "model's (needs eval_variants_file and eval_on_start): the best ranking that keeps design "
            "ability."
        ),
    )
    load_best_model_at_end: bool = field(
        default=False,
        **field_help("Save the model of the best eval (best/) as final/, instead of the last one."),
    )
    greater_is_better: bool | None = field(
        default=None,
        **field_help(
            "Whether a larger metric_for_best_model is better; default: false for a loss, else true."
        ),
    )
    save_total_limit: int | None = field(
        default=2, **field_help("Keep only the newest N checkpoints, the one just saved always; None = all.")
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        **field_help(
            "latest (the newest complete checkpoint in output_dir; true says the same, as in "
            "Transformers), or a checkpoint directory, to continue a run exactly, e.g. after it stopped on "
            "SIGTERM or SIGUSR1."
        ),
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        **field_help("Trackers: none, all, tensorboard, wandb, ... (Accelerate)."),
    )
    run_name: str = field(default="dpo_inv", **field_help("Run name for trackers."))
    log_data_order: bool = field(
        default=False,
        **field_help("Write the pair indices each rank trained on, per micro-batch, to data_order.jsonl."),
    )
    # distributed
    backend: str | None = field(
        default=None,
        **field_help("Process-group backend; default by device: nccl (CUDA), xccl or ccl (XPU), gloo."),
    )
    ddp_timeout: int = field(
        default=1800,
        **field_help("Seconds a rank waits to join the process group, or in a collective, before failing."),
    )

    def __post_init__(self) -> None:
        for spec in fields(self):  # one value where a list is expected: report_to="none", loss_type="ipo"
            value = getattr(self, spec.name)
            if str(spec.type).startswith("list[") and isinstance(value, (str, int, float)):
                setattr(self, spec.name, [value])
        trackers = ("none", *(t.value for t in LoggerType))
        unknown = [name for name in self.report_to if name not in trackers]
        if unknown:
            raise OptionError(f"report_to {unknown} unknown; choose from {', '.join(trackers)}")
        missing = [name for name in self.report_to if name in TRACKER_PACKAGES and not find_spec(name)]
        if missing:
            packages = " ".join(TRACKER_PACKAGES[name] for name in missing)
            raise OptionError(
                f"report_to {', '.join(missing)}: not installed; pip install {packages} (the trackers "
                "extra has tensorboard and wandb: pip install 'dpo_inv[trackers]')"
            )
        check_signs(
            self,
            positive=("beta", "learning_rate", "num_train_epochs", "per_device_train_batch_size",
                      "per_device_train_batch_residues", "per_device_eval_batch_size", "pad_to_multiple_of",
                      "gradient_accumulation_steps", "num_decoding_orders", "logging_steps", "eval_steps",
                      "save_steps", "dataset_num_proc", "ddp_timeout", "max_consecutive_nonfinite",
                      "adam_epsilon"),
            non_negative=("backbone_noise", "label_smoothing_factor", "eval_split", "weight_decay",
                          "warmup_ratio", "warmup_steps", "max_grad_norm", "label_smoothing",
                          "rpo_alpha", "residue_margin",
                          "residue_constraint_weight", "anchor_weight", "desirable_weight",
                          "undesirable_weight", "dataloader_num_workers", "loss_weights",
                          "recovery_tolerance", "adam_beta1", "adam_beta2"),
        )  # fmt: skip
        limits = (("eval_split", self.eval_split < 1, "< 1"),
                  ("warmup_ratio", self.warmup_ratio <= 1, "<= 1"),
                  ("label_smoothing", self.label_smoothing < 0.5, "< 0.5"),
                  ("adam_beta1", self.adam_beta1 < 1, "< 1"),
                  ("adam_beta2", self.adam_beta2 < 1, "< 1"))  # fmt: skip
        for name, ok, rule in limits:
            if not ok:
                raise OptionError(f"{name} must be {rule}, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise OptionError(f"max_steps must be > 0, or -1 (train num_train_epochs), got {self.max_steps}")
        self.check_lora()
        self.check_losses()
        if self.optim not in OPTIMIZERS:
            raise OptionError(
                f"optim {self.optim} does not apply: dpo_inv trains with torch's AdamW, "
                f"{' or '.join(OPTIMIZERS)}; its settings are adam_beta1, adam_beta2, adam_epsilon and "
                "weight_decay"
            )
        if self.decoding_order not in ("random", "left_to_right"):
            raise OptionError("decoding_order must be random or left_to_right")
        if self.reference_free and self.precompute_ref_log_probs:
            raise OptionError("reference_free and precompute_ref_log_probs exclude each other")
        if self.recovery_tolerance is not None and not (self.eval_variants_file and self.eval_on_start):
            raise OptionError(
                "recovery_tolerance needs eval_variants_file and eval_on_start (the start's recovery)"
            )
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise OptionError("save_total_limit must be at least 1 (or None: keep all)")
        if self.warmup_steps is not None and self.warmup_steps >= 1 and self.warmup_steps % 1:
            raise OptionError(
                f"warmup_steps must be a whole number of steps, or below 1, got {self.warmup_steps}"
            )
        if str(self.resume_from_checkpoint).lower() in ("true", "false"):  # Transformers' true: the latest
            self.resume_from_checkpoint = (
                "latest" if str(self.resume_from_checkpoint).lower() == "true" else None
            )
        self.resolve_precision()
        self.resolve_checkpointing()
        if self.cuda_graphs:
            self.check_cuda_graphs()
        self.resolve_schedules()
        self.resolve_metric_for_best_model()

    @property
    def record_kind(self) -> Literal["pairs", "labelled", "structures"]:
        """What the training records hold: preference pairs, labelled sequences (KTO) or structure records
        (loss_type sft alone)."""
        if self.unpaired:
            return "labelled"
        return "structures" if self.loss_type == ["sft"] else "pairs"

    @property
    def reference_sums_only(self) -> bool:
        """The loss reads only the reference's summed log-probs of each pair's two sequences, which can be
        computed once: pairs with a reference, not residpo or anchor_weight (per-position terms)."""
        return (
            self.record_kind == "pairs"
            and not self.reference_free
            and "residpo" not in self.loss_type
            and not self.anchor_weight
        )

    @property
    def unpaired(self) -> bool:
        """Training on labelled sequences (kto, apo_zero_unpaired) instead of pairs."""
        return self.loss_type[0] in kto.UNPAIRED_LOSS_TYPES

    def check_cuda_graphs(self) -> None:
        """Refuse what a captured step cannot do: add gradients over micro-batches, scale fp16 losses
        (bf16 needs no scaling), or be compiled by torch.compile (whose reduce-overhead mode has its own
        CUDA graphs)."""
        conflicts = (
            ("gradient_accumulation_steps", self.gradient_accumulation_steps > 1,
             "raise per_device_train_batch_size instead"),
            ("mixed_precision fp16", self.mixed_precision == "fp16", "use bf16"),
            ("torch_compile", self.torch_compile,
             "choose one (torch_compile_mode reduce-overhead has its own)"),
            ("activation_checkpointing", self.activation_checkpointing,
             "choose one (checkpointing saves memory, graphs launch a small batch's step at once)"),
        )  # fmt: skip
        for name, conflict, fix in conflicts:
            if conflict:
                raise OptionError(f"cuda_graphs does not go with {name}: {fix}")

    def check_losses(self) -> None:
        """Refuse unknown or incompatible losses; fill in loss_weights and turn rpo_alpha into an sft term."""
        known = LOSS_TYPES + kto.UNPAIRED_LOSS_TYPES
        bad = [t for t in self.loss_type if t not in known]
        if bad:
            raise OptionError(f"loss_type {bad} unknown; choose from {', '.join(known)}")
        if self.loss_weights is None:
            self.loss_weights = [1.0] * len(self.loss_type)
        if len(self.loss_weights) != len(self.loss_type):
            raise OptionError("loss_weights needs one weight per loss_type")
        if not any(self.loss_weights) or not (self.desirable_weight or self.undesirable_weight):
            raise OptionError("the loss weights are all 0: nothing would be trained")
        if self.rpo_alpha is not None:
            if "sft" in self.loss_type:
                raise OptionError("give rpo_alpha or an sft loss_type, not both (rpo_alpha adds sft)")
            self.loss_type, self.loss_weights = [*self.loss_type, "sft"], [*self.loss_weights, self.rpo_alpha]
            self.rpo_alpha = None
        if any(t in kto.UNPAIRED_LOSS_TYPES for t in self.loss_type):
            if len(self.loss_type) > 1:
                raise OptionError(
                    f"loss_type {self.loss_type[0]} trains on labelled sequences and stands alone"
                )
            if self.reference_free or self.precompute_ref_log_probs:
                raise OptionError(
                    f"loss_type {self.loss_type[0]} needs the reference model during training (its KL term): "
                    "drop reference_free and precompute_ref_log_probs"
                )
        if "residpo" in self.loss_type and self.precompute_ref_log_probs:
            raise OptionError(
                "loss_type residpo needs per-position reference log-probs: drop precompute_ref_log_probs"
            )
        if self.record_kind == "structures" and (self.reference_free or self.precompute_ref_log_probs):
            raise OptionError(
                "loss_type sft alone trains on structure records without a reference model: drop "
                "reference_free and precompute_ref_log_probs"
            )
        if self.anchor_weight and (
            self.record_kind != "pairs" or self.reference_free or self.precompute_ref_log_probs
        ):
            raise OptionError(
                "anchor_weight needs pairs and the reference model's distributions during training: drop "
                "reference_free and precompute_ref_log_probs"
            )
        if self.residue_constraint_weight and "residpo" not in self.loss_type:
            raise OptionError("residue_constraint_weight belongs to loss_type residpo")

    def resolve_precision(self) -> None:
        """mixed_precision from TRL's bf16 and fp16 flags (then cleared: mixed_precision holds what they
        said), else from `accelerate launch --mixed_precision`, else no; a flag that disagrees is refused."""
        on = [name for name in ("bf16", "fp16") if getattr(self, name)]
        off = [name for name in ("bf16", "fp16") if getattr(self, name) is False]
        if len(on) > 1:
            raise OptionError("bf16 and fp16 are both true: choose one")
        if self.mixed_precision is None:
            launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            if launcher not in PRECISIONS:
                trains = ", ".join(PRECISIONS)
                raise OptionError(
                    f"accelerate launch --mixed_precision {launcher}: dpo_inv trains in {trains}"
                )
            self.mixed_precision = on[0] if on else "no" if launcher in off else launcher
        for name in on + off:
            if (name == self.mixed_precision) != (name in on):
                raise OptionError(
                    f"{name} {str(name in on).lower()} and mixed_precision {self.mixed_precision} disagree: "
                    f"give one of them"
                )
        self.bf16 = self.fp16 = None

    def resolve_checkpointing(self) -> None:
        """activation_checkpointing and its options from TRL's former names (then cleared); the options
        checked: every_n_layers, a whole number from 1, and use_reentrant false (a layer takes inputs that
        are not tensors, which reentrant checkpointing cannot recompute it from)."""
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):  # fmt: skip
            given = getattr(self, old)
            if given is not None and getattr(self, new) and getattr(self, new) != given:
                raise OptionError(f"{old} and {new} disagree: give one of them")
            if given is not None:
                setattr(self, new, given)
            setattr(self, old, None)
        options = self.activation_checkpointing_kwargs
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as error:
                raise OptionError(f"activation_checkpointing_kwargs is not JSON ({error}): e.g. "
                                  '\'{"every_n_layers": 2}\'') from None  # fmt: skip
        options = {} if options is None else options
        if not isinstance(options, dict) or set(options) - {"every_n_layers", "use_reentrant"}:
            raise OptionError(
                f"activation_checkpointing_kwargs {options}: dpo_inv takes every_n_layers and use_reentrant"
            )
        every = options.get("every_n_layers", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise OptionError(f"every_n_layers must be a whole number from 1, got {every!r}")
        if options.get("use_reentrant", False) is not False:
            raise OptionError(
                "use_reentrant true: a layer takes inputs that are not tensors, which reentrant "
                "checkpointing cannot run it again from; write false, or drop it"
            )
        self.activation_checkpointing_kwargs = options
        if self.activation_checkpointing and self.fused_kernels:
            raise OptionError(
                "activation_checkpointing and fused_kernels: the fused kernels already recompute the "
                "message MLPs in the backward pass and keep no per-edge activation; choose one"
            )

    @property
    def checkpointed_every(self) -> int | None:
        """Every how many message-passing layers one is checkpointed; None: none."""
        if not self.activation_checkpointing:
            return None
        return self.activation_checkpointing_kwargs.get("every_n_layers", 1)

    def resolve_schedules(self) -> None:
        """eval_strategy and save_strategy where not given: steps where their steps are, else epoch; their
        steps where not given (Transformers' defaults: logging_steps, 500)."""
        for kind, default in (("eval", self.logging_steps), ("save", SAVE_STEPS)):
            strategy, steps = getattr(self, f"{kind}_strategy"), getattr(self, f"{kind}_steps")
            strategy = strategy or ("steps" if steps else "epoch")
            if strategy != "steps" and steps is not None:
                raise OptionError(
                    f"{kind}_steps {steps} is for {kind}_strategy steps, not {strategy}: drop one of them"
                )
            setattr(self, f"{kind}_strategy", strategy)
            setattr(self, f"{kind}_steps", default if strategy == "steps" and steps is None else steps)
        if self.load_best_model_at_end and self.eval_strategy == "no":
            raise OptionError("load_best_model_at_end needs evaluations: eval_strategy steps or epoch")

    def warmup(self, total_steps: int) -> int:
        """Warm-up optimizer steps: warmup_steps (below 1, a fraction of `total_steps`), else warmup_ratio."""
        if self.warmup_steps is None:
            return math.ceil(self.warmup_ratio * total_steps)
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(self.warmup_steps * total_steps)

    def resolve_metric_for_best_model(self) -> None:
        """Fill in the defaults of metric_for_best_model and greater_is_better (Transformers' rules) and
        refuse a metric this run's eval sets cannot produce."""
        has_pairs = self.eval_file is not None or self.eval_split > 0
        if self.metric_for_best_model is None:
            only_variants = self.eval_variants_file and not has_pairs
            self.metric_for_best_model = "eval_spearman" if only_variants else "eval_loss"
        if not self.metric_for_best_model.startswith("eval_"):
            self.metric_for_best_model = f"eval_{self.metric_for_best_model}"
        if self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        metric = self.metric_for_best_model
        if metric in VARIANT_METRICS and not self.eval_variants_file:
            raise OptionError(f"metric_for_best_model {metric} needs an eval_variants_file")
        if metric in PAIR_METRICS and not has_pairs and self.eval_variants_file:
            raise OptionError(
                f"metric_for_best_model {metric} needs eval pairs (eval_file or eval_split > 0)"
            )
        known = PAIR_METRICS + VARIANT_METRICS
        if metric not in known:
            raise OptionError(f"metric_for_best_model {metric} unknown; choose from {', '.join(known)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_sanitized_dict(self) -> dict:
        """The configuration as trackers take it (TensorBoard's hyperparameters): lists and None as text."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}
