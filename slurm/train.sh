#!/bin/bash
# The body every slurm/*.sbatch script runs (with `exec`, so that it stays the batch shell that
# Slurm's `--signal=B:USR1@T` reaches). Not meant to be submitted by itself.
#
# What it does, in order:
#   1. one run directory per job: runs/<job name>-<job id> (a requeued job keeps its id, so it
#      finds its own checkpoints and `checkpoint.resume: auto` continues the run);
#   2. one `srun` task per node, which starts that node's workers with torchrun (c10d rendezvous
#      at the first node) or with the deepspeed launcher (hostfile built from the allocation);
#   3. on the stop signal (default USR1, sent by Slurm before the time limit): forward it to the
#      workers, which finish their step, write a checkpoint and exit 0;
#   4. when the launcher exits 0 but the run has not finished, `scontrol requeue` this job; a
#      finished run is never requeued;
#   5. when the launcher fails because a rank's hang detector fired (training.hang_timeout_s: its
#      faulthandler stacks, which start with `Timeout (H:MM:SS)!`, are in the run directory's
#      stacks/rank-<rank>.txt), `scontrol requeue` too: the requeued job resumes from the newest
#      checkpoint;
#   6. when a rank's start-up watchdog fired (training.startup_timeout_s: no first step; its line,
#      naming what the rank waited on, and its stacks are in stacks/rank-<rank>.txt after a
#      `# msds start-up watchdog:` header), print those lines and end the job as FAILED with exit
#      status 4, not requeued: a requeued job would wait on the same lock, peer or collective.
#      Any other failure ends the job as FAILED (a crash is a bug to read, not to loop on).
#
# A node that is lost (set DOWN by slurmctld when its slurmd stops answering, or by an operator
# with `scontrol update nodename=<node> state=down`) is Slurm's to handle: it ends the job and,
# since the sbatch scripts ask for `--requeue`, requeues it; the requeued job starts on the nodes
# that are left when its node range allows (below).
#
# Coming back on fewer (or more) nodes: submit with a node range, `sbatch --nodes=MIN-MAX`, and a
# requeued job starts on whatever MIN..MAX nodes are free; msds resumes the checkpoint on the new
# data-parallel size (docs/cluster.md). The global batch must stay the same: set MSDS_GLOBAL_BATCH
# and this script derives training.grad_accum for each allocation.
#
# Settings (environment variables; the sbatch scripts set MSDS_RECIPE):
#   MSDS_RECIPE          recipe YAML, relative to the submit directory or absolute (required)
#   MSDS_OVERRIDES       extra `key=value` overrides, separated by spaces (no spaces inside a value)
#   MSDS_RUN_DIR         run directory; default runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}. Set it here,
#                        not with run_dir= in MSDS_OVERRIDES: this script reads the run's metrics.
#   MSDS_LAUNCHER        torchrun (default) or deepspeed
#   MSDS_NPROC_PER_NODE  workers per node; default: the GPUs Slurm gave this node
#   MSDS_REPO            msds checkout; default: the submit directory
#   MSDS_PYTHON          interpreter with msds installed; default $MSDS_REPO/.venv/bin/python
#   MSDS_MASTER_PORT     rendezvous port on the first node; default derived from the job id
#   MSDS_STOP_SIGNAL     the signal named in `#SBATCH --signal=B:<SIG>@T`; default USR1. It must be
#                        the workers' `training.exit_signal` (msds default SIGUSR1).
#   MSDS_MAX_REQUEUES    give up requeueing after this many restarts (default 20): a run that keeps
#                        stopping (or hanging) without finishing is a bug to look at, not to loop on.
#   MSDS_GLOBAL_BATCH    samples per optimizer step to keep whatever the node count: appends
#                        training.grad_accum = MSDS_GLOBAL_BATCH / (data-parallel size x
#                        training.micro_batch_size) for this allocation (an error if that is not a
#                        whole number). Unset: the recipe's grad_accum, whatever the node count.
set -euo pipefail

die() { echo "msds-slurm: error: $*" >&2; exit 2; }
say() { echo "msds-slurm: $(date '+%F %T') $*"; }

