#!/usr/bin/env bash
# A real single-node Slurm on this machine (Debian's slurm-wlm and munge), and a tiny keel study
# through `--executor slurm` end to end, with one job preempted (SIGUSR2, as Slurm sends it before a
# time limit) that checkpoints, requeues itself and resumes. Run as root on a throwaway machine:
#
#   apt-get install -y slurm-wlm munge      # once
#   examples/slurm/local_slurm.sh [WORKDIR] # default /tmp/keel-slurm
#
# It writes its own slurm.conf under WORKDIR (SLURM_CONF points there; /etc/slurm is not touched),
# starts munged (unless it runs already), slurmctld and slurmd, runs the study as one job array with a
# cap of 1 (printing squeue while it runs, then the job ledger), the preempted run and train.sbatch, and
# stops the daemons it started. No accounting database: keel asks squeue when sacct has nothing to say.
# WORKDIR must be new, empty, or a folder this script made (it holds .keel-local-slurm): it is emptied.
# Every wait has a time limit (it names what it waited for).
set -euo pipefail
W=${1:-/tmp/keel-slurm}
KEEL=${KEEL:-$(command -v keel || echo .venv/bin/keel)}
HOST=$(hostname)
CPUS=$(nproc)
MARK=.keel-local-slurm
if [ -e "$W" ] && [ ! -e "$W/$MARK" ] && [ -n "$(ls -A "$W" 2>/dev/null || echo file)" ]; then
  echo "local_slurm.sh: $W is not empty and was not made by this script; give a new or empty folder" >&2
  exit 2
fi
rm -rf "$W" && mkdir -p "$W"/{state,spool,log} /run/munge /var/log/munge && touch "$W/$MARK"
wait_for() {  # wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds; past SECONDS, stop naming WHAT
  local limit=$1 what=$2 end=$((SECONDS + $1)); shift 2
  until "$@"; do
    if [ "$SECONDS" -ge "$end" ]; then echo "local_slurm.sh: gave up after $limit s waiting for $what" >&2; exit 1; fi
    sleep 0.2
  done
}
lines_at_least() { [ -f "$1" ] && [ "$(wc -l < "$1")" -ge "$2" ]; }
cat > "$W/slurm.conf" <<CONF
ClusterName=keel
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
ReturnToService=2
MpiDefault=none
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$W/slurm.conf
MUNGED=""
stop() {
  pkill -F "$W/slurmd.pid" 2>/dev/null || true; pkill -F "$W/slurmctld.pid" 2>/dev/null || true
  if [ -n "$MUNGED" ]; then pkill -F "$MUNGED" 2>/dev/null || true; fi  # only a munged this script started
}
trap stop EXIT
if ! pgrep -x munged >/dev/null; then munged --force --pid-file="$W/munged.pid"; MUNGED=$W/munged.pid; fi
slurmctld && slurmd
node_idle() { sinfo -h -o %T | grep -q idle; }
wait_for 60 "the node to be idle (sinfo)" node_idle
sinfo

# 1. a tiny study (the claims study's showcase group: keel, pre_ln, post_ln at 16 sub-layers) as one
#    job array of at most 1 run at a time (--workers 1); --slurm gpus=0: this node has no GPU; cpus=1: each
#    job's threads come from its allocation
"$KEEL" study claims --scale tiny --groups showcase --out "$W/study" --executor slurm --workers 1 \
  --slurm partition=debug --slurm time=30 --slurm gpus=0 --slurm cpus=1 &
STUDY=$!
wait_for 300 "the study's job ledger" test -s "$W/study/showcase/jobs.json"
echo "--- squeue while the array runs (each change)"
LAST=""
array_done() {
  local now; now=$(squeue -h -r -o "%i %j %T" | sort)
  if [ -n "$now" ] && [ "$now" != "$LAST" ]; then echo "$now" | sed 's/^/  /'; echo "  --"; fi
  LAST=$now
  [ -z "$now" ]
}
wait_for 900 "the study's job array" array_done
wait $STUDY
echo "--- ledger"; cat "$W/study/showcase/jobs.json"; echo

