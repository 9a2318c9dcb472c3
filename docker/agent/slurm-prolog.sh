#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/clusterdx.sh), run as root on each node before a job.
# The agent is a node service, not a per-job process: make sure it runs, and make the directory the jobs' NCCL logs
# go to. Never fail the job because of monitoring: every step here ends in `|| true`.
systemctl is-active --quiet clusterdx-agent || systemctl start clusterdx-agent || true
install -d -m 1777 /var/log/nccl || true
exit 0
