"""Tensor and pipeline parallelism: TP=2, PP=2, PP=2 x DP=2 and PP=2 x TP=2 train exactly like the
unsplit model (V-cycle transitions included), a TP=2 run with dropout resumes bit-identically, a
vocabulary padded for TP=2 trains like the unpadded one, transitions are shard-local and stage-local,
TP and PP checkpoints convert to TP=1 and export to Hugging Face, and bad layouts are refused at startup.
The multi-process runs come from the launches in tests/conftest.py."""
import math
from pathlib import Path

import pytest
import torch
import transformers

from msds.model.files import load_into, load_model, model_tensors
from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config, model_config
from msds.model.roles import tensor_parallel_dim
from msds.model.transformer import Transformer
from msds.multilevel.operators import coalesce, decoalesce, plan_level
from msds.train.checkpointing import safe_load
from msds.train.loop import train
from msds.plan import build_plan
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "test" / "test-vcycle-gpt.yaml"
EXACT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
TOLERANCE = 1e-5   # absolute, on per-step losses of ~6: float reassociation of split matmuls and sums


def assert_same_losses(reference: dict, run: dict):
    assert len(reference) == len(run) == 30
    assert max(abs(reference[k] - run[k]) for k in reference) < TOLERANCE


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_tp2_vcycle_matches_tp1(two_process_results, one_process_losses, arch):
    tp2 = two_process_results[f"{arch}-tp2"]
    # Same grouping as the TP=2 run: heads and FFN grouped inside 2 shards.
    assert_same_losses(one_process_losses(arch, "multilevel.shards=2", *EXACT), tp2["losses"])
    assert len(tp2["summary"]["transitions"]) == 4


def test_tp2_run_with_dropout_resumes_exactly(two_process_results):
    """Dropout 0.1 at TP=2: attention dropout draws from megatron's tracker stream of each rank, the
    rest from torch's generator. A run stopped right after a transition (step 12) and resumed with
    every generator scrambled continues with bit-identical losses: each rank's checkpoint restored
    them all."""
    uninterrupted = two_process_results["gpt-tp2-dropout"]["losses"]
    resumed = two_process_results["gpt-tp2-resumed"]
    assert resumed["first"]["summary"]["state"]["step"] == 12 and resumed["first"]["summary"]["exited_early"]
    assert resumed["second"]["losses"] == uninterrupted
    # The dropout draws mattered: without dropout the same run computes other losses.
    assert uninterrupted != two_process_results["gpt-tp2"]["losses"]


def test_tp2_padded_vocabulary_trains_like_the_unpadded_model(two_process_results, one_process_losses):
    """1025 tokens at TP=2 are padded to 1280 rows (128 x 2); one process with
    make_vocab_size_divisible_by=1 has no padding at all. Same losses, and the padding rows are still
    zero after the V-cycle's four transitions (never predicted, so never trained)."""
    padded = two_process_results["gpt-tp2-padded"]
    unpadded = one_process_losses("gpt", "multilevel.shards=2", *EXACT, "model.vocab_size=1025",
                                  "model.make_vocab_size_divisible_by=1")
    assert_same_losses(unpadded, padded["losses"])
    assert len(padded["summary"]["transitions"]) == 4
    ckpts = Path(padded["run_dir"]) / "checkpoints"
    tag_dir = ckpts / (ckpts / "latest").read_text()
    word = torch.cat([safe_load(tag_dir / f"mp_rank_0{r}_model_states.pt")["module"]["embeddings.word.weight"]
                      for r in range(2)])
    assert word.shape == (1280, 64) and word[:1025].abs().sum() > 0 and not word[1025:].any()


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_shard_local_transition_equals_tp1_restricted_to_the_shard(arch):
    """Coalescing (and de-coalescing) each rank's shards with the shard-local grouping gives exactly
    the TP=1 result cut into the same shards: no tensor-parallel communication is needed."""
    cfg = model_config(f"{arch}-tiny", num_layers=4, num_heads=8, hidden_size=64, ffn_size=128)
    tensors = model_tensors(Transformer(cfg))
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2, shards={"heads": 2, "ffn": 2})
    small = coalesce(tensors, level)
    large = decoalesce(small, level)

    def shard(full, rank):
        return {n: t.chunk(2, dim=tensor_parallel_dim(n))[rank] if tensor_parallel_dim(n) is not None else t
                for n, t in full.items()}

    for rank in range(2):
        local = level.shard_local(2, rank)
        local_small = coalesce(shard(tensors, rank), local)
        assert all(torch.equal(local_small[n], shard(small, rank)[n]) for n in small)
        local_large = decoalesce(local_small, local)
        assert all(torch.equal(local_large[n], shard(large, rank)[n]) for n in large)


