"""Runs started from a pretrained model (`model.init_from`, msds/plan/pretrained.py and
msds/train/init_from.py), from real checkpoints: GPTs trained by msds (exported to Hugging Face, or
as msds model directories) and the real all-MiniLM-L6-v2."""
import json
from pathlib import Path

import pytest

from msds.cli import main as msds_main
from msds.config import load_run_config
from msds.model.parity import minilm_dir
from msds.train.loop import train
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"
BERT = REPO / "recipes" / "test" / "test-vcycle-bert.yaml"
# Baselines without dropout (tensor and pipeline parallel runs draw it from other streams).
BASELINE = ["logging.tensorboard=false", "multilevel.enabled=false", "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0"]
# all-MiniLM-L6-v2's shape and numerics (its config.json).
MINILM = ["model.vocab_size=30522", "model.hidden_size=384", "model.num_heads=12", "model.ffn_size=1536",
          "model.num_layers=6", "model.max_positions=512", "model.norm_eps=1.0e-12", "model.activation=gelu"]


def _train(recipe: Path, run_dir: Path, *overrides: str) -> dict:
    """Train; the validation losses (step -> loss), the training losses and the transitions."""
    summary = train(load_run_config(recipe, [f"run_dir={run_dir}", *BASELINE, *overrides]))
    return {"val": {r["step"]: r["val_loss"] for r in read_metrics(run_dir, "eval")},
            "loss": {r["step"]: r["loss"] for r in read_metrics(run_dir, "step")},
            "final": summary.final_val_loss, "transitions": summary.transitions}


# The 4-layer source's vocabulary: 1025 entries pad to 1152 rows at TP=1 and to 1280 at TP=2.
VOCAB = "model.vocab_size=1025"


@pytest.fixture(scope="module")
def sources(train_corpus, tmp_path_factory):
    """Two GPTs trained by msds for 20 steps: 4 layers, exported to Hugging Face (`msds export-hf`),
    and 3 layers, kept as the msds model directory the run wrote."""
    work = tmp_path_factory.mktemp("init-from")
    data = f"data.path={train_corpus}"
    four = _train(GPT, work / "gpt4", data, "training.steps=20", VOCAB)
    assert msds_main(["export-hf", str(work / "gpt4" / "model"), str(work / "gpt4-hf")]) == 0
    three = _train(GPT, work / "gpt3", data, "training.steps=20", "model.num_layers=3")
    return {"work": work, "data": data, "gpt4": four, "hf": work / "gpt4-hf", "gpt3": three,
            "msds3": work / "gpt3" / "model"}


@pytest.fixture(scope="module")
def from_hf(sources):
    """A 2-step run started from the exported 4-layer GPT, on one process."""
    overrides = [sources["data"], "training.steps=2", VOCAB, f"model.init_from={sources['hf']}"]
    return overrides, _train(GPT, sources["work"] / "from-hf", *overrides)


def test_a_run_from_an_exported_gpt_starts_at_its_final_loss(sources, from_hf, capsys):
    """Step 0 of the new run (the loaded weights, before any update) is where the source ended; run
    again, the run resumes its own training checkpoint instead, and says so."""
    overrides, run = from_hf
    assert run["val"][0] == pytest.approx(sources["gpt4"]["final"], abs=1e-6)
    assert run["val"][2] < run["val"][0]   # it trains on from there
    _train(GPT, sources["work"] / "from-hf", *overrides)
    out = capsys.readouterr().out
    assert f"model.init_from ({sources['hf']}) is not loaded: the run continues from its own training checkpoint" in out
    assert "model.init_from: " not in out


