"""Faults a cluster throws at a run (issue 60; docs/cluster.md, "Faults and what they cost"), each
made real: SIGKILL of one rank or of the whole job inside transitions and checkpoint writes, a rank
that hangs, torn and corrupt checkpoints, a full disk, NaN and spiking losses. The kills and hangs
come from msds/train/faults.py's fault points (MSDS_FAULT), the only thing a test chooses is where.

The one-process faults run in this process; the two-process ones are one chain of `torchrun ...
msds.cli train` launches of the same command, each stopped by the next fault, the last one
finishing; the first launch also runs the uninterrupted reference."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from msds.bench import kills as kill_campaign
from msds.config import load_run_config
from msds.errors import MsdsError
from msds.train import checkpointing, faults
from msds.train.guards import HangWatchdog
from msds.train.loop import train
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"


def tiny_cfg(corpus, run_dir, *overrides):
    return load_run_config(RECIPE, [f"data.path={corpus}", f"run_dir={run_dir}", "logging.tensorboard=false",
                                    "logging.eval_batches=1", *overrides])


def fault(monkeypatch, spec: str | None) -> None:
    """Set MSDS_FAULT for the runs that follow in this process, its call counts started afresh."""
    faults._calls.clear()
    if spec:
        monkeypatch.setenv(faults.ENV, spec)
    else:
        monkeypatch.delenv(faults.ENV, raising=False)


def tensors_of(value, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint structure, by its path."""
    if torch.is_tensor(value):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {path: t for key, item in items for path, t in tensors_of(item, f"{prefix}/{key}").items()}


