#!/usr/bin/env bash
# Start this node's share of a multi-node run with torchrun; run it once on every node.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=node0.cluster bash examples/multinode/torchrun.sh
#   node 1:  NODE_RANK=1 MASTER_ADDR=node0.cluster bash examples/multinode/torchrun.sh
#
# Every node runs the same command with its own NODE_RANK; MASTER_ADDR is node 0's address, reachable from all.
# torchrun waits until NNODES nodes have joined. Lightning reads torchrun's environment (TorchElasticEnvironment):
# it launches nothing itself, and MultiGPUStrategy chooses DDP because num_nodes > 1. Extra arguments go to
# examples/cli.py, e.g. --trainer.max_steps=1000. Settings (environment variables, defaults in brackets):
#   NNODES [2]  NPROC_PER_NODE [GPUs on this node, or 2 on a CPU machine]  MASTER_PORT [29500]
#   CONFIG [multi_gpu; cpu on a CPU machine]: a name from `python -m lightning_mgpu config`, or a path
#   MODEL_CONFIG [examples/configs/blobs.yaml]: your model and data
#   MAX_RESTARTS [0]: attempts torchrun starts again after a failed one; with the robust_long_run config and
#     --ckpt_path=last after the arguments, each resumes from the newest checkpoint by itself
# Relative paths are taken from the directory you run it in.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)

gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 0 ]; then default_config=multi_gpu default_nproc=$gpus; else default_config=cpu default_nproc=2; fi
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-$default_nproc}
CONFIG=${CONFIG:-$default_config}
MODEL_CONFIG=${MODEL_CONFIG:-$repo/examples/configs/blobs.yaml}
if [ ! -f "$CONFIG" ]; then CONFIG=$(python -m lightning_mgpu config "$CONFIG"); fi

# torch 2.13: a restarted attempt's gloo group would otherwise read the last attempt's keys from torchrun's store and
# hang in init_process_group (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec python -m torch.distributed.run --max-restarts="${MAX_RESTARTS:-0}" \
    --nnodes="$NNODES" --node-rank="${NODE_RANK:?set NODE_RANK to the index of this node}" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" --master-port="${MASTER_PORT:-29500}" \
    "$repo/examples/cli.py" fit --config "$CONFIG" --config "$MODEL_CONFIG" \
    --trainer.num_nodes="$NNODES" --trainer.devices="$NPROC_PER_NODE" "$@"
