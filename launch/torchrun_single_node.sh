#!/usr/bin/env bash
# Runs scripts/train.py under torchrun on this machine: NPROC worker processes
# (default 2), one replica each, MultiWorkerMirroredStrategy over torch.distributed
# (gloo on CPUs, NCCL on GPUs). Extra arguments go to train.py, e.g.
#   NPROC=4 launch/torchrun_single_node.sh --task digits --out runs/digits-mw
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one core per worker unless told otherwise
exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" \
    scripts/train.py --strategy multi_worker "$@"
