"""The DeepSpeed trainer: V-cycles on 2 processes with ZeRO 0/1/2/3 and in bf16, exact resume, memory
across transitions, and bad input caught before training."""
import json
import math
from pathlib import Path

import pytest
import torch

from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config
from msds.train import checkpointing
from msds.train.loop import train
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_three_level_vcycle_on_two_processes(two_process_results, arch, stage):
    result = two_process_results[f"{arch}-zero{stage}"]
    losses = result["losses"]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses.values())
    transitions = result["summary"]["transitions"]
    assert [(t["direction"], t["from_level"], t["to_level"]) for t in transitions] == \
        [("down", 1, 2), ("down", 2, 3), ("up", 3, 2), ("up", 2, 1)]
    for t in transitions:
        assert math.isfinite(t["loss_before"]) and math.isfinite(t["loss_after"])
        # Every rank's seconds and peak host memory above its level before the transition.
        assert [r["rank"] for r in t["ranks"]] == [0, 1]
        assert all(r["seconds"] > 0 and r["rss_peak_extra_mb"] >= 0 for r in t["ranks"])
    for t in transitions[2:]:  # the recipe's alpha: reported next to the loss before coalescing
        assert t["alpha"] == 0.5 and math.isfinite(t["loss_before_coalescing"])
    assert math.isfinite(result["summary"]["final_val_loss"])


def test_random_ltd_with_a_vcycle_on_zero2(two_process_results):
    result = two_process_results["gpt-zero2-random-ltd"]
    assert len(result["losses"]) == 30 and all(math.isfinite(v) for v in result["losses"].values())
    assert len(result["summary"]["transitions"]) == 4
    keep = [result["keep_tokens"][str(step)] for step in range(1, 31)]
    assert keep[0] == 16 and keep[-1] == 32 and keep == sorted(keep)   # MSLG across transitions
    # Fewer tokens in the routed layers: fewer FLOPs than the same V-cycle without dropping.
    assert result["summary"]["state"]["flops"] < two_process_results["gpt-zero2"]["summary"]["state"]["flops"]


def test_zero_stages_train_the_same_model(two_process_results):
    for arch in ("gpt", "bert"):
        reference = two_process_results[f"{arch}-zero1"]["losses"]
        for stage in (0, 2, 3) if arch == "gpt" else (2, 3):
            other = two_process_results[f"{arch}-zero{stage}"]["losses"]
            assert max(abs(reference[k] - other[k]) for k in reference) < 1e-4


def _final_checkpoint(result) -> Path:
    ckpts = Path(result["run_dir"]) / "checkpoints"
    return ckpts / (ckpts / "latest").read_text()


def test_zero0_vcycle(two_process_results):
    """ZeRO 0 (the optimizer state whole on every rank, in DeepSpeed's module file), through the four
    transitions: its losses are ZeRO 1's within 1e-4 (test above)."""
    result = two_process_results["gpt-zero0"]
    assert [t["direction"] for t in result["summary"]["transitions"]] == ["down", "down", "up", "up"]
    files = sorted(p.name for p in _final_checkpoint(result).glob("*.pt"))
    assert files == ["mp_rank_00_model_states.pt"]          # no ZeRO partitions
    assert math.isfinite(result["summary"]["final_val_loss"])


def test_bf16_vcycle_on_cpu(two_process_results):
    """bf16 on DeepSpeed's CPU accelerator: the engine's weights are bf16 (fp32 master copies in its
    optimizer), the V-cycle's transitions run, and the losses follow the fp32 run's within bf16
    rounding but not bit for bit."""
    result, fp32 = two_process_results["gpt-bf16"], two_process_results["gpt-zero1"]["losses"]
    assert [t["direction"] for t in result["summary"]["transitions"]] == ["down", "down", "up", "up"]
    module = checkpointing.safe_load(_final_checkpoint(result) / "mp_rank_00_model_states.pt")["module"]
    assert {t.dtype for t in module.values() if torch.is_tensor(t)} == {torch.bfloat16}
    difference = max(abs(fp32[k] - result["losses"][k]) for k in fp32)
    assert 0 < difference < 1e-2
    fp32_val_loss = two_process_results["gpt-zero1"]["summary"]["final_val_loss"]
    assert abs(result["summary"]["final_val_loss"] - fp32_val_loss) < 1e-2


def test_alpha_zero_restores_the_saved_large_model(two_process_results):
    ups = [t for t in two_process_results["gpt-alpha0"]["summary"]["transitions"] if t["direction"] == "up"]
    assert len(ups) == 2
    for t in ups:
        assert abs(t["loss_after"] - t["loss_before_coalescing"]) < 1e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_right_after_a_transition_reproduces_losses(two_process_results, stage):
    uninterrupted = two_process_results[f"gpt-zero{stage}"]["losses"]
    resumed = two_process_results[f"gpt-zero{stage}-resumed"]
    assert resumed["first"]["summary"]["exited_early"]
    assert resumed["first"]["summary"]["state"]["step"] == 12
    assert resumed["second"]["losses"] == uninterrupted


def tiny_cfg(corpus, run_dir, *overrides):
    return load_run_config(RECIPE, [f"data.path={corpus}", f"run_dir={run_dir}", "logging.tensorboard=false",
                                    *overrides])


