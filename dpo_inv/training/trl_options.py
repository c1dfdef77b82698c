"""The options of TRL's `DPOConfig` and `ModelConfig` (and a few names TRL users type) that dpo_inv does not
take: why each does not apply to an inverse-folding model, and what to write instead. The command runner
answers such a key of a config file, or such a command-line option, with its line (docs/training.md,
"Coming from TRL", lists every option of both classes).
"""

from __future__ import annotations

NO_TOKENS = "no tokenizer: each sequence is a whole chain, as long as its structure"
NOT_TRUNCATED = f"{NO_TOKENS}, never truncated; to bound a batch's memory use per_device_train_batch_residues"
DDP = (
    "dpo_inv trains with DDP as Accelerate sets it up (a copy of the model per process; ProteinMPNN has "
    "1.7 million parameters): drop it"
)
EVAL_GATHER = "evaluation gathers every pair's metrics over the processes itself: drop it"
HUB = "nothing is uploaded: push the trained model with `hf upload REPO OUTPUT_DIR/final`"
LOADER = "the DataLoader takes dataloader_num_workers only (pinned memory on CUDA by itself): drop it"
NO_LOG_LEVEL = "rank 0 prints the job's lines once; --debug prints whole tracebacks: drop it"
TRACKIO = "trackio's hub settings are not passed on: set them in trackio's environment, or drop them"
QUANTIZED = "no quantization: the weights are fp32 and small; for bf16 compute set bf16 true"
REFERENCE_FIXED = (
    "the reference stays fixed; on-policy rounds (python -m dpo_inv rounds) train each round from the "
    "last round's model"
)
NOT_A_LM = "not a language model"
ADAPTER_OFF = "with use_peft the reference is the base model with the adapter switched off: drop it"

