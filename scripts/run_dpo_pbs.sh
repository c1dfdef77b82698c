#!/bin/bash
# DPO training on a PBS cluster with NVIDIA GPUs, one rank per GPU through mpiexec. Nodes and GPUs come
# from the request:
#   qsub -l select=2:ngpus=4:ncpus=32 -v CONFIG=configs/example.yaml scripts/run_dpo_pbs.sh
# gives 2 x 4 = 8 ranks: the nodes of $PBS_NODEFILE, times GPUS_PER_NODE (default: the GPUs nvidia-smi
# lists); each rank gets NCPUS / GPUS_PER_NODE threads. Submit from the repository's folder; the Python
# that runs is $PYTHON, else the project's .venv there (`make setup`), else `python` on the PATH. For a
# checkpoint before the walltime, have PBS send SIGTERM ahead of it (e.g. `qdel` with a delay, or your
# site's kill_delay): every rank stops at the next optimizer step with a checkpoint and the job exits 3
# (docs/training.md). Outside PBS the script runs on this machine (one node, master 127.0.0.1).
# Extra arguments are passed to dpo_inv.run.
#PBS -N dpo_inv
#PBS -l select=1:ngpus=4:ncpus=32
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$(pwd)}"

CONFIG=${CONFIG:-configs/example.yaml}
if [ -n "${PBS_NODEFILE:-}" ]; then
    NNODES=${NNODES:-$(sort -u "$PBS_NODEFILE" | wc -l)}
    MASTER_ADDR=${MASTER_ADDR:-$(head -n 1 "$PBS_NODEFILE")}
    HOSTS=(--hostfile "$PBS_NODEFILE")
else
    NNODES=${NNODES:-1}
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
    HOSTS=()
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
GPUS_PER_NODE=$((GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1))
NRANKS=$((NNODES * GPUS_PER_NODE))
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-29500}
if [ -n "${NCPUS:-}" ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((NCPUS / GPUS_PER_NODE > 0 ? NCPUS / GPUS_PER_NODE : 1))}
fi
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PYTHON=$(pwd)/.venv/bin/python
fi
PYTHON=${PYTHON:-python}
# ranks per node: Open MPI's --npernode, MPICH's (Hydra, PALS, Intel MPI) -ppn
if mpiexec --version 2>&1 | grep -q "Open MPI"; then
    PER_NODE=(--npernode "$GPUS_PER_NODE")
else
    PER_NODE=(-ppn "$GPUS_PER_NODE")
fi

echo "dpo_inv on $NNODES node(s) x $GPUS_PER_NODE ranks = $NRANKS, master $MASTER_ADDR:$MASTER_PORT"
mpiexec -n "$NRANKS" "${PER_NODE[@]}" "${HOSTS[@]}" "$PYTHON" -m dpo_inv.run --config "$CONFIG" "$@"
