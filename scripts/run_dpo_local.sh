#!/usr/bin/env bash
# DPO training with N processes on this machine: one per GPU, or N CPU processes (gloo) without GPUs.
#   scripts/run_dpo_local.sh N CONFIG [--field value ...]
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NUM_PROCESSES CONFIG.yaml [--field value ...]" >&2
    exit 2
fi
NPROC=$1
CONFIG=$2
shift 2
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    -m dpo_inv.run --config "$CONFIG" "$@"
