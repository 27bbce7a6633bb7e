#!/usr/bin/env bash
# Runs scripts/train.py on one of several machines: start it on EVERY machine with the
# same settings. torchrun's c10d rendezvous (at RDZV_ENDPOINT, any one of the machines)
# gathers NNODES machines of NPROC workers each; MultiWorkerMirroredStrategy then
# trains one replica per worker over torch.distributed. Extra arguments go to train.py:
#   NNODES=2 NPROC=4 RDZV_ENDPOINT=head:29500 RUN_ID=digits-1 \
#       launch/torchrun_multi_node.sh --task digits --checkpoint-dir /shared/ckpt --resume
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous (one of the machines)}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-1}
RUN_ID=${RUN_ID:-dtape-train}
MAX_RESTARTS=${MAX_RESTARTS:-3}       # restarted workers resume from --checkpoint-dir with --resume
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RUN_ID" \
    --max-restarts "$MAX_RESTARTS" \
    scripts/train.py --strategy multi_worker "$@"
