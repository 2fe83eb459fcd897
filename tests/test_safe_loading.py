"""Checkpoints are read without running code from them (torch.load with weights_only=True, DeepSpeed's
reads on resume included), and a checkpoint keeps every random generator's state, so that a
resumed run draws what the uninterrupted one drew."""
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.optim.lr_scheduler import LambdaLR

from msds.cli import main as msds_main
from msds.compat import megatron_core_0_16 as megatron_compat
from msds.config import load_run_config
from msds.integrity import sha256_file
from msds.plan.schedule import Phase, PhaseCurve
from msds.train import checkpointing
from msds.train.loop import train
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"      # dropout 0.1, ZeRO-1
BASE = ["multilevel.enabled=false", "training.steps=4", "logging.tensorboard=false"]
TAG = "step00000002"


def _args(corpus, run_dir, *overrides) -> list[str]:
    return [f"data.path={corpus}", f"run_dir={run_dir}", *BASE, *overrides]


class _TouchOnLoad:
    """Unpickling it creates `marker`: a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(tag_dir: Path, rel: str, marker: Path) -> Path:
    """Replace `rel` of the checkpoint with a pickle that creates `marker` when loaded, and rewrite
    COMPLETE to match, as whoever crafts a checkpoint would: it still verifies as intact."""
    path = tag_dir / rel
    torch.save({"module": _TouchOnLoad(marker)}, path)
    complete = tag_dir / "msds" / checkpointing.COMPLETE
    manifest = json.loads(complete.read_text())
    assert rel in manifest["files"]
    manifest["files"][rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    complete.write_text(json.dumps(manifest))
    assert checkpointing.verify(tag_dir) is None
    return path


def _refusal(path: Path) -> str:
    return (f"{path}: refuses to unpickle getattr: not a tensor checkpoint msds or DeepSpeed writes; do not load "
            f"checkpoints from untrusted sources with torch.load(weights_only=False)")


@pytest.fixture(scope="module")
def stopped_run(train_corpus, tmp_path_factory):
    """A ZeRO-1 run stopped after 2 of its 4 steps (checkpoint step00000002)."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    train(load_run_config(RECIPE, _args(train_corpus, run, "training.exit_after_steps=2")))
    return run


@pytest.fixture
def run_copy(stopped_run, tmp_path):
    return Path(shutil.copytree(stopped_run, tmp_path / "run"))


def test_convert_checkpoint_refuses_a_pickle_that_runs_code(run_copy, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    victim = _plant(run_copy / "checkpoints" / TAG, "mp_rank_00_model_states.pt", marker)
    capsys.readouterr()
    assert msds_main(["convert-checkpoint", str(run_copy / "checkpoints"), str(tmp_path / "model")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"msds convert-checkpoint: error: {_refusal(victim)}"]
    assert not marker.exists() and not (tmp_path / "model").exists()
    torch.load(victim, weights_only=False)      # the same file loaded the unsafe way runs its code
    assert marker.exists()


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "msds/rank0.pt"])
def test_resume_refuses_a_pickle_that_runs_code(run_copy, train_corpus, tmp_path, capsys, victim):
    """DeepSpeed's module and ZeRO files, and msds's own rank file: each is read safely on resume."""
    marker = tmp_path / "code-ran"
    path = _plant(run_copy / "checkpoints" / TAG, victim, marker)
    capsys.readouterr()
    assert msds_main(["train", "--config", str(RECIPE), *_args(train_corpus, run_copy)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert errors == [f"msds train: error: {_refusal(path)}"]
    assert not marker.exists()


def test_a_real_checkpoint_converts_and_resumes(run_copy, train_corpus, tmp_path):
    """The safe load accepts what msds and DeepSpeed write (ZeRO-1, the LR scheduler's state)."""
    assert msds_main(["convert-checkpoint", str(run_copy / "checkpoints"), str(tmp_path / "model")]) == 0
    summary = train(load_run_config(RECIPE, _args(train_corpus, run_copy)))
    assert summary.state.step == 4 and read_metrics(run_copy, "resume")[-1]["step"] == 2


def test_older_checkpoints_lr_scheduler_state_loads(tmp_path):
    """Before msds gave LambdaLR a plain function, it saved the plan's curve object, Phase included."""
    phase = Phase(index=0, level=1, steps=4, start_step=0, peak_lr=1e-3, warmup_steps=2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    torch.save(LambdaLR(optimizer, PhaseCurve(phase, 0.1)).state_dict(), tmp_path / "sched.pt")
    assert checkpointing.safe_load(tmp_path / "sched.pt")["lr_lambdas"][0]["phase"] == phase


# --- every random generator --------------------------------------------------------------------

def _draws() -> list[torch.Tensor]:
    """One draw from each generator a checkpoint keeps (the megatron tracker's model-parallel stream
    through fork(), as tensor-parallel dropout draws it)."""
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(3)
    draws = [torch.tensor(random.random()), torch.tensor(np.random.rand()), torch.rand(3), forked]
    if torch.cuda.is_available():
        draws += [torch.rand(3, device=f"cuda:{d}").cpu() for d in range(torch.cuda.device_count())]
    return draws


def test_rng_state_round_trips_through_a_safe_load(tmp_path):
    torch.save(checkpointing.rng_state(), tmp_path / "rng.pt")
    first = _draws()
    moved_on = _draws()
    assert all(not torch.equal(a, b) for a, b in zip(first, moved_on)), "every generator advances"
    checkpointing.restore_rng_state(checkpointing.safe_load(tmp_path / "rng.pt"))
    again = _draws()
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def _as_in_a_fresh_process(seed: int) -> None:
    """Every generator as a new process has it before resuming: unseeded ones reset, megatron's
    tracker seeded by init_distributed."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    megatron_compat.seed_model_parallel_rng(seed)


def test_resume_with_dropout_continues_the_uninterrupted_losses(train_corpus, tmp_path):
    """Dropout 0.1 draws from torch's generator every step: a run cut at step 3 and resumed (in a
    process whose generators start afresh) reproduces the uninterrupted run's losses exactly."""
    whole = tmp_path / "whole"
    train(load_run_config(RECIPE, _args(train_corpus, whole, "training.steps=6")))
    cut = tmp_path / "cut"
    train(load_run_config(RECIPE, _args(train_corpus, cut, "training.steps=6", "training.exit_after_steps=3")))
    _as_in_a_fresh_process(load_run_config(RECIPE, []).training.seed)
    train(load_run_config(RECIPE, _args(train_corpus, cut, "training.steps=6")))
    losses = {run: {r["step"]: r["loss"] for r in read_metrics(run, "step")} for run in (whole, cut)}
    assert sorted(losses[cut]) == list(range(1, 7))
    assert losses[cut] == losses[whole]
