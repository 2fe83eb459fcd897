"""The host's work per optimizer step (issue 59), counted by benchmarks/host_overhead.py's StepCounter
around `msds train`'s real loop: the budgets, and the benchmark's CPU path end to end."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import host_overhead  # noqa: E402

# BERT-Large's 24 layers at width 32: its per-parameter work, at little compute.
SHAPE = (32, 24, 2, 32)
STEPS = 10          # the default logging interval: one progress line inside the windows
STATIC = ["data.max_predictions_per_seq=8"]   # BERT's head without the boolean mask's host read


@pytest.fixture(scope="module")
def fp32_rows(train_corpus):
    corpus = str(train_corpus)
    return (host_overhead.msds_row(corpus, "fp32", STEPS, SHAPE, count=True, extra=STATIC),
            host_overhead.hand_row(corpus, "fp32", STEPS, SHAPE, count=True, model="msds", extra=STATIC))


def test_msds_train_reads_the_device_once_per_step_in_fp32(fp32_rows):
    ours, _ = fp32_rows
    assert ours["steps"] == STEPS
    assert ours["syncs_per_step"] <= 1, ours["sync_ops_per_step"]


def test_msds_train_reads_the_device_once_per_step_in_bf16(train_corpus):
    ours = host_overhead.msds_row(str(train_corpus), "bf16", STEPS, SHAPE, count=True, extra=STATIC)
    assert ours["syncs_per_step"] <= 1, ours["sync_ops_per_step"]


def test_msds_train_launches_at_most_1_3x_the_hand_written_loops_kernels(fp32_rows):
    """The operations that would launch a kernel on a GPU (not views, not allocations)."""
    ours, hand = fp32_rows
    assert ours["kernel_ops_per_step"] <= 1.3 * hand["kernel_ops_per_step"], (ours, hand)


def test_msds_train_dispatches_at_most_1_3x_the_hand_written_loops_operations(fp32_rows):
    """Every dispatched operation, views and allocations included: ZeRO-1's gradient bucketing
    (ds_configs/zero1.json's contiguous_gradients, msds.compat's one-rank reduction) is what
    this budget watches."""
    ours, hand = fp32_rows
    assert ours["ops_per_step"] <= 1.3 * hand["ops_per_step"], (ours, hand)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_contiguous_gradients_off_trains_the_same_losses(train_corpus, tmp_path, precision):
    """ds_configs/zero1.json turns ZeRO-1's contiguous_gradients off: the test V-cycle (every
    transition, dropout on) gives DeepSpeed's default's per-step losses to the bit."""
    from msds.config import load_run_config
    from msds.train.loop import train
    from msds.train.metrics import read_metrics

    template = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    assert template["zero_optimization"]["contiguous_gradients"] is False
    template["zero_optimization"]["contiguous_gradients"] = True
    (tmp_path / "contiguous.json").write_text(json.dumps(template))
    losses = []
    for name, ds_config in (("off", "zero1.json"), ("on", str(tmp_path / "contiguous.json"))):
        run_dir = tmp_path / name
        train(load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", [
            f"data.path={train_corpus}", f"run_dir={run_dir}", "logging.tensorboard=false",
            f"training.precision={precision}", f"training.ds_config={ds_config}",
            "multilevel.phase_steps=[3,3,3,3,3]"]))
        losses.append([(r["step"], r["loss"]) for r in read_metrics(run_dir, "step")])
    assert len(losses[0]) == 15 and losses[0] == losses[1]


def test_the_benchmark_writes_every_row(train_corpus, tmp_path):
    out = tmp_path / "overhead.json"
    assert host_overhead.main(["--data", str(train_corpus), "--json", str(out), "--steps", "2", "--width", "32",
                               "--layers", "2", "--batch", "2", "--seq", "32", "--precision", "fp32"]) == 0
    result = json.loads(out.read_text())
    assert [r["row"] for r in result["rows"]] == list(host_overhead.ROWS)
    for row in result["rows"]:
        assert row["ops_per_step"] > 100 and row["host_ms_per_step"] > 0 and row["steps"] == 2
    # The hand-written loop reads nothing; msds's loop reads the loss (and whatever else it still reads).
    assert result["rows"][0]["syncs_per_step"] >= 1