MSDS_STOP_SIGNAL=${MSDS_STOP_SIGNAL:-USR1}
# Trap the stop signal first thing: its default action would end this shell, and the job with it.
# It is noted here and forwarded to the workers further down, once they train.
stop_requested=0
stop_forwarded=0
note_stop_signal() {
    stop_requested=1
    say "received SIG$MSDS_STOP_SIGNAL: the workers will checkpoint and stop after their current step"
}
trap note_stop_signal "$MSDS_STOP_SIGNAL"

[ -n "${SLURM_JOB_ID:-}" ] || die "run this through sbatch (slurm/*.sbatch), not directly"
[ -n "${MSDS_RECIPE:-}" ] || die "MSDS_RECIPE is not set"

MSDS_REPO=${MSDS_REPO:-$SLURM_SUBMIT_DIR}
MSDS_PYTHON=${MSDS_PYTHON:-$MSDS_REPO/.venv/bin/python}
MSDS_LAUNCHER=${MSDS_LAUNCHER:-torchrun}
MSDS_MAX_REQUEUES=${MSDS_MAX_REQUEUES:-20}
RUN_DIR=${MSDS_RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
read -r -a EXTRA_OVERRIDES <<< "${MSDS_OVERRIDES:-}"
for override in "${EXTRA_OVERRIDES[@]}"; do
    case "$override" in run_dir=*) die "set MSDS_RUN_DIR instead of run_dir= in MSDS_OVERRIDES";; esac
done
[ -x "$MSDS_PYTHON" ] || die "no Python at $MSDS_PYTHON (set MSDS_REPO or MSDS_PYTHON)"
[ -f "$MSDS_RECIPE" ] || die "no recipe $MSDS_RECIPE (relative paths start at $(pwd))"

# Workers per node: the GPUs Slurm bound to this node (--gpus-per-node / --gres=gpu:N).
if [ -z "${MSDS_NPROC_PER_NODE:-}" ]; then
    MSDS_NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-}
    [ -n "$MSDS_NPROC_PER_NODE" ] || MSDS_NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l)
    [ "$MSDS_NPROC_PER_NODE" -gt 0 ] || die "no GPUs in this allocation; set MSDS_NPROC_PER_NODE"
fi

NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
NNODES=${#NODES[@]}
# The rendezvous host: the first node's address as Slurm reaches it (its NodeAddr, which is the
# node's name unless slurm.conf gives the node an address).
MASTER_ADDR=$(scontrol show node "${NODES[0]}" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
MASTER_ADDR=${MASTER_ADDR:-${NODES[0]}}
# A port per job: two jobs that share a node must not rendezvous with each other.
MASTER_PORT=${MSDS_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# The same global batch on any number of nodes (a requeued job may get fewer): derive the gradient
# accumulation from the recipe and overrides for this allocation's data-parallel size.
if [ -n "${MSDS_GLOBAL_BATCH:-}" ]; then
    grad_accum=$("$MSDS_PYTHON" - "$MSDS_RECIPE" "$MSDS_GLOBAL_BATCH" "$((NNODES * MSDS_NPROC_PER_NODE))" \
        "${EXTRA_OVERRIDES[@]}" <<'EOF'
import sys
from msds.config import load_run_config
recipe, global_batch, world, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
cfg = load_run_config(recipe, overrides)
model_parallel = cfg.parallel.tensor * cfg.parallel.pipeline
data = world // model_parallel
per_step = data * cfg.training.micro_batch_size
if world % model_parallel or global_batch % per_step:
    sys.exit(f"MSDS_GLOBAL_BATCH={global_batch} on {world} processes: data parallel {data} (tensor "
             f"{cfg.parallel.tensor} x pipeline {cfg.parallel.pipeline} per replica) x training.micro_batch_size "
             f"{cfg.training.micro_batch_size} = {per_step} samples per micro-step does not divide it")
print(global_batch // per_step)
EOF
    ) || die "cannot keep the global batch of MSDS_GLOBAL_BATCH=$MSDS_GLOBAL_BATCH on this allocation"
    EXTRA_OVERRIDES+=("training.grad_accum=$grad_accum")
    say "global batch $MSDS_GLOBAL_BATCH on $NNODES node(s): training.grad_accum=$grad_accum"
fi

# --- environment of the workers ----------------------------------------------------------
# One CPU thread pool per worker, sized to its share of the task's CPUs (torch would otherwise
# start one thread per core in every worker and oversubscribe the node).
cpus_per_task=${SLURM_CPUS_PER_TASK:-$MSDS_NPROC_PER_NODE}
threads_per_worker=$(( cpus_per_task / MSDS_NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads_per_worker > 0 ? threads_per_worker : 1 ))}
# NCCL (ignored on CPU, where msds uses gloo). Defaults only: a cluster's own settings win.
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a rank that dies makes the others fail instead of hanging
#     until the job's time limit.
#   NCCL_DEBUG=WARN: one line per problem in the job log; INFO to debug the network selection.
#   NCCL_SOCKET_IFNAME / NCCL_IB_HCA: set these per cluster if NCCL picks the wrong interface
#     (see docs/cluster.md); they are deliberately not guessed here.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1
export MASTER_ADDR MASTER_PORT

mkdir -p "$RUN_DIR"
TRAIN_ARGS=(-m msds.cli train --config "$MSDS_RECIPE" "${EXTRA_OVERRIDES[@]}" "run_dir=$RUN_DIR")

# --- one launcher per node -----------------------------------------------------------------
# The launcher starts with the stop signal ignored and passes that on to the workers it starts:
# Slurm delivers a forwarded signal to every process of the step, and torchrun / the deepspeed
# launcher would die of USR1 (default action) instead of waiting for their workers to
# checkpoint. msds installs its own handler in each worker, replacing the inherited "ignore".
case "$MSDS_LAUNCHER" in
torchrun)
    NODE_COMMAND=("$MSDS_PYTHON" -m torch.distributed.run
        --nnodes "$NNODES" --nproc_per_node "$MSDS_NPROC_PER_NODE"
        --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
        "${TRAIN_ARGS[@]}")
    ;;
deepspeed)
    # The deepspeed launcher reads the nodes from an MPI-style hostfile; --no_ssh makes each node's
    # launcher start only its own workers (node rank = SLURM_NODEID), so srun replaces pdsh/ssh.
    HOSTFILE="$RUN_DIR/hostfile-$SLURM_JOB_ID"
    for node in "${NODES[@]}"; do echo "$node slots=$MSDS_NPROC_PER_NODE"; done > "$HOSTFILE"
    NODE_COMMAND=("$MSDS_PYTHON" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --no_ssh
        --node_rank @SLURM_NODEID@ --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
        --module "${TRAIN_ARGS[@]:1}")
    ;;
*) die "MSDS_LAUNCHER must be torchrun or deepspeed, got $MSDS_LAUNCHER";;
esac

say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES node(s) x $MSDS_NPROC_PER_NODE worker(s), $MSDS_LAUNCHER, master $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR"

# The stop signal may come while the workers are still starting (importing, building the engine,
# loading a checkpoint). Until a worker has installed msds's handler the signal is ignored there
# and would be lost, so it is forwarded only once this start of the run has logged a training
# step: every rank installs the handler before its first step.
METRICS="$RUN_DIR/metrics.jsonl"
metrics_lines_at_launch=$( [ -f "$METRICS" ] && wc -l < "$METRICS" || echo 0 )
workers_are_training() {
    [ -f "$METRICS" ] && [ "$(wc -l < "$METRICS")" -gt "$metrics_lines_at_launch" ] &&
        tail -n 1 "$METRICS" | grep -q '"event": "step"'
}

