#!/bin/bash
# DPO training on a SLURM cluster, one task per GPU. Submit with
#   sbatch --nodes 2 --export ALL,CONFIG=configs/example.yaml scripts/run_dpo_slurm.sh [--field value ...]
# dpo_inv maps SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to RANK/WORLD_SIZE/LOCAL_RANK and takes the first
# node of the job as the master.
#SBATCH --job-name=dpo_inv
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
set -euo pipefail
CONFIG=${CONFIG:-configs/example.yaml}
PYTHON=${PYTHON:-python}
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
srun "$PYTHON" -m dpo_inv.run --config "$CONFIG" "$@"
