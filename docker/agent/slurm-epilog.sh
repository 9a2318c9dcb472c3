#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/clusterdx.sh), run as root on each node after a job.
# The agent keeps running between jobs (it also watches idle GPUs). Only old NCCL logs are cleaned up: the agent
# reads a file to its end even after it is deleted, so an hour of grace is plenty.
find /var/log/nccl -maxdepth 1 -name 'nccl.*.log' -mmin +60 -delete 2>/dev/null || true
exit 0