NOT_APPLICABLE: dict[str, str] = {
    # optimizer and schedule
    "optim_args": "AdamW's settings are adam_beta1, adam_beta2, adam_epsilon and weight_decay",
    "optim_target_modules": "every trained weight gets AdamW: drop it",
    "lr_scheduler_kwargs": "the schedules take their defaults: choose another lr_scheduler_type, or drop it",
    "average_tokens_across_devices": "the loss is a mean over pairs, averaged over processes by DDP: drop it",
    # precision and memory
    "bf16_full_eval": "evaluation runs in the training precision (mixed_precision): drop it",
    "fp16_full_eval": "evaluation runs in the training precision (mixed_precision): drop it",
    "activation_offloading": "activations stay on the device: activation_checkpointing keeps only each "
    "layer's inputs; on a GPU, fused_kernels keeps no per-edge activation",
    "use_liger_kernel": "Liger's kernels are for transformer language models; on a GPU use fused_kernels",
    "liger_kernel_config": "Liger's kernels are for transformer language models; on a GPU use fused_kernels",
    "use_cache": f"{NOT_A_LM}: there is no key-value cache: drop it",
    "neftune_noise_alpha": "NEFTune adds noise to token embeddings; noise on the structure is backbone_noise",
    "torch_empty_cache_steps": "CUDA's cache is kept between steps: drop it",
    "auto_find_batch_size": "set per_device_train_batch_size, or per_device_train_batch_residues (residues "
    "per micro-batch; on a GPU 10000 or more)",
    # logging
    "log_on_each_node": NO_LOG_LEVEL,
    "log_level": NO_LOG_LEVEL,
    "log_level_replica": NO_LOG_LEVEL,
    "logging_nan_inf_filter": "a step with a non-finite loss or gradient is skipped and counted in "
    "skipped_steps (max_consecutive_nonfinite): drop it",
    "include_num_input_tokens_seen": "tokens are not counted; samples_per_second is logged: drop it",
    "disable_tqdm": "progress bars are drawn on a terminal and are periodic lines in a log file; to hide "
    "them set TQDM_DISABLE=1",
    "project": TRACKIO,
    "trackio_space_id": TRACKIO,
    "trackio_bucket_id": TRACKIO,
    "trackio_static_space_id": TRACKIO,
    "skip_memory_metrics": "memory is not logged; scripts/benchmark.py measures it: drop it",
    # evaluation
    "eval_delay": "evaluation starts with eval_steps (or eval_strategy epoch); eval_on_start adds step 0",
    "prediction_loss_only": "evaluation logs its loss and reward metrics: drop it",
    "eval_do_concat_batches": EVAL_GATHER,
    "eval_use_gather_object": EVAL_GATHER,
    "eval_accumulation_steps": EVAL_GATHER,
    "include_for_metrics": EVAL_GATHER,
    "batch_eval_metrics": EVAL_GATHER,
    "evaluation_strategy": "Transformers' former name: write eval_strategy",
    # checkpoints and the Hub
    "save_only_model": "a checkpoint keeps optimizer, schedule and random states so that a run resumes "
    "exactly; the models alone are final/ and best/",
    "save_on_each_node": "rank 0 writes checkpoints, on a file system every node sees: drop it",
    "enable_jit_checkpoint": "SIGTERM and SIGUSR1 already stop training with a checkpoint: drop it",
    "restore_callback_states_from_checkpoint": "there are no callbacks: drop it",
    "ignore_data_skip": "a resumed run skips the batches it trained on, to continue exactly: drop it",
    "push_to_hub": HUB,
    "hub_token": HUB,
    "hub_private_repo": HUB,
    "hub_model_id": HUB,
    "hub_strategy": HUB,
    "hub_always_push": HUB,
    "hub_revision": HUB,
    # seeds and devices
    "full_determinism": "seed fixes the data order, the decoding orders and the eval split; a CPU run "
    "repeats exactly: drop it",
    "data_seed": "seed sets the data order too: drop it",
    "use_cpu": "train on the CPU of a GPU machine with CUDA_VISIBLE_DEVICES= (empty)",
    "accelerator_config": DDP,
    "parallelism_config": DDP,
    "fsdp": DDP,
    "fsdp_config": DDP,
    "deepspeed": DDP,
    "ddp_find_unused_parameters": DDP,
    "ddp_bucket_cap_mb": DDP,
    "ddp_broadcast_buffers": DDP,
    "ddp_static_graph": DDP,
    "ddp_backend": "write backend (nccl, xccl, ccl or gloo; default by device)",
    "local_rank": "the launcher sets LOCAL_RANK: drop it",
    # data
    "dataloader_drop_last": "every pair is trained on in each epoch, in batches grouped by length: drop it",
    "dataloader_pin_memory": LOADER,
    "dataloader_persistent_workers": LOADER,
    "dataloader_prefetch_factor": LOADER,
    "dataloader_multiprocessing_context": LOADER,
    "dataloader_in_order": LOADER,
    "remove_unused_columns": "records are read by their fields (docs/data.md); others are left: drop it",
    "label_names": f"{NOT_A_LM}: the labels are the pairs' sequences: drop it",
    "train_sampling_strategy": "batches are grouped by length and seeded (per_device_train_batch_residues "
    "counts them in residues): drop it",
    "length_column_name": "lengths come from the structures: drop it",
    "do_train": "python -m dpo_inv.run trains: drop it",
    "do_eval": "evaluation runs where there are eval pairs (eval_file, eval_split) or eval_variants_file; "
    "eval_strategy no turns it off",
    "do_predict": "score sequences with python -m dpo_inv score --model OUTPUT_DIR/final",
    "max_length": NOT_TRUNCATED,
    "max_prompt_length": NOT_TRUNCATED,
    "max_completion_length": NOT_TRUNCATED,
    "truncation_mode": NOT_TRUNCATED,
    "padding_free": "batches are padded to their longest structure, grouped by length so that little is "
    "padding; per_device_train_batch_residues bounds them in residues",
    "pad_token": f"{NO_TOKENS}: drop it",
    "padding_value": f"{NO_TOKENS}: drop it",
    "precompute_ref_batch_size": "the reference is precomputed in batches of per_device_eval_batch_size",
    "generate_during_eval": "sample designs with python -m dpo_inv sample; eval_variants_file scores "
    "ranking and design ability at each evaluation",
    # the model and the reference
    "ref_model": "write ref_model_name_or_path (default: the policy's starting weights)",
    "model_adapter_name": ADAPTER_OFF,
    "ref_adapter_name": ADAPTER_OFF,
    "model_init_kwargs": "the models are dpo_inv's ProteinMPNN and LigandMPNN, named by model_name_or_path",
    "trust_remote_code": "the models are dpo_inv's own code: drop it",
    "model_revision": "official weights are named with their version (vanilla/v_48_020); a saved model is "
    "a folder",
    "dtype": "the weights stay fp32 (AdamW's master copy); for bf16 compute set bf16 true",
    "attn_implementation": "ProteinMPNN passes messages between neighbouring residues, without attention",
    "router_aux_loss_coef": "no mixture of experts: drop it",
    "lora_target_parameters": "write lora_target_modules (the linear maps by name, or all-linear)",
    "lora_task_type": f"{NOT_A_LM}: drop it",
    "use_rslora": "not supported: rsLoRA's scale lora_alpha/sqrt(lora_r) is LoRA's with lora_alpha times "
    "sqrt(lora_r)",
    "use_dora": "not supported: use LoRA",
    "load_in_8bit": QUANTIZED,
    "load_in_4bit": QUANTIZED,
    "bnb_4bit_quant_type": QUANTIZED,
    "use_bnb_nested_quant": QUANTIZED,
    "bnb_4bit_quant_storage": QUANTIZED,
    # losses
    "ld_alpha": "LD-DPO weighs a response's length; both sequences of a pair have their structure's length",
    "f_divergence_type": "not implemented: loss_type sigmoid is DPO's reverse KL",
    "f_alpha_divergence_coef": "not implemented: loss_type sigmoid is DPO's reverse KL",
    "use_weighting": "WPO's weights are not implemented; a pair's weight field weighs its loss "
    "(docs/data.md)",
    "discopop_tau": "loss_type discopop is not implemented",
    "sync_ref_model": REFERENCE_FIXED,
    "ref_model_mixup_alpha": REFERENCE_FIXED,
    "ref_model_sync_steps": REFERENCE_FIXED,
}


def not_applicable(key: str) -> str | None:
    """Why the TRL option ``key`` does not apply, and what to write instead; None for another key."""
    reason = NOT_APPLICABLE.get(key)
    return None if reason is None else f"{key} does not apply: {reason}"