def test_ten_transitions_keep_memory_flat(train_corpus, tmp_path):
    cfg = tiny_cfg(train_corpus, tmp_path / "run", "multilevel.levels=[{}]", "multilevel.cycles=5",
                   "multilevel.phase_steps=[2,2,2,2,2,2,2,2,2,2,2]", "logging.eval_batches=1")
    summary = train(cfg)
    assert len(summary.transitions) == 10
    # The first transitions allocate what every later one reuses (allocator pools, JIT caches).
    settled, last = summary.transitions[1]["rss_mb_after"], summary.transitions[-1]["rss_mb_after"]
    assert last < 1.05 * settled, (settled, last)


def test_corrupted_latest_checkpoint_falls_back_to_previous(train_corpus, tmp_path, capsys):
    base = ["multilevel.enabled=false", "training.steps=8", "checkpoint.interval=3", "training.exit_after_steps=7"]
    train(tiny_cfg(train_corpus, tmp_path / "run", *base))
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000003", "step00000006", "step00000007"]
    victim = next(p for p in sorted((ckpts / "step00000007").rglob("*.pt")))
    victim.write_bytes(victim.read_bytes()[:100])
    capsys.readouterr()
    summary = train(tiny_cfg(train_corpus, tmp_path / "run", *base[:3]))
    out = capsys.readouterr().out
    assert "step00000007 skipped: " in out and "truncated or altered" in out
    assert "resumed from" in out and "step00000006" in out
    assert summary.state.step == 8
    resumes = read_metrics(tmp_path / "run", "resume")
    assert resumes[-1]["step"] == 6
    # Step 7 was logged by the first attempt and trained again after the resume from step 6: the
    # history a report reads has it once, from the second attempt, with the clock running on from 6.
    steps = read_metrics(tmp_path / "run", "step")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[6]["time"] > resumes[-1]["time"]
    assert all(a["train_seconds"] < b["train_seconds"] for a, b in zip(steps, steps[1:]))


def test_partial_checkpoint_is_not_resumed(train_corpus, tmp_path):
    train(tiny_cfg(train_corpus, tmp_path / "run", "multilevel.enabled=false", "training.steps=4",
                   "training.exit_after_steps=2"))
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step00000002" / "msds" / checkpointing.COMPLETE).unlink()   # as if a rank died mid-save
    assert checkpointing.find_resumable(ckpts, print) is None


@pytest.mark.parametrize("override,message", [
    ("training.stepz=3", r"^training\.stepz: unknown key"),
    ("multilevel.phase_steps=[6,0,6,6,6]", r"^multilevel\.phase_steps\[1\]: must be positive"),
    ("multilevel.levels=[{hidden: 3}]", r"multilevel\.levels\[0\]\.hidden: factor 3 does not divide hidden_size 64"),
    ("multilevel.alpha=1.5", r"^multilevel\.alpha: 1\.5 is outside \[0, 1\]"),
    ("training.exit_signal=SIGNOPE", r"^training\.exit_signal: 'SIGNOPE' is not a signal name"),
    ("training.spike_factor=0.5", r"^training\.spike_factor: 0\.5 would flag ordinary steps"),
    ("training.hang_timeout_s=-1", r"^training\.hang_timeout_s: must be 0 \(off\) or more, got -1"),
    ("training.startup_timeout_s=-5", r"^training\.startup_timeout_s: must be 0 \(off\) or more, got -5"),
    ("parallel.tensor=2", r"^parallel: tensor \(2\) x pipeline \(1\) parallel sizes must divide the number of "
                          r"processes, 1"),
])
def test_bad_config_is_one_clear_error(train_corpus, tmp_path, capsys, override, message):
    import re

    args = ["train", "--config", str(RECIPE), f"data.path={train_corpus}", f"run_dir={tmp_path / 'run'}", override]
    if "levels" in override:
        args.append("multilevel.phase_steps=[6,6,6]")
    assert msds_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0].split("error: ", 1)[1]), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ds_config_that_contradicts_msds_config(train_corpus, tmp_path):
    ds = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 7
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = tiny_cfg(train_corpus, tmp_path / "run", f"training.ds_config={tmp_path / 'ds.json'}")
    with pytest.raises(ConfigError, match=r"training.ds_config: train_micro_batch_size_per_gpu is 7 but the msds "
                                          r"config says 4"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_vocabulary_smaller_than_tokenizer(train_corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 512 is smaller than the tokenizer's vocabulary \(1024\)"):
        train(tiny_cfg(train_corpus, tmp_path / "run", "model.vocab_size=512"))


def test_compiled_blocks_train_like_eager(train_corpus, tmp_path):
    """training.compile: torch.compile'd blocks (inductor on this CPU) give eager's losses, fp32."""
    losses, graphs = {}, {}
    for compiled in (False, True):
        run_dir = tmp_path / f"compile-{compiled}"
        torch._dynamo.utils.counters.clear()
        train(tiny_cfg(train_corpus, run_dir, "multilevel.enabled=false", "training.steps=3", "model.num_layers=1",
                       "model.hidden_dropout=0.0", "model.attention_dropout=0.0", "logging.interval=1",
                       "logging.eval_interval=100", "logging.eval_batches=1", f"training.compile={compiled}"))
        losses[compiled] = [r["loss"] for r in read_metrics(run_dir, "step")]
        graphs[compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs[False] == 0 and graphs[True] > 0
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_compile_refused_where_unverified(train_corpus, tmp_path):
    from msds.plan import build_plan

    cfg = tiny_cfg(train_corpus, tmp_path / "run", "training.compile=true", "training.zero_stage=3")
    with pytest.raises(ConfigError, match=r"^training\.compile: .*training\.zero_stage=3.*training\.compile=false"):
        build_plan(cfg)