def test_tensor_parallel_size_that_does_not_divide_a_level(train_corpus):
    # heads 4 -> 2 -> 1 over the recipe's two levels: TP=2 cannot split one head.
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.tensor=2",
                                   "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 2}, {hidden: 1, heads: 2, ffn: 1, layers: 1}]"])
    with pytest.raises(ConfigError, match=r"^multilevel\.levels\[1\]\.heads: factor 2 does not divide num_heads 2 "
                                          r"in each of 2 shards.*parallel\.tensor=2"):
        build_plan(cfg)
    # FFN 6 split over 2 ranks cannot be halved inside each 3-wide shard.
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.tensor=2", "model.ffn_size=6",
                                   "multilevel.levels=[{hidden: 1, heads: 1, ffn: 2, layers: 1}]",
                                   "multilevel.phase_steps=[6,6,6]"])
    with pytest.raises(ConfigError, match=r"^multilevel\.levels\[0\]\.ffn: factor 2 does not divide ffn_size 6 "
                                          r"in each of 2 shards.*parallel\.tensor=2"):
        build_plan(cfg)
    # And a level-1 model the tensor-parallel size cannot split at all.
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.tensor=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.tensor: 3 does not divide num_heads 4 of the level-1 model"):
        build_plan(cfg)


# -- pipeline parallelism ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_pp2_vcycle_matches_pp1(two_process_results, one_process_losses, arch):
    """Two stages (tied word embeddings on both) train the same weights on the same data exactly like
    one process, through the V-cycle's four transitions (layers 4 -> 2 -> 2 -> 2 -> 4)."""
    pp2 = two_process_results[f"{arch}-pp2"]
    assert_same_losses(one_process_losses(arch, *EXACT), pp2["losses"])
    assert [t["direction"] for t in pp2["summary"]["transitions"]] == ["down", "down", "up", "up"]


def test_pp2_dp2_matches_dp2(two_process_results, four_process_results):
    assert_same_losses(two_process_results["gpt-dp2-exact"]["losses"], four_process_results["gpt-pp2-dp2"]["losses"])


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_pp2_tp2_matches_tp1(four_process_results, one_process_losses, arch):
    assert_same_losses(one_process_losses(arch, "multilevel.shards=2", *EXACT),
                       four_process_results[f"{arch}-pp2-tp2"]["losses"])


def test_pp2_run_resumes_exactly(two_process_results):
    resumed = two_process_results["gpt-pp2-resumed"]
    assert resumed["first"]["summary"]["state"]["step"] == 12
    assert resumed["first"]["summary"]["exited_early"]
    assert resumed["second"]["losses"] == two_process_results["gpt-pp2"]["losses"]