def test_tensor_and_pipeline_parallel_and_zero3_ranks_load_their_shards(sources, from_hf, launch):
    """TP=2 (from the msds directory the source run wrote: each rank reads its slices, the
    vocabulary padded) and PP=2 start at TP=1's step-0 loss and train the same two steps (within
    1e-5); ZeRO 3 over two data-parallel ranks (another global batch) starts at the same loss."""
    overrides, reference = from_hf
    work = sources["work"] / "dist"
    work.mkdir()
    runs = {"tp2": ["parallel.tensor=2", f"model.init_from={sources['work'] / 'gpt4' / 'model'}"],
            "pp2": ["parallel.pipeline=2"], "zero3-dp2": ["training.zero_stage=3"]}
    (work / "runs.json").write_text(json.dumps({name: [*BASELINE, *overrides, *more] for name, more in runs.items()}))
    results = launch("init_from", 2, work)
    for name in runs:
        assert results[name]["val_losses"]["0"] == pytest.approx(reference["val"][0], abs=1e-5), name
    for name in ("tp2", "pp2"):
        losses = results[name]["losses"]
        assert [losses[str(s)] for s in (1, 2)] == pytest.approx([reference["loss"][s] for s in (1, 2)], abs=1e-5)
        assert results[name]["val_losses"]["2"] == pytest.approx(reference["val"][2], abs=1e-5)


def test_a_grow_only_run_from_a_3_layer_checkpoint_starts_where_the_operators_say(sources, tmp_path):
    """A 6-layer grow-only run whose level 2 (3 layers) loads the 3-layer checkpoint: step 0 is the
    checkpoint's final loss; after one step at a learning rate of 1e-9 the grown model's loss is the
    loss of the checkpoint de-coalesced offline by the same operators (`msds map decoalesce`)."""
    scheme = tmp_path / "scheme.json"
    scheme.write_text(json.dumps({"layers": 2}))
    assert msds_main(["map", "decoalesce", "--src", str(sources["msds3"]), "--out", str(tmp_path / "grown"),
                      "--scheme", str(scheme)]) == 0
    promised = _train(GPT, tmp_path / "promise", sources["data"], "training.steps=1", "model.num_layers=6",
                      f"model.init_from={tmp_path / 'grown'}")["val"][0]
    grown = _train(GPT, tmp_path / "grow", sources["data"], "model.num_layers=6", "multilevel.enabled=true",
                   "multilevel.levels=[{hidden: 1, heads: 1, ffn: 1, layers: 2, lr: 1.0e-9}]",
                   "multilevel.start_level=2", "multilevel.phase_steps=[1,1]",
                   f"model.init_from={sources['msds3']}")
    assert grown["val"][0] == pytest.approx(sources["gpt3"]["final"], abs=1e-6)
    (transition,) = grown["transitions"]
    assert transition["loss_after"] == pytest.approx(promised, abs=1e-5)
    assert abs(promised - sources["gpt3"]["final"]) > 1e-4   # growth in depth changes the function: 50x the tolerance


def _refusal(capsys, *argv: str) -> str:
    assert msds_main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


@pytest.mark.parametrize("overrides, expected", [
    (["model.ffn_size=128"], ["layers.0.mlp.fc1.weight is (256, 64) there, (128, 64) here",
                              "set model.ffn_size=256 (the checkpoint's)"]),
    (["model.num_layers=6"], ["tensor layers.4.attn.proj.bias is missing there", "set model.num_layers=4"]),
    (["model.arch=bert"], ["arch gpt there, bert here", "set model.arch=gpt"]),
    (["model.activation=gelu"], ["activation gelu_tanh there, gelu here", "set model.activation=gelu_tanh"]),
    (["model.num_layers=6", "multilevel.enabled=true", "multilevel.start_level=2", "multilevel.phase_steps=[1,1]",
      "multilevel.levels=[{hidden: 1, heads: 1, ffn: 1, layers: 2}]"],
     ["does not fit the level-2 model (the first of this grow-only run)",
      "choose model and multilevel.levels whose level-2 model has num_layers=4"]),
], ids=["shape", "layers", "arch", "activation", "grow-only"])
def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(sources, capsys, overrides, expected):
    argv = ["--config", str(GPT), *BASELINE, "training.steps=2", VOCAB, f"model.init_from={sources['hf']}", *overrides]
    err = _refusal(capsys, "plan", *argv)
    assert err.startswith("msds plan: error: model.init_from: ")
    assert all(piece in err for piece in expected), err
    if overrides == ["model.ffn_size=128"]:   # msds train refuses it the same way, before any process group
        assert _refusal(capsys, "train", *argv, f"run_dir={sources['work'] / 'refused'}") == \
            err.replace("msds plan", "msds train")


