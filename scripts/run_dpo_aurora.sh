#!/bin/bash
# DPO training on Aurora (ALCF): one rank per GPU tile, mpiexec + oneCCL. Submit with
#   qsub -A YOUR_PROJECT -l select=2:system=aurora -v CONFIG=configs/example.yaml scripts/run_dpo_aurora.sh
# Every setting below is an environment variable with a default. Outside PBS the same script runs on
# this machine alone (NNODES=1, master = localhost), e.g. RANKS_PER_NODE=2 scripts/run_dpo_aurora.sh.
# Extra arguments are passed to dpo_inv.run.
#PBS -N dpo_inv
#PBS -l select=2:system=aurora
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:flare
#PBS -q prod
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$(pwd)}"

CONFIG=${CONFIG:-configs/example.yaml}
RANKS_PER_NODE=${RANKS_PER_NODE:-12}                  # 6 GPUs x 2 tiles per Aurora node
if [ -n "${PBS_NODEFILE:-}" ]; then
    NNODES=${NNODES:-$(sort -u "$PBS_NODEFILE" | wc -l)}
    MASTER_ADDR=${MASTER_ADDR:-$(head -n 1 "$PBS_NODEFILE")}
else
    NNODES=${NNODES:-1}
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
fi
NRANKS=$((NNODES * RANKS_PER_NODE))
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
FRAMEWORKS_MODULE=${FRAMEWORKS_MODULE:-frameworks}   # ALCF's PyTorch + IPEX + oneCCL module
VENV=${VENV:-}                                        # a venv made with --system-site-packages on top of it

if [ -n "$FRAMEWORKS_MODULE" ] && command -v module >/dev/null 2>&1; then
    module load "$FRAMEWORKS_MODULE"
fi
if [ -n "$VENV" ]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi

# Level Zero and oneCCL settings usual on Aurora
export ZE_FLAT_DEVICE_HIERARCHY=${ZE_FLAT_DEVICE_HIERARCHY:-FLAT}   # each tile is an xpu device
export CCL_PROCESS_LAUNCHER=${CCL_PROCESS_LAUNCHER:-pmix}
export CCL_ATL_TRANSPORT=${CCL_ATL_TRANSPORT:-mpi}
export CCL_KVS_MODE=${CCL_KVS_MODE:-mpi}
export CCL_KVS_CONNECTION_TIMEOUT=${CCL_KVS_CONNECTION_TIMEOUT:-600}
export CCL_ZE_IPC_EXCHANGE=${CCL_ZE_IPC_EXCHANGE:-drmfd}
export FI_PROVIDER=${FI_PROVIDER:-cxi}
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}

# PALS' mpiexec binds each rank to 8 cores next to its tile; other mpiexecs get no binding flag
CPU_BIND=${CPU_BIND:-list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100}
BIND_ARGS=()
if [ -n "${PBS_JOBID:-}" ] && [ -n "$CPU_BIND" ]; then
    BIND_ARGS=(--cpu-bind "$CPU_BIND")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}      # the 8 cores each rank is bound to
fi                                                    # elsewhere dpo_inv shares the node's cores among ranks

echo "dpo_inv on $NNODES node(s) x $RANKS_PER_NODE ranks = $NRANKS, master $MASTER_ADDR:$MASTER_PORT"
mpiexec -n "$NRANKS" -ppn "$RANKS_PER_NODE" "${BIND_ARGS[@]}" \
    "$PYTHON" -m dpo_inv.run --config "$CONFIG" "$@"
