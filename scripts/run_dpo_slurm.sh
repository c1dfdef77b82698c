#!/bin/bash
# DPO training on a SLURM cluster, one task per GPU. Nodes and GPUs come from the request:
#   sbatch --nodes 2 --ntasks-per-node 4 --export ALL,CONFIG=configs/example.yaml scripts/run_dpo_slurm.sh
# gives 2 x 4 = 8 ranks, one GPU each (--gpus-per-task=1 below); --cpus-per-task sets each rank's threads.
# SLURM sends SIGUSR1 five minutes before the time limit (--signal below): every rank stops at the next
# optimizer step with a checkpoint, and the job exits 3; submit again with --resume_from_checkpoint latest
# to finish (docs/training.md). Submit from the repository's folder. The Python that runs: $PYTHON, else
# the project's .venv there (`make setup`), else `python` on the PATH (--export ALL passes an activated
# environment's PATH).
# dpo_inv maps SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to RANK/WORLD_SIZE/LOCAL_RANK and takes the first
# node of the job as the master.
#SBATCH --job-name=dpo_inv
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --signal=USR1@300
#SBATCH --time=01:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(pwd)}"
CONFIG=${CONFIG:-configs/example.yaml}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PYTHON=$(pwd)/.venv/bin/python
fi
PYTHON=${PYTHON:-python}
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
echo "dpo_inv: ${SLURM_NTASKS:-?} ranks on ${SLURM_JOB_NUM_NODES:-?} node(s), $OMP_NUM_THREADS thread(s) each, $PYTHON"
exec srun "$PYTHON" -m dpo_inv.run --config "$CONFIG" "$@"