def test_a_directory_that_is_no_model_is_refused(capsys, tmp_path):
    err = _refusal(capsys, "plan", "--config", str(GPT), f"model.init_from={tmp_path}")
    assert err == (f"msds plan: error: model.init_from: {tmp_path}: expected a Hugging Face directory (config.json) "
                   f"or an msds checkpoint (config.yaml), found neither")


def test_plan_lists_what_a_run_from_minilm_loads_initialises_and_ignores(capsys):
    """A `BertModel` has no MLM head (initialised from training.seed) and a pooler (ignored)."""
    argv = ["plan", "--config", str(BERT), "multilevel.enabled=false", "training.steps=3", *MINILM,
            f"model.init_from={minilm_dir()}"]
    assert msds_main(argv) == 0
    out = capsys.readouterr().out
    assert (f"init_from: {minilm_dir()} (hf) into the level-1 model: loads 77 tensors; initialises (training.seed): "
            f"head.bias, head.norm.bias, head.norm.weight, head.transform.bias, head.transform.weight; ignores: "
            f"pooler.dense.bias, pooler.dense.weight; the optimizer, schedule and sampler start at step 0") in out
    assert msds_main([*argv, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["init_from"]
    assert len(facts["loaded"]) == 77 and "layers.5.attn.qkv.weight" in facts["loaded"]


def test_continued_pretraining_from_minilm_runs_below_a_random_initialisation(bert_corpus, tmp_path, capsys):
    """The real all-MiniLM-L6-v2 against a random BERT of its shape, three steps each on the same
    batches. A `BertModel` has no MLM head: the fresh one puts the first step's loss a little above
    the random model's (the pretrained embeddings, tied to the output, give an untrained head larger
    logits); from the second step on it is far below."""
    common = [f"data.path={bert_corpus}", "training.steps=3", *MINILM]
    pretrained = _train(BERT, tmp_path / "minilm", *common, f"model.init_from={minilm_dir()}")
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("training bert"))
    assert start.endswith(f"; model.init_from: {minilm_dir()} (hf) into the level-1 model: loads 77 tensors; "
                          f"initialises (training.seed): head.bias, head.norm.bias, head.norm.weight, "
                          f"head.transform.bias, head.transform.weight; ignores: pooler.dense.bias, pooler.dense.weight")
    scratch = _train(BERT, tmp_path / "random", *common)
    assert pretrained["val"][3] < scratch["val"][3] - 0.3
    assert pretrained["loss"][2] < scratch["loss"][2] and pretrained["loss"][3] < scratch["loss"][3]


def test_every_hugging_face_file_layout_plans_from_its_headers(sources, tmp_path):
    """The other layouts of the exported GPT (safetensors in shards with an index, as transformers
    writes them; pytorch_model.bin, as transformers 4 wrote it: torch.save of the state dict) give
    the plan the same tensors as model.safetensors; no weight is read for it."""
    import shutil

    import torch
    from transformers import GPT2LMHeadModel

    from msds.model import pretrained

    model = GPT2LMHeadModel.from_pretrained(sources["hf"])
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    shutil.copy(sources["hf"] / "config.json", tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    reference = pretrained.inspect(sources["hf"])
    for layout in ("bin", "shards"):
        source = pretrained.inspect(tmp_path / layout)
        assert (source.cfg, source.shapes, source.unused) == (reference.cfg, reference.shapes, reference.unused)