@pytest.mark.parametrize("run", ["two:gpt-tp2", "two:gpt-tp2-padded", "two:gpt-pp2", "four:bert-pp2-tp2"])
def test_parallel_checkpoint_converts_to_tp1_and_exports(two_process_results, four_process_results, tmp_path, run):
    suite, name = run.split(":")
    run_dir = (two_process_results if suite == "two" else four_process_results)[name]["run_dir"]
    assert msds_main(["convert-checkpoint", f"{run_dir}/checkpoints", str(tmp_path / "tp1")]) == 0
    cfg, converted, _ = load_model(tmp_path / "tp1")
    _, exported_by_run, _ = load_model(f"{run_dir}/model")
    assert sorted(converted) == sorted(exported_by_run)
    assert all(torch.equal(converted[k], exported_by_run[k]) for k in converted)
    assert msds_main(["export-hf", str(tmp_path / "tp1"), str(tmp_path / "hf")]) == 0
    hf_class = transformers.GPT2LMHeadModel if cfg.arch == "gpt" else transformers.BertForMaskedLM
    hf = hf_class.from_pretrained(tmp_path / "hf").eval()
    model = Transformer(cfg).eval()
    load_into(model, converted)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


def test_pp2_random_ltd_routes_tokens(two_process_results):
    """Same run as gpt-pp2 (dropout 0) but for random-LTD: its first losses differ only because the
    pipeline's blocks routed tokens."""
    ltd, plain = two_process_results["gpt-pp2-random-ltd"], two_process_results["gpt-pp2"]
    keep = ltd["keep_tokens"]
    assert keep["1"] == 16 and keep["30"] == 32
    assert ltd["summary"]["state"]["flops"] < plain["summary"]["state"]["flops"]
    assert ltd["losses"]["1"] != plain["losses"]["1"]         # routed layers saw 16 of 32 tokens
    assert math.isfinite(ltd["summary"]["final_val_loss"])


def test_pipeline_engines_reuse_their_process_groups(two_process_results):
    """Each phase builds a new pipeline engine; their process groups are made once, not per engine
    (3 more runs, 11 more engines, after the first count)."""
    after_first_runs, at_end = two_process_results["pipeline_process_groups"]
    assert 0 < after_first_runs == at_end <= 4


@pytest.mark.parametrize("depth_layout", ["adjacent", "strided"])
def test_pipeline_layer_groups_stay_within_their_stage(train_corpus, depth_layout):
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.pipeline=2", "model.num_layers=8",
                                   f"multilevel.levels=[{{hidden: 1, heads: 1, ffn: 1, layers: 2, "
                                   f"depth_layout: {depth_layout}}}, {{hidden: 1, heads: 1, ffn: 1, layers: 2}}]"])
    for level_map in build_plan(cfg, world_size=2).level_maps:
        large, small = level_map.large.num_layers, level_map.small.num_layers
        for small_layer, group in enumerate(level_map.groupings["layers"].members().tolist()):
            stages = {layer // (large // 2) for layer in group}
            assert stages == {small_layer // (small // 2)}, (group, small_layer)


def test_pipeline_layouts_that_do_not_fit_are_refused_at_startup(train_corpus, tmp_path):
    base = [f"data.path={train_corpus}", f"run_dir={tmp_path}", "parallel.pipeline=2"]
    for stage in (0, 2, 3):
        with pytest.raises(ConfigError, match=rf"^training\.zero_stage: {stage} with parallel\.pipeline=2: .*"
                                              r"pipelines run with training\.zero_stage=1$"):
            build_plan(load_run_config(RECIPE, [*base, f"training.zero_stage={stage}"]), world_size=2)
    # Layers 4 -> 1: the second level has fewer layers than stages. Refused by `train` before any
    # process group is made (this is a one-process world: making a 2-stage one would fail otherwise).
    cfg = load_run_config(RECIPE, [*base, "multilevel.levels=[{hidden: 2, heads: 2, ffn: 2, layers: 4}, "
                                          "{hidden: 1, heads: 1, ffn: 1, layers: 1}]"])
    with pytest.raises(ConfigError, match=r"^multilevel\.levels\[0\]\.layers: level 2 would have 1 layer\(s\), "
                                          r"which the parallel\.pipeline=2 stages cannot share equally"):
        train(cfg)
    cfg = load_run_config(RECIPE, [*base[:2], "parallel.pipeline=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline: 3 stages cannot share the 4 layers of the "
                                          r"level-1 model equally"):
        train(cfg)
