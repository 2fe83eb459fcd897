"""Two Slurm nodes on one machine (tests/slurm_cluster.py: two slurmd, `slurmd -N node1/node2`,
one CPU each) and the faults a job meets there (issue 60; docs/cluster.md, "Faults and what they
cost"), through the real slurm/gpt-base-vcycle2.sbatch and slurm/train.sh with torchrun:

1. Two one-node jobs at once, one per node, of a tiny 3-level GPT V-cycle with
   MSDS_GLOBAL_BATCH=8 (one worker, micro-batch 4, so training.grad_accum=2):
   - the reference, start to end;
   - the same run with one rank hanging before a step mid-run (MSDS_FAULT): its hang detector
     (training.hang_timeout_s) ends it, slurm/train.sh recognises the hang and requeues the job,
     which resumes and ends with exactly the reference's losses.
2. The same run submitted with `--nodes=1-2`: it starts on both nodes (grad_accum=1, torchrun's
   c10d rendezvous at node1), node2 is lost after a checkpoint (it stops answering and is set
   DOWN; Slurm ends and requeues the job), the requeued job comes back on node1 alone
   (grad_accum=2), resumes the two-node checkpoint on one process and ends with the reference's
   losses within 1e-5 (data parallel 2 x 1 and 1 x 2 sum the same gradients in another order).

Needs root and package access (Slurm is installed and started as in tests/test_slurm.py); skipped,
with the reason, where Slurm cannot run. 3.5-5.5 minutes on 2 busy cores.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from msds.train.metrics import read_metrics
from slurm_cluster import SlurmCluster, running_cluster

REPO = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = REPO / "slurm" / "gpt-base-vcycle2.sbatch"
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"
MICRO_BATCH = 4                # training.micro_batch_size of the recipe
GLOBAL_BATCH = 2 * MICRO_BATCH  # two nodes x one worker, or one worker accumulating two micro-batches
PHASE_STEPS = [10, 10, 10, 10, 10]
TOTAL_STEPS = sum(PHASE_STEPS)
CHECKPOINT_INTERVAL = 5
# The hanging job: rank 0 hangs before its 28th step (the newest checkpoint: 25, in the bottom
# phase); the requeued job resumes at 25 and, its call count started afresh, would hang only at
# step 53, past the end.
HANG_AT = 28
HANG_TIMEOUT_S = 30     # a transition or checkpoint write on a loaded machine takes far less
LOSE_NODE_AFTER = 15           # node2 is lost once the two-node run has a checkpoint at or past this step
TOLERANCE = 1e-5               # as tests/test_relayout.py: float reassociation across data-parallel sizes


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from running_cluster(tmp_path_factory.mktemp("slurm2"), nodes=2)


def submit(slurm: SlurmCluster, workdir: Path, corpus: Path, nodes: str, extra_env: dict | None = None,
           overrides: tuple[str, ...] = ()) -> int:
    """The GPU sbatch script on one CPU worker per node with the same global batch on any node count."""
    overrides = [f"data.path={corpus}", f"multilevel.phase_steps=[{','.join(map(str, PHASE_STEPS))}]",
                 "model.hidden_dropout=0.0", "model.attention_dropout=0.0",   # draws differ across layouts
                 f"checkpoint.interval={CHECKPOINT_INTERVAL}", "logging.eval_interval=1000",
                 "logging.interval=10", "logging.eval_batches=1", "logging.tensorboard=false", *overrides]
    env = {"MSDS_REPO": str(REPO), "MSDS_RECIPE": str(RECIPE), "MSDS_LAUNCHER": "torchrun",
           "MSDS_NPROC_PER_NODE": "1", "MSDS_GLOBAL_BATCH": str(GLOBAL_BATCH),
           "MSDS_OVERRIDES": " ".join(overrides), **(extra_env or {})}
    resources = [f"--nodes={nodes}", "--gpus-per-node=0", f"--cpus-per-task={slurm.cpus}", "--mem=3000"]
    return slurm.sbatch([*resources, "--time=30", f"--chdir={workdir}", "--output=slurm-%j.out",
                         str(SBATCH_SCRIPT)], env=env)


def run_dir(workdir: Path, job_id: int) -> Path:
    return workdir / "runs" / f"gpt-base-vcycle2-{job_id}"


def job_log(workdir: Path, job_id: int) -> str:
    return (workdir / f"slurm-{job_id}.out").read_text()


def checkpoints_logged(metrics: Path) -> list[int]:
    """Steps of the checkpoint records in the complete lines of a metrics.jsonl being written."""
    if not metrics.exists():
        return []
    lines = metrics.read_text().rpartition("\n")[0].splitlines()
    return [json.loads(line)["step"] for line in lines if '"event": "checkpoint"' in line]


def step_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run, "step")}


def final_val_loss(run: Path) -> float:
    evals = read_metrics(run, "eval")
    assert evals and evals[-1]["step"] == TOTAL_STEPS, "no final evaluation"
    return evals[-1]["val_loss"]


def wait_for_idle_nodes(slurm: SlurmCluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while slurm.node_states() != ["idle"] * len(slurm.nodes):
        assert time.monotonic() < deadline, f"nodes not idle after {timeout} s: {slurm.node_states()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def one_node_jobs(slurm, train_corpus, tmp_path_factory):
    """The reference and the hanging job, side by side, one on each node."""
    workdir = tmp_path_factory.mktemp("one-node")
    started = time.monotonic()
    reference = submit(slurm, workdir, train_corpus, "1")
    hanging = submit(slurm, workdir, train_corpus, "1", {"MSDS_FAULT": f"hang-before-step:0:{HANG_AT}"},
                     (f"training.hang_timeout_s={HANG_TIMEOUT_S}",))
    infos = {job: slurm.wait_for_job(job, timeout=420) for job in (reference, hanging)}
    print(f"one-node jobs: {time.monotonic() - started:.0f} s")
    return workdir, reference, hanging, infos


def test_a_hung_rank_is_requeued_and_resumes_exactly(one_node_jobs):
    workdir, reference, hanging, infos = one_node_jobs
    assert infos[reference]["JobState"] == "COMPLETED", job_log(workdir, reference)[-3000:]
    assert infos[reference]["Restarts"] == "0"
    assert not (run_dir(workdir, reference) / "stacks").exists()   # a run that never hung leaves no stacks
    log = job_log(workdir, hanging)
    assert infos[hanging]["JobState"] == "COMPLETED", f"{infos[hanging]}\n{log[-3000:]}"
    assert infos[hanging]["Restarts"] == "1"
    assert "a rank hung" in log and "requeueing" in log and "training finished" in log
    assert log.count(f"global batch {GLOBAL_BATCH} on 1 node(s): training.grad_accum=2") == 2

    run = run_dir(workdir, hanging)
    assert f"Timeout (0:00:{HANG_TIMEOUT_S})!" in (run / "stacks" / "rank-0.txt").read_text()
    resumes = read_metrics(run, "resume")
    assert [r["step"] for r in resumes] == [HANG_AT - HANG_AT % CHECKPOINT_INTERVAL]
    assert list(step_losses(run)) == list(range(1, TOTAL_STEPS + 1))
    # Same layout, same steps: the resumed run is the reference, bit for bit.
    assert step_losses(run) == step_losses(run_dir(workdir, reference))
    assert final_val_loss(run) == final_val_loss(run_dir(workdir, reference))


def test_two_node_job_loses_a_node_and_finishes_on_one(slurm, train_corpus, one_node_jobs, tmp_path):
    reference_dir, reference, _, infos = one_node_jobs
    assert infos[reference]["JobState"] == "COMPLETED", "the one-node reference run failed"
    reference_run = run_dir(reference_dir, reference)

    wait_for_idle_nodes(slurm)   # a node still completing the last job would make --nodes=1-2 start on 1
    started = time.monotonic()
    job_id = submit(slurm, tmp_path, train_corpus, "1-2")
    metrics = run_dir(tmp_path, job_id) / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not [s for s in checkpoints_logged(metrics) if s >= LOSE_NODE_AFTER]:
        assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), job_log(tmp_path, job_id)[-3000:]
        assert time.monotonic() < deadline, f"job {job_id} has no checkpoint past step {LOSE_NODE_AFTER} in 240 s"
        time.sleep(0.2)
    nodes = slurm.hostnames(slurm.job(job_id)["NodeList"])
    assert nodes == slurm.nodes, f"the job started on {nodes}, not on both nodes"
    lost_at = max(checkpoints_logged(metrics))
    slurm.lose_node(nodes[1], job_id)
    info = slurm.wait_for_job(job_id, timeout=300)
    print(f"two-node job with a lost node: {time.monotonic() - started:.0f} s")
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-3000:]}"
    assert info["Restarts"] == "1"
    assert info["NodeList"] == nodes[0]
    assert slurm.node_states()[1].startswith("down"), slurm.node_states()
    # The first start on two nodes, the requeued one on one, each with the global batch kept.
    assert f"global batch {GLOBAL_BATCH} on 2 node(s): training.grad_accum=1" in log
    assert f"global batch {GLOBAL_BATCH} on 1 node(s): training.grad_accum=2" in log
    assert "DUE TO NODE FAILURE" in log and "training finished" in log

    run = run_dir(tmp_path, job_id)
    resumes = read_metrics(run, "resume")
    assert len(resumes) == 1 and lost_at <= resumes[0]["step"] < TOTAL_STEPS, resumes
    steps = read_metrics(run, "step")
    assert [r["step"] for r in steps] == list(range(1, TOTAL_STEPS + 1))
    assert steps[-1]["consumed_samples"] == TOTAL_STEPS * GLOBAL_BATCH
    # Two nodes up to the checkpoint, one after it: every step's loss is the one-node run's.
    losses, expected = step_losses(run), step_losses(reference_run)
    worst = max(abs(losses[s] - expected[s]) for s in expected)
    assert worst < TOLERANCE, f"largest loss difference {worst:.3g} (step losses {losses} vs {expected})"
    assert math.isclose(final_val_loss(run), final_val_loss(reference_run), rel_tol=0, abs_tol=TOLERANCE)