def training_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The weights and optimizer state (fp32 partitions, Adam's moments and step) of a checkpoint."""
    return {f"{path.name}{key}": t for path in sorted(tag_dir.glob("*_states.pt"))
            for key, t in tensors_of(checkpointing.safe_load(path)).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def losses(run_dir: Path) -> dict[int, str]:
    return {r["step"]: repr(r["loss"]) for r in read_metrics(run_dir, "step")}   # repr: NaN == NaN


# -- bad steps ------------------------------------------------------------------------------

BAD_STEPS = ["multilevel.enabled=false", "training.steps=10", "checkpoint.interval=1", "checkpoint.keep=20",
             "checkpoint.layout_free=false", "training.max_bad_steps=2", "training.spike_factor=3",
             "training.spike_window=2"]
# A NaN loss at step 3, a spike (x1000) at step 5, NaN from step 7 on: two in a row stop the run at 8.
POISON = "nan-loss::3,spike-loss::5,nan-loss::7+"


@pytest.mark.parametrize("stage", [1, 3])
def test_bad_steps_are_skipped_counted_and_stop_the_run(train_corpus, tmp_path, monkeypatch, stage):
    run_dir = tmp_path / "run"
    fault(monkeypatch, POISON)
    with pytest.raises(MsdsError, match=r"^training\.max_bad_steps: 2 bad steps in a row up to step 8 "):
        train(tiny_cfg(train_corpus, run_dir, *BAD_STEPS, f"training.zero_stage={stage}"))
    bad = read_metrics(run_dir, "bad_step")
    assert [r["step"] for r in bad] == [3, 5, 7, 8]
    assert [r["reason"].split(" ")[0:2] for r in bad] == [["loss", "nan"], ["loss", bad[1]["reason"].split()[1]],
                                                         ["loss", "nan"], ["loss", "nan"]]
    assert "above training.spike_factor 3.0" in bad[1]["reason"]
    assert [r["bad_steps"] for r in read_metrics(run_dir, "step")] == [0, 0, 1, 1, 2, 2, 3, 4]
    checkpoints = read_metrics(run_dir, "checkpoint")
    assert checkpoints[-1]["step"] == 8 and checkpoints[-1]["reason"] == "bad steps"

    # A skipped step leaves the weights, Adam's moments and its step count exactly as they were;
    # an applied one changes them.
    state = {step: training_state(run_dir / "checkpoints" / checkpointing.tag_for(step)) for step in range(2, 9)}
    for skipped in (3, 5, 7, 8):
        assert same(state[skipped - 1], state[skipped]), f"step {skipped} changed the training state"
    for applied in (4, 6):
        assert not same(state[applied - 1], state[applied]), f"step {applied} changed nothing"


def test_pipeline_skips_bad_steps(two_process_results):
    """Two pipeline stages (tests/dist/train_checks.py, PIPELINE_BAD_STEPS): NaN losses at steps 3,
    6 and 7 are skipped before the update that DeepSpeed's pipeline engine makes inside
    train_batch, counted, and two in a row stop the run; every stage's checkpoint after a skipped
    step holds the same weights and optimizer state as the one before."""
    result = two_process_results["gpt-pp2-bad-steps"]
    run_dir = Path(result["run_dir"])
    assert result["stopped"] and result["stopped"].startswith("training.max_bad_steps: 2 bad steps in a row up to step 7 ")
    assert [r["step"] for r in read_metrics(run_dir, "bad_step")] == [3, 6, 7]
    assert [r["bad_steps"] for r in read_metrics(run_dir, "step")] == [0, 0, 1, 1, 1, 2, 3]
    state = {step: training_state(run_dir / "checkpoints" / checkpointing.tag_for(step)) for step in range(2, 8)}
    assert any(name.startswith("layer_") for name in state[2]), sorted(state[2])   # both stages' files
    for skipped in (3, 6, 7):
        assert same(state[skipped - 1], state[skipped]), f"step {skipped} changed the training state"
    for applied in (4, 5):
        assert not same(state[applied - 1], state[applied]), f"step {applied} changed nothing"


def test_resume_after_skipped_steps_is_exact(train_corpus, tmp_path, monkeypatch):
    """The same poisoned run, stopped after step 4 and resumed: the spike at step 5 is judged against
    the losses the checkpoint kept, and every loss and skip is the uninterrupted run's."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    fault(monkeypatch, POISON)
    with pytest.raises(MsdsError):
        train(tiny_cfg(train_corpus, reference, *BAD_STEPS))
    fault(monkeypatch, "nan-loss::3")
    train(tiny_cfg(train_corpus, resumed, *BAD_STEPS, "training.exit_after_steps=4"))
    fault(monkeypatch, "spike-loss::1,nan-loss::3+")     # the calls count from the resume: step 5 is call 1
    with pytest.raises(MsdsError, match="up to step 8"):
        train(tiny_cfg(train_corpus, resumed, *BAD_STEPS))
    assert read_metrics(resumed, "resume")[0]["step"] == 4
    assert losses(resumed) == losses(reference)
    assert [r["step"] for r in read_metrics(resumed, "bad_step")] == [3, 5, 7, 8]


def test_a_rerun_after_a_kill_before_any_checkpoint_reports_only_itself(train_corpus, tmp_path):
    """A run killed before its first checkpoint leaves a metrics.jsonl and nothing to resume; the
    rerun starts from step 0, and what reports read (read_metrics) is the rerun's alone, equal to
    a clean run's, not the abandoned attempt's steps followed by the rerun's."""
    base = ["multilevel.enabled=false", "training.steps=6", "checkpoint.layout_free=false"]
    clean, rerun = tmp_path / "clean", tmp_path / "rerun"
    train(tiny_cfg(train_corpus, clean, *base))
    train(tiny_cfg(train_corpus, rerun, *base, "optimizer.lr=0.05"))    # the abandoned attempt
    shutil.rmtree(rerun / "checkpoints")                                # killed before it had one
    train(tiny_cfg(train_corpus, rerun, *base))
    assert len(read_metrics(rerun, "start")) == 1
    assert losses(rerun) == losses(clean)
    assert [r["val_loss"] for r in read_metrics(rerun, "eval")] == [r["val_loss"] for r in read_metrics(clean, "eval")]


# -- torn and corrupt checkpoints, a full disk -------------------------------------------------

def test_flipped_byte_in_a_checkpoint_falls_back_to_the_previous(train_corpus, tmp_path, capsys):
    base = ["multilevel.enabled=false", "training.steps=6", "checkpoint.interval=2", "checkpoint.layout_free=false"]
    train(tiny_cfg(train_corpus, tmp_path / "run", *base, "training.exit_after_steps=4"))
    victim = tmp_path / "run" / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01          # one bit, the size unchanged
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    summary = train(tiny_cfg(train_corpus, tmp_path / "run", *base))
    out = capsys.readouterr().out
    assert "step00000004 skipped: mp_rank_00_model_states.pt is truncated or altered" in out
    assert read_metrics(tmp_path / "run", "resume")[-1]["step"] == 2
    assert summary.state.step == 6


@pytest.fixture
def small_filesystem(tmp_path):
    """A 6 MiB tmpfs mounted at tmp_path/small (root needed; the test is skipped without it)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a size-limited tmpfs needs root and mount(8)")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)   # lazy: the trainer may still hold a file


def test_disk_full_while_checkpointing_stops_cleanly_and_resumes(train_corpus, tmp_path, small_filesystem):
    """A checkpoint takes about 4.5 MiB of the 6 MiB: the first fits, the second does not."""
    ckpts = small_filesystem / "checkpoints"
    args = ["multilevel.enabled=false", "training.steps=6", "checkpoint.interval=2", "checkpoint.keep=1",
            "checkpoint.layout_free=false", f"checkpoint.dir={ckpts}"]
    with pytest.raises(MsdsError) as failure:
        train(tiny_cfg(train_corpus, tmp_path / "run", *args))
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {ckpts / 'step00000004'}: no space left on the device of {ckpts}")
    assert "the newest complete one, step00000002, is intact" in message
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000002"]
    assert checkpointing.verify(ckpts / "step00000002") is None
    first = losses(tmp_path / "run")

    # Space freed (the filesystem grown), the same command resumes from step 2 and finishes.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_filesystem)], check=True)
    summary = train(tiny_cfg(train_corpus, tmp_path / "run", *args))
    assert read_metrics(tmp_path / "run", "resume")[-1]["step"] == 2
    assert summary.state.step == 6
    again = losses(tmp_path / "run")
    assert {step: again[step] for step in first} == first


def test_hang_watchdog_writes_its_rank_file_and_a_clean_exit_leaves_it(tmp_path):
    """The watchdog's file contract (slurm/train.sh reads it): a launch that hangs appends its
    header and stacks and exits 1; a later launch that ends normally leaves the file as it was."""
    stacks = tmp_path / "stacks" / "rank-3.txt"
    script = ("import sys, time; from pathlib import Path; from msds.train.guards import HangWatchdog\n"
              "with HangWatchdog(0.5, Path(sys.argv[1]).parents[1], 3):\n"
              "    time.sleep(float(sys.argv[2]))\n")
    hung = subprocess.run([sys.executable, "-c", script, str(stacks), "30"], capture_output=True, text=True)
    assert hung.returncode == 1, hung.stderr
    text = stacks.read_text()
    assert text.startswith(f"{HangWatchdog.HEADER} rank 3,") and "Timeout (0:00:00.500000)!" in text, text
    assert re.search(r'File "<string>", line 3 in <module>', text), text
    assert "Timeout" not in hung.stderr
    clean = subprocess.run([sys.executable, "-c", script, str(stacks), "0"], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    assert stacks.read_text() == text
    stacks.unlink()
    subprocess.run([sys.executable, "-c", script, str(stacks), "0"], check=True)
    assert not stacks.parent.exists()


# -- killed and hung ranks: one chain of two-process launches -----------------------------------

# A V-cycle of 12 steps (phases of 2, 2, 4, 2, 2: down transitions after steps 2 and 4, up after 8
# and 10), ZeRO 2 with the recipe's dropout, checkpoints every 2 steps and at transitions.
CHAIN = ["multilevel.phase_steps=[2,2,4,2,2]", "logging.eval_batches=1", "logging.eval_interval=1000",
         "training.zero_stage=2", "checkpoint.interval=2", "checkpoint.at_transitions=true",
         f"training.hang_timeout_s={(HANG_TIMEOUT := 60)}"]
HANG_TIMEOUT_TEXT = "0:01:00"       # as faulthandler writes it
# Each launch after the first is the same `msds train` command; MSDS_FAULT alone differs. What each
# one does, with the checkpoint it resumes from (the newest complete one) and the faults it meets:
LINKS = {
    # the reference, then: steps 1-2, checkpoint 2, rank 1 killed in the down transition 1 -> 2
    "down": "inside-down-transition:1:1",
    # from 2: steps 3-4, rank 0 killed between DeepSpeed's files and msds's of checkpoint 4
    "between-files": "checkpoint-between-files:0:1",
    # from 2 (4 unfinished): checkpoint 4, steps 5-6, both ranks killed before checkpoint 6's COMPLETE
    "before-complete": "checkpoint-before-complete::2",
    # from 4 (6 unmarked): steps 5-8, checkpoint 8, rank 0 killed in the up transition 3 -> 2
    "up": "inside-up-transition:0:1",
    # from 8: step 9, then rank 1 hangs before step 10; every rank's watchdog ends it
    "hang": "hang-before-step:1:2",
    # from 8: to the end
    "end": "",
}
# How long the launcher may take to end the job once a rank is killed (it ends the others).
KILL_BOUND_S = 60
# The chain's six launches (one waits out the hang timeout), with room for a loaded machine.
chain_timeout = pytest.mark.timeout(2400)


class Launch:
    """One torchrun launch, its output read as it comes (and kept in `log`): the exit status, the
    output, and the seconds from the fault point's line to the launcher's exit."""

    def __init__(self, command: list[str], spec: str, log: Path, timeout: float = 900):
        env = {**os.environ, "OMP_NUM_THREADS": "1", faults.ENV: spec}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killer = threading.Timer(timeout, proc.terminate)   # torchrun ends its workers on SIGTERM
        killer.start()
        lines, fault_at = [], None
        for line in proc.stdout:
            lines.append(line)
            if fault_at is None and f"{faults.ENV}: " in line:
                fault_at = time.monotonic()
        self.returncode = proc.wait()
        killer.cancel()
        self.seconds_after_fault = None if fault_at is None else time.monotonic() - fault_at
        self.output = "".join(lines)
        log.write_text(self.output)

    def resumed_from(self) -> int | None:
        found = re.search(r"resumed from \S+ at step (\d+)", self.output)
        return int(found.group(1)) if found else None


@pytest.fixture(scope="module")
def chain(train_corpus, tmp_path_factory) -> tuple[Path, dict[str, Launch]]:
    work = tmp_path_factory.mktemp("faults")
    (work / "overrides.json").write_text(json.dumps(CHAIN))
    first = [*TORCHRUN, str(REPO / "tests" / "dist" / "train_checks.py"), "faults", str(train_corpus), str(work), "-"]
    launches = {}
    for name, spec in LINKS.items():
        launches[name] = Launch(first if not launches else chain_command(train_corpus, work / "chain"), spec,
                                work / f"{name}.log")
    return work, launches


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def chain_command(corpus, run_dir: Path) -> list[str]:
    """The chain's `msds train` command (and the kill campaign's), writing to `run_dir`."""
    return [*TORCHRUN, "-m", "msds.cli", "train", "--config", str(RECIPE), f"data.path={corpus}",
            f"run_dir={run_dir}", "logging.tensorboard=false", *CHAIN]


def assert_killed(launch: Launch, place: str) -> None:
    assert launch.returncode != 0, launch.output[-3000:]
    assert f"{faults.ENV}: {place}" in launch.output
    assert "Signal 9 (SIGKILL)" in launch.output or "exitcode  : -9" in launch.output, launch.output[-3000:]
    assert launch.seconds_after_fault < KILL_BOUND_S, launch.seconds_after_fault


@chain_timeout
def test_rank_killed_inside_a_down_transition(chain):
    _, launches = chain
    assert_killed(launches["down"], "inside-down-transition")
    assert launches["between-files"].resumed_from() == 2


@chain_timeout
def test_rank_killed_between_the_files_of_a_checkpoint(chain):
    _, launches = chain
    assert_killed(launches["between-files"], "checkpoint-between-files")
    after = launches["before-complete"]
    assert "step00000004 skipped: not marked complete (a save was interrupted)" in after.output
    assert after.resumed_from() == 2


@chain_timeout
def test_job_killed_before_a_checkpoint_is_marked_complete(chain):
    _, launches = chain
    assert_killed(launches["before-complete"], "checkpoint-before-complete")
    assert launches["before-complete"].output.count(f"{faults.ENV}: checkpoint-before-complete") == 2  # both ranks
    after = launches["up"]
    assert "step00000006 skipped: not marked complete (a save was interrupted)" in after.output
    assert after.resumed_from() == 4


@chain_timeout
def test_rank_killed_inside_an_up_transition(chain):
    _, launches = chain
    assert_killed(launches["up"], "inside-up-transition")
    assert launches["hang"].resumed_from() == 8


@chain_timeout
def test_hung_rank_ends_the_job_with_every_stack(chain):
    work, launches = chain
    hang = launches["hang"]
    assert hang.returncode != 0, hang.output[-3000:]
    assert hang.seconds_after_fault < HANG_TIMEOUT + KILL_BOUND_S, hang.seconds_after_fault
    assert launches["end"].resumed_from() == 8
    # Both ranks' watchdogs fired, each writing its stacks to its own file (in one stream, dumps
    # written at the same moment interleave mid-line): rank 1 asleep in the fault point, rank 0
    # inside the same training step, waiting for rank 1 in a collective. Only the hang's launch has
    # stacks in the files (a killed launch leaves its header with nothing after it; the last one
    # cut its header off as it ended).
    stacks = {rank: (work / "chain" / "stacks" / f"rank-{rank}.txt").read_text() for rank in (0, 1)}
    for rank, text in stacks.items():
        hung = [part for part in text.split(HangWatchdog.HEADER)[1:] if f"Timeout ({HANG_TIMEOUT_TEXT})!" in part]
        assert len(hung) == 1, text
        assert re.search(r'File ".*msds/train/engine\.py", line \d+ in train_step', hung[0]), text
        assert bool(re.search(r'File ".*msds/train/faults\.py", line \d+ in point', hung[0])) == (rank == 1), text
    assert "Timeout" not in hang.output   # stderr stays readable


@chain_timeout
def test_the_chain_ends_with_the_uninterrupted_losses(chain):
    work, launches = chain
    assert launches["end"].returncode == 0, launches["end"].output[-3000:]
    assert sorted(losses(work / "chain")) == list(range(1, 13))
    assert losses(work / "chain") == losses(work / "reference")
    final = [read_metrics(work / run, "eval")[-1]["val_loss"] for run in ("chain", "reference")]
    assert final[0] == final[1]
    assert [r["step"] for r in read_metrics(work / "chain", "resume")] == [2, 2, 4, 8, 8]


# -- a random kill campaign over the chain's V-cycle -------------------------------------------------

# Four kills (two of them in start-up), seeded; see msds/bench/kills.py for how each is drawn.
CAMPAIGN = {"kills": 4, "startup_kills": 2, "seed": 66}


@chain_timeout
def test_random_kills_end_with_the_uninterrupted_losses(chain, train_corpus, extension_cache):
    """SIGKILLs of one worker or both at random moments of the chain's 3-level V-cycle (start-up,
    steps, transitions, checkpoint writes), each launch the same command: the last one ends with
    the uninterrupted run's per-step losses, exactly. Every other launch has the system's
    directories first on PATH (another ninja, where the system has one): no start rebuilds the
    op that the extension cache holds."""
    work, _ = chain
    cache = extension_cache(work / "campaign-torch-extensions")
    library = cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built = library.stat().st_mtime_ns
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(cache)}
    envs = [env, {**env, "PATH": os.pathsep.join(["/usr/bin", env["PATH"]])}]
    (logs := work / "campaign-logs").mkdir()
    started = time.monotonic()
    kills = kill_campaign.campaign(chain_command(train_corpus, work / "campaign"), envs, work / "campaign", 12,
                                   **CAMPAIGN, logs=logs, launch_timeout_s=300)
    print(f"kill campaign: {len(kills)} kills in {time.monotonic() - started:.0f} s: "
          f"{json.dumps(kill_campaign.summary(kills))}")
    assert len(kills) >= CAMPAIGN["kills"] - 1, kill_campaign.records(kills)   # the last may miss: the run ended
    assert sum(k.moment == "start-up" for k in kills) >= 1, kill_campaign.records(kills)
    assert all(k.steps_lost is not None and 0 <= k.steps_lost <= 2 for k in kills), kill_campaign.records(kills)
    assert losses(work / "campaign") == losses(work / "reference")
    final = [read_metrics(work / run, "eval")[-1]["val_loss"] for run in ("campaign", "reference")]
    assert final[0] == final[1]
    assert library.stat().st_mtime_ns == built, "a start rebuilt DeepSpeed's op"
