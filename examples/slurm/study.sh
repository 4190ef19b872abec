#!/usr/bin/env bash
# The claims study on a Slurm cluster: one sbatch job per run (submitit), one GPU each, 4 hours per
# job; a job near its limit checkpoints and requeues itself. Run it on a login node, in tmux/screen:
# it waits for the jobs and writes the report. Stopped (Ctrl-C, logout), the jobs keep running; the
# same command with --resume waits for them (runs/study-claims-gpu-1/*/jobs.json lists them).
set -euo pipefail
keel study claims --scale gpu-1 --executor slurm \
  --slurm partition="${PARTITION:-gpu}" --slurm account="${ACCOUNT:-$USER}" --slurm time=240 \
  --gpus-per-run 1 "$@"
# the report while jobs are still queued: keel study claims --scale gpu-1 --report-only