# A rank's hang detector writes its stacks to $RUN_DIR/stacks/rank-<rank>.txt, after a header line
# that each launch writes (msds/train/guards.py, HangWatchdog): this launch hung if a file written
# since the launch has a `Timeout (H:MM:SS)!` line after its last header. The launch's mark is on
# the run directory's filesystem, whose clock stamps the stacks files of every node.
LAUNCH_MARK="$RUN_DIR/.launch-$SLURM_JOB_ID"
touch "$LAUNCH_MARK"
trap 'rm -f "$LAUNCH_MARK"' EXIT
workers_hung() {
    [ -d "$RUN_DIR/stacks" ] || return 1
    local file
    while IFS= read -r file; do
        awk '/^# msds hang watchdog:/ { hung = 0 } /^Timeout \([0-9:]+\)!$/ { hung = 1 }
             END { exit !hung }' "$file" && return 0
    done < <(find "$RUN_DIR/stacks" -name 'rank-*.txt' -newer "$LAUNCH_MARK")
    return 1
}
# This launch's start-up watchdog fired if a stacks file written since the launch has a
# `# msds start-up watchdog:` header after its last hang watchdog header; prints the line after it.
workers_never_started() {
    [ -d "$RUN_DIR/stacks" ] || return 1
    local file found=1
    while IFS= read -r file; do
        awk '/^# msds hang watchdog:/ { line = "" } /^# msds start-up watchdog:/ { getline line }
             END { if (line == "") exit 1; print line }' "$file" && found=0
    done < <(find "$RUN_DIR/stacks" -name 'rank-*.txt' -newer "$LAUNCH_MARK")
    return $found
}
requeue() {
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$MSDS_MAX_REQUEUES" ]; then
        say "$1, but already restarted $SLURM_RESTART_COUNT times (MSDS_MAX_REQUEUES); not requeueing"
        exit 3
    fi
    say "$1; requeueing job $SLURM_JOB_ID to resume from $RUN_DIR"
    scontrol requeue "$SLURM_JOB_ID"
}

# Each task replaces @SLURM_NODEID@ with its own node rank (the deepspeed launcher needs it).
# srun gets the CPUs per task explicitly: since Slurm 22.05 it no longer inherits them from sbatch.
srun --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="$cpus_per_task" --kill-on-bad-exit=1 \
    bash -c "trap '' $MSDS_STOP_SIGNAL; "'exec "${@//@SLURM_NODEID@/$SLURM_NODEID}"' node-launcher "${NODE_COMMAND[@]}" &
launcher_pid=$!
# Poll in short sleeps rather than `wait` on srun: a trapped signal interrupts `wait`, and this
# way the exit status of srun is never lost to such an interruption.
while kill -0 "$launcher_pid" 2>/dev/null; do
    if [ "$stop_requested" = 1 ] && [ "$stop_forwarded" = 0 ] && workers_are_training; then
        # srun passes the signal on to every process of its step on every node.
        kill -s "$MSDS_STOP_SIGNAL" "$launcher_pid" 2>/dev/null || true
        stop_forwarded=1
        say "forwarded SIG$MSDS_STOP_SIGNAL to the workers"
    fi
    sleep 1 & wait $! || true
done
set +e
wait "$launcher_pid"
launcher_status=$?
set -e

# --- finished, stopped, or failed? -----------------------------------------------------------
if [ "$launcher_status" -ne 0 ]; then
    if workers_never_started; then
        say "a rank did not reach its first step within training.startup_timeout_s (its line above; stacks in $RUN_DIR/stacks); not requeueing"
        exit 4
    fi
    if workers_hung; then
        requeue "a rank hung (no step within training.hang_timeout_s; its stacks are in $RUN_DIR/stacks)"
        exit 0
    fi
    say "training failed (exit status $launcher_status); not requeueing"
    exit "$launcher_status"
fi
# Finished or stopped early? msds writes a checkpoint at the end of training and one when it stops
# early; metrics.jsonl records each with its reason.
run_outcome=$("$MSDS_PYTHON" - "$RUN_DIR/metrics.jsonl" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
reasons = [r.get("reason") for r in records if r.get("event") == "checkpoint"]
print("finished" if reasons and reasons[-1] == "end of training" else "stopped")
EOF
) || die "cannot read $RUN_DIR/metrics.jsonl"
if [ "$run_outcome" = finished ]; then
    say "training finished; run dir $RUN_DIR"
    exit 0
fi
requeue "stopped before the end (stop signal forwarded: $stop_forwarded)"
