"""The sbatch scripts of slurm/ on a real one-node Slurm cluster (tests/slurm_cluster.py).

Both tests submit slurm/gpt-base-vcycle2.sbatch itself, shrunk to this machine by sbatch options
and MSDS_* variables: a 3-level tiny-GPT V-cycle (recipes/test/test-vcycle-gpt.yaml) with 2 CPU workers.

1. The job runs to the end under the deepspeed launcher: COMPLETED, one run directory per job,
   every step logged once with 2 workers' worth of samples, the 4 transitions, a final loss.
2. The same run under torchrun receives the time-limit signal mid-training: the batch shell lets
   the workers checkpoint and requeues the job, and the requeued job resumes and ends with exactly
   the losses of job 1.

The tests install and start Slurm (root and package access needed) and are skipped, with the
reason, where that is impossible. About 3 minutes on 2 cores.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, running_cluster

REPO = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = REPO / "slurm" / "gpt-base-vcycle2.sbatch"
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"
WORKERS = 2
MICRO_BATCH = 4            # training.micro_batch_size of the recipe
PHASE_STEPS = [60, 60, 60, 60, 60]     # levels 1, 2, 3, 2, 1
PHASE_LEVELS = [1, 2, 3, 2, 1]
TOTAL_STEPS = sum(PHASE_STEPS)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from running_cluster(tmp_path_factory.mktemp("slurm"))


def submit(slurm: SlurmCluster, workdir: Path, corpus: Path, launcher: str, sbatch_options: list[str]) -> int:
    """Submit the GPU sbatch script with CPU-sized resources and the tiny run; returns the job id."""
    overrides = [f"data.path={corpus}", f"multilevel.phase_steps=[{','.join(map(str, PHASE_STEPS))}]",
                 "logging.eval_interval=1000", "logging.interval=60", "logging.tensorboard=false"]
    env = {"MSDS_REPO": str(REPO), "MSDS_RECIPE": str(RECIPE), "MSDS_LAUNCHER": launcher,
           "MSDS_NPROC_PER_NODE": str(WORKERS), "MSDS_OVERRIDES": " ".join(overrides)}
    # The script asks for 8 GPUs and a whole node; this node has no GPUs and few CPUs.
    resources = ["--gpus-per-node=0", f"--cpus-per-task={slurm.cpus}", "--mem=4000"]
    return slurm.sbatch([*resources, f"--chdir={workdir}", "--output=slurm-%j.out", *sbatch_options,
                         str(SBATCH_SCRIPT)], env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


def steps_logged(metrics: Path) -> int:
    """Step records in the complete lines of a metrics.jsonl that is still being written."""
    if not metrics.exists():
        return 0
    complete_lines = metrics.read_text().rpartition("\n")[0].splitlines()
    return sum('"event": "step"' in line for line in complete_lines)


def final_val_loss(records: list[dict]) -> float:
    evals = [r for r in records if r["event"] == "eval"]
    assert evals and evals[-1]["step"] == TOTAL_STEPS, "no final evaluation"
    return evals[-1]["val_loss"]


def job_log(workdir: Path, job_id: int) -> str:
    return (workdir / f"slurm-{job_id}.out").read_text()


@pytest.fixture(scope="module")
def uninterrupted_job(slurm, train_corpus, tmp_path_factory):
    """The tiny V-cycle run, start to end, under the deepspeed launcher (also test 2's reference)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    # 30 min: the script's warning (600 s before the limit) must not come during this run.
    job_id = submit(slurm, workdir, train_corpus, "deepspeed", ["--time=30"])
    info = slurm.wait_for_job(job_id, timeout=240)
    print(f"uninterrupted job: {time.monotonic() - started:.0f} s")
    return workdir, job_id, info


def test_sbatch_job_runs_the_vcycle_to_the_end(uninterrupted_job):
    workdir, job_id, info = uninterrupted_job
    log = job_log(workdir, job_id)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-3000:]}"
    assert info["Restarts"] == "0"
    assert "training finished" in log

    # One run directory per job, named after the job; the deepspeed launcher got a hostfile
    # built from the allocation.
    run_dir = workdir / "runs" / f"gpt-base-vcycle2-{job_id}"
    assert (run_dir / f"hostfile-{job_id}").read_text() == f"{info['NodeList']} slots={WORKERS}\n"

    records = read_metrics(run_dir)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, TOTAL_STEPS + 1))
    # Samples per step show that both workers trained (data parallel, world size 2).
    assert steps[-1]["consumed_samples"] == TOTAL_STEPS * MICRO_BATCH * WORKERS
    first_steps_of_phases = [sum(PHASE_STEPS[:i]) for i in range(len(PHASE_STEPS))]
    assert [steps[i]["level"] for i in first_steps_of_phases] == PHASE_LEVELS
    assert len([r for r in records if r["event"] == "transition"]) == len(PHASE_STEPS) - 1
    assert not [r for r in records if r["event"] == "resume"]
    assert math.isfinite(final_val_loss(records))
    assert [r["reason"] for r in records if r["event"] == "checkpoint"] == ["end of training"]


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm, train_corpus, uninterrupted_job, tmp_path):
    reference_dir, reference_id, reference_info = uninterrupted_job
    assert reference_info["JobState"] == "COMPLETED", "the uninterrupted reference run failed"
    reference = read_metrics(reference_dir / "runs" / f"gpt-base-vcycle2-{reference_id}")

    # The signal is the one `#SBATCH --signal=B:USR1@600` has Slurm send before the time limit, to
    # the same process (the batch shell), but sent by the test at a known step: Slurm checks time
    # limits only every 30 s, a window longer than this whole run on a fast machine.
    started = time.monotonic()
    job_id = submit(slurm, tmp_path, train_corpus, "torchrun", ["--time=30"])
    metrics = tmp_path / "runs" / f"gpt-base-vcycle2-{job_id}" / "metrics.jsonl"
    signal_at_step = TOTAL_STEPS // 3
    deadline = time.monotonic() + 180
    while steps_logged(metrics) < signal_at_step:
        assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), job_log(tmp_path, job_id)[-3000:]
        assert time.monotonic() < deadline, f"job {job_id} did not reach step {signal_at_step} in 180 s"
        time.sleep(0.2)
    slurm.signal_batch_shell(job_id, "USR1")
    info = slurm.wait_for_job(job_id, timeout=240)
    print(f"interrupted job: {time.monotonic() - started:.0f} s")
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-3000:]}"
    assert info["Restarts"] == "1"
    assert "received SIGUSR1" in log and "requeueing" in log and "training finished" in log

    # The same run directory across the requeue: one stop on the signal, one resume from it.
    records = read_metrics(tmp_path / "runs" / f"gpt-base-vcycle2-{job_id}")
    checkpoints = [r for r in records if r["event"] == "checkpoint"]
    assert [r["reason"] for r in checkpoints] == ["SIGUSR1", "end of training"]
    stopped_at = checkpoints[0]["step"]
    assert signal_at_step <= stopped_at < TOTAL_STEPS
    resumes = [r for r in records if r["event"] == "resume"]
    assert [r["step"] for r in resumes] == [stopped_at]

    # Every step ran exactly once, and the resumed run reproduces the uninterrupted one exactly.
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, TOTAL_STEPS + 1))
    assert step_losses(records) == step_losses(reference)
    assert final_val_loss(records) == final_val_loss(reference)
