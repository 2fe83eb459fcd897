"""Resuming on another data x tensor x pipeline layout (msds/train/relayout.py): a V-cycle cut inside
its bottom phase (levels 1 and 2 saved, with their Adam moments) and resumed at DP 2 -> 1,
DP 1 -> 2, TP 2 -> 1 and PP 2 -> 1 has the per-step losses of the same run continued on its own
layout (fp32, ZeRO 1, dropout off); a resume that would change the global batch or the V-cycle's grouping,
or that needs a layout-free copy the checkpoint lacks, is refused with the fields to change. The
two-process runs come from one launch of tests/dist/train_checks.py's `relayout` suite."""
import re
import shutil
from pathlib import Path

import pytest

from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config
from msds.errors import MsdsError
from msds.plan import build_plan
from msds.train import checkpointing, relayout
from msds.train.loop import train
from msds.train.metrics import read_metrics

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "test" / "test-vcycle-gpt.yaml"
# The same overrides as tests/dist/train_checks.py's relayout suite: phases of 2, 2, 4, 2 and 2 steps.
SHORT_VCYCLE = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "multilevel.phase_steps=[2,2,4,2,2]",
                "logging.eval_batches=1"]
CUT = 6                  # 2 steps into the bottom phase (steps 5-8)
CUT_TAG = "step00000006"
TOLERANCE = 1e-5         # as tests/test_parallel.py: float reassociation of split matmuls and sums
# What the one-process resume of each two-process run changes besides the process count.
TO_ONE_PROCESS = {"dp2": ["training.grad_accum=2"],   # global batch 2 x 4 x 1 = 1 x 4 x 2
                  "tp2": ["multilevel.shards=2"],      # heads and FFN grouped as the TP=2 run grouped them
                  "pp2": []}


def config(corpus, run_dir, *overrides):
    return load_run_config(RECIPE, [f"data.path={corpus}", f"run_dir={run_dir}", "logging.tensorboard=false",
                                    *SHORT_VCYCLE, *overrides])


def step_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "step")}


def assert_continues(reference: dict[int, float], resumed: dict[int, float]):
    assert sorted(resumed) == sorted(reference) == list(range(1, 13))
    assert max(abs(resumed[s] - reference[s]) for s in range(CUT + 1, 13)) < TOLERANCE


@pytest.fixture(scope="module")
def runs(train_corpus, tmp_path_factory, launch):
    """The one-process run cut at step 6 (a copy left in dp1-to-dp2 for the launch to resume on two
    processes) and continued: the DP 1 reference; then the launch of the two-process runs."""
    work = tmp_path_factory.mktemp("relayout")
    train(config(train_corpus, work / "dp1", f"training.exit_after_steps={CUT}"))
    shutil.copytree(work / "dp1", work / "dp1-to-dp2")
    train(config(train_corpus, work / "dp1"))
    results = launch("relayout", 2, work)
    return work, {name: {**result, "losses": {int(k): v for k, v in result["losses"].items()}}
                  for name, result in results.items()}


@pytest.mark.parametrize("source", list(TO_ONE_PROCESS))
def test_two_process_run_continues_on_one_process(runs, train_corpus, source):
    work, results = runs
    run_dir = work / f"{source}-cut"
    summary = train(config(train_corpus, run_dir, *TO_ONE_PROCESS[source]))
    resumes = read_metrics(run_dir, "resume")
    assert [(r["step"], r["same_layout"]) for r in resumes] == [(CUT, False)]
    reference = results[source]
    assert_continues(reference["losses"], step_losses(run_dir))
    # The way up interpolated with the saved levels exactly as on the original layout.
    ups = [t for t in summary.transitions if t["step"] > CUT]
    expected = [t for t in reference["summary"]["transitions"] if t["step"] > CUT]
    assert [t["direction"] for t in ups] == ["up", "up"]
    assert all(abs(a["loss_after"] - b["loss_after"]) < TOLERANCE for a, b in zip(ups, expected))
    assert abs(summary.final_val_loss - reference["summary"]["final_val_loss"]) < TOLERANCE


def test_one_process_run_continues_on_two_processes(runs):
    """DP 1 -> 2 with half the micro-batch: the same samples in every step."""
    work, results = runs
    assert [r["same_layout"] for r in read_metrics(work / "dp1-to-dp2", "resume")] == [False]
    assert_continues(step_losses(work / "dp1"), results["dp1-to-dp2"]["losses"])


def test_resume_that_would_change_the_global_batch_is_refused(runs, train_corpus, tmp_path, capsys):
    work, _ = runs
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(work / "dp2-cut" / "checkpoints" / CUT_TAG, checkpoints / CUT_TAG)
    args = ["train", "--config", str(RECIPE), f"data.path={train_corpus}", f"run_dir={tmp_path / 'run'}",
            "logging.tensorboard=false", *SHORT_VCYCLE]
    assert msds_main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
    assert len(errors) == 1 and re.search(
        r"error: training\.grad_accum: \S+ was written with a global batch of 8 samples per step \(data parallel 2 x "
        r"training\.micro_batch_size 4 x training\.grad_accum 1\); this run's would be 4 \(data parallel 1 x 4 x 1\)"
        r", which would change the run; set training\.grad_accum=2$", errors[0]), errors
    assert [p.name for p in checkpoints.iterdir()] == [CUT_TAG]


def test_resume_that_would_regroup_the_vcycle_or_lacks_the_copy_is_refused(runs, train_corpus, tmp_path):
    work, _ = runs
    tag_dir = work / "tp2-cut" / "checkpoints" / CUT_TAG
    saved = checkpointing.read_state(tag_dir.parent, CUT_TAG)
    regrouped = build_plan(config(train_corpus, tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^multilevel\.shards: .* grouped the ffn of level 1 inside each of 2 shards "
                                          r"\(written at parallel\.tensor=2\), this run would group them inside 1; "
                                          r"set multilevel\.shards=2"):
        relayout.check_resume(saved, regrouped, tag_dir)
    plan = build_plan(config(train_corpus, tmp_path / "run", "multilevel.shards=2"))
    assert relayout.check_resume(saved, plan, tag_dir) is False
    without_copy = tmp_path / CUT_TAG
    shutil.copytree(tag_dir, without_copy)
    shutil.rmtree(without_copy / "msds" / relayout.LAYOUT_FREE)
    with pytest.raises(MsdsError, match=r"written at data x tensor x pipeline = 1 x 2 x 1 without a layout-free copy "
                                        r".*resume it on that layout: 2 processes with parallel\.tensor=2 "
                                        r"parallel\.pipeline=1$"):
        relayout.check_resume(saved, plan, without_copy)
