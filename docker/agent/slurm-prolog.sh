#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/clusterdx.sh), run as root on each node before a job.
# The agent is a node service, not a per-job process: make sure it runs, and make the directory the jobs' NCCL logs
# go to. Never fail the job because of monitoring: every step here ends in `|| true`.
systemctl is-active --quiet clusterdx-agent || systemctl start clusterdx-agent || true
install -d -m 1777 /var/log/nccl || true
# The probe peers (agent.toml: peers_file): this job's nodes, the paths its collectives use. `scontrol show
# hostnames` expands the list locally without asking slurmctld. Written whole then renamed: the agent re-reads it.
if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ -d /etc/clusterdx ]; then
  scontrol show hostnames "$SLURM_JOB_NODELIST" > /etc/clusterdx/peers.new 2>/dev/null \
    && mv -f /etc/clusterdx/peers.new /etc/clusterdx/peers || rm -f /etc/clusterdx/peers.new
fi
exit 0
