#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/clusterdx-task-prolog.sh), run as the job's user before each
# task. Lines "export NAME=value" printed here are added to the task's environment. Each process writes its own
# NCCL log (%h = host, %p = pid), which the agent's nccl source tails. A job that sets these itself keeps its own.
if [ -z "${NCCL_DEBUG_FILE:-}" ]; then
  echo "export NCCL_DEBUG_FILE=/var/log/nccl/nccl.%h.%p.log"
  # INFO with INIT,NET shows the transport chosen (IB, or the socket fallback) without per-collective chatter.
  [ -z "${NCCL_DEBUG:-}" ] && echo "export NCCL_DEBUG=INFO"
  [ -z "${NCCL_DEBUG_SUBSYS:-}" ] && echo "export NCCL_DEBUG_SUBSYS=INIT,NET"
fi
exit 0
