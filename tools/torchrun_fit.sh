#!/bin/bash
# Pretrain a recipe on several machines with torchrun (no scheduler): run the same command on
# every node, with the same rendezvous address (a host every node reaches) and job id.
#
#   NNODES=2 NPROC=8 RDZV=node0:29500 tools/torchrun_fit.sh recipes/imagenet/mocov3_vit_small16.yaml \
#       --data.init_args.train_dir /data/imagenet/train --data.init_args.val_dir /data/imagenet/val
#
# NNODES (default 1), NPROC processes per node (default: the GPUs torch sees, else 1), RDZV
# (default localhost:29500), JOB (rendezvous id, default ssl-vit). The recipe's trainer is told
# the same layout; the arguments after the recipe go to `ssl-vit fit` (add
# `--config recipes/trainer/ddp_cpu2.yaml` style overrides, or `--trainer.accelerator cpu`, to try it without GPUs).
set -euo pipefail
RECIPE=${1:?usage: tools/torchrun_fit.sh RECIPE [ssl-vit fit arguments...]}
shift
NNODES=${NNODES:-1}
NPROC=${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
RDZV=${RDZV:-localhost:29500}
JOB=${JOB:-ssl-vit}
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" --rdzv_backend c10d --rdzv_endpoint "$RDZV" --rdzv_id "$JOB" \
    -m ssl_vit.cli fit --config "$RECIPE" --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC" --ckpt_path auto "$@"
