"""Tensor parallelism: TP=2 trains exactly like TP=1 (V-cycle transitions included), transitions are
shard-local, TP=2 checkpoints convert to TP=1 and export to Hugging Face, and bad layouts are
refused at startup. The two-process runs come from the launch in tests/test_train.py."""
from pathlib import Path

import pytest
import torch
import transformers

from msds.checkpoint import load_into, load_model, model_tensors
from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config, model_config
from msds.model.roles import tensor_parallel_dim
from msds.model.transformer import Transformer
from msds.multilevel.operators import coalesce, decoalesce, plan_level
from msds.train.loop import train
from msds.train.metrics import read_metrics
from msds.train.schedule import level_maps
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "test-vcycle-gpt.yaml"
EXACT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
TOLERANCE = 1e-5   # absolute, on per-step losses of ~6: float reassociation of the split matmuls


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_tp2_vcycle_matches_tp1(two_process_results, train_corpus, tmp_path, arch):
    tp2 = two_process_results[f"{arch}-tp2"]
    recipe = RECIPE.with_name(f"test-vcycle-{arch}.yaml")
    # Same grouping as the TP=2 run: heads and FFN grouped inside 2 shards.
    cfg = load_run_config(recipe, [f"data.path={train_corpus}", f"run_dir={tmp_path / 'tp1'}",
                                   "logging.tensorboard=false", "multilevel.shards=2", *EXACT])
    train(cfg)
    tp1 = {str(r["step"]): r["loss"] for r in read_metrics(tmp_path / "tp1", "step")}
    assert len(tp1) == len(tp2["losses"]) == 30
    assert max(abs(tp1[k] - tp2["losses"][k]) for k in tp1) < TOLERANCE
    assert len(tp2["summary"]["transitions"]) == 4


def test_tp2_run_resumes_exactly(two_process_results):
    resumed = two_process_results["gpt-tp2-resumed"]
    assert resumed["first"]["summary"]["state"]["step"] == 12
    assert resumed["second"]["losses"] == two_process_results["gpt-tp2"]["losses"]


def test_tp2_checkpoint_converts_to_tp1_and_exports(two_process_results, tmp_path):
    run_dir = two_process_results["gpt-tp2"]["run_dir"]
    assert msds_main(["convert-checkpoint", f"{run_dir}/checkpoints", str(tmp_path / "tp1")]) == 0
    cfg, converted, _ = load_model(tmp_path / "tp1")
    _, exported_by_run, _ = load_model(f"{run_dir}/model")
    assert all(torch.equal(converted[k], exported_by_run[k]) for k in converted)
    assert msds_main(["export-hf", str(tmp_path / "tp1"), str(tmp_path / "hf")]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    model = Transformer(cfg).eval()
    load_into(model, converted)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


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
        level_maps(cfg)
    # FFN 6 split over 2 ranks cannot be halved inside each 3-wide shard.
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.tensor=2", "model.ffn_size=6",
                                   "multilevel.levels=[{hidden: 1, heads: 1, ffn: 2, layers: 1}]",
                                   "multilevel.phase_steps=[6,6,6]"])
    with pytest.raises(ConfigError, match=r"^multilevel\.levels\[0\]\.ffn: factor 2 does not divide ffn_size 6 "
                                          r"in each of 2 shards.*parallel\.tensor=2"):
        level_maps(cfg)
    # And a level-1 model the tensor-parallel size cannot split at all.
    cfg = load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.tensor=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.tensor: 3 does not divide num_heads 4 of the level-1 model"):
        level_maps(cfg)


def test_pipeline_parallel_is_refused_at_startup(train_corpus):
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline: 2; pipeline parallelism is not implemented"):
        load_run_config(RECIPE, [f"data.path={train_corpus}", "parallel.pipeline=2"])