# 2. a longer run, preempted mid-training: SIGUSR2 to its job (what Slurm sends `time` - 90 s before
#    the end, as submitit asks), then the job requeues itself and resumes from the checkpoint
"$KEEL" sweep --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=1 \
  --set model.d_ff=64 --set train.steps=300 --set train.batch_size=4 --set train.seq_len=32 \
  --set train.eval_every=100 --set train.checkpoint_every=1000 --set train.progress=false \
  --grid train.seed=0 --out "$W/preempt" --executor slurm --slurm partition=debug --slurm time=30 \
  --slurm gpus=0 --threads 1 &
SWEEP=$!
wait_for 300 "20 steps of the run to preempt" lines_at_least "$W/preempt/seed0/metrics.jsonl" 20
JOB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['jobs']['seed0']['job_id'])" "$W/preempt/jobs.json")
scancel --signal=USR2 "$JOB"
wait $SWEEP
echo "--- preempted run: its log and submitit's lines"
grep -E "SIGUSR2|resum|^---" "$W/preempt/seed0/run.log"
grep -hE "Caught signal|checkpoint|Requeued|completed" "$W"/preempt/submitit/*_log.out
cat "$W/preempt/jobs.json"; echo

# 3. the same run uninterrupted (local executor): the preempted run's losses must equal its losses
"$KEEL" sweep --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=1 \
  --set model.d_ff=64 --set train.steps=300 --set train.batch_size=4 --set train.seq_len=32 \
  --set train.eval_every=100 --set train.checkpoint_every=1000 --set train.progress=false \
  --grid train.seed=0 --out "$W/plain" --workers 1 --threads 1 > /dev/null
python3 - "$W" <<'PY'
import json, sys
def losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(run + "/metrics.jsonl")) if "loss" in r]
a, b = losses(sys.argv[1] + "/preempt/seed0"), losses(sys.argv[1] + "/plain/seed0")
print(f"--- preempted vs uninterrupted: {len(a)} and {len(b)} steps, losses equal: {a == b}")
sys.exit(0 if a == b else 1)
PY

# 4. examples/slurm/train.sbatch (one keel train, 2 Slurm tasks = 2 CPU workers, FSDP on gloo):
#    USR1 to the batch script, as Slurm sends it 120 s before the limit: the workers checkpoint, the
#    script requeues the job, and the requeued job resumes the run to its end
PY=$(dirname "$(readlink -f "$KEEL")")/python
JOB=$(sbatch --parsable --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 --time=20 --chdir="$PWD" \
  --output="$W/train-%j.out" --export=ALL,CONFIG=demo,RUN="$W/train",KEEL_PYTHON="$PY" examples/slurm/train.sbatch \
  --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=1 \
  --set model.d_ff=64 --set train.steps=300 --set train.batch_size=4 --set train.seq_len=32 \
  --set train.eval_every=100 --set train.checkpoint_every=1000 --set train.progress=false)
wait_for 300 "20 steps of train.sbatch's run" lines_at_least "$W/train/metrics.jsonl" 20
scancel --batch --signal=USR1 "$JOB"
job_gone() { ! squeue -h -j "$JOB" 2>/dev/null | grep -q .; }
wait_for 600 "train.sbatch's job $JOB to end" job_gone
echo "--- train.sbatch, job $JOB"
grep -hE "keel-train:|^keel: |resuming|restarting|received" "$W/train-$JOB.out"
python3 - "$W/train" <<'PY'
import json, sys
steps = [r["step"] for r in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")) if "loss" in r]
print(f"--- train.sbatch run: steps {steps[0]}..{steps[-1]}, each once: {steps == list(range(1, 301))}")
PY
grep -q "resuming $W/train from step" "$W/train-$JOB.out" || { echo "--- the requeued job did not resume"; exit 1; }
