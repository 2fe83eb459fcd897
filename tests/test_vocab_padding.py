"""Vocabulary padding as Megatron does it: the run plan pads model.vocab_size to a multiple of
make_vocab_size_divisible_by x parallel.tensor, so the paper-scale recipes run at TP 2, 4 and 8 with
the real vocabularies; padded rows are never predicted, exports strip them, transitions leave them.
The trained runs (a padded TP=2 V-cycle against the unpadded one-process run, its conversion and
export) are in tests/test_parallel.py."""
from pathlib import Path

import pytest
import torch
import transformers

from msds.config import ConfigError, load_run_config, model_config
from msds.model.files import load_model, model_tensors, save_model
from msds.model.hf import write_hf
from msds.model.transformer import Transformer
from msds.multilevel.operators import coalesce, decoalesce, plan_level
from msds.plan import build_plan

REPO = Path(__file__).resolve().parents[1]
PAPER_RECIPES = ["bert-base-vcycle2", "bert-large-baseline", "bert-large-vcycle2", "bert-large-vcycle3",
                 "gpt-base-baseline", "gpt-base-vcycle2"]
# Layouts the heads do not allow (12 heads over 8 ranks, or an odd number of heads per shard to
# halve): refused for their heads, whatever the vocabulary.
HEADS_REFUSE = {("bert-base-vcycle2", 4), ("bert-base-vcycle2", 8), ("bert-large-vcycle3", 8),
                ("gpt-base-baseline", 8), ("gpt-base-vcycle2", 4), ("gpt-base-vcycle2", 8)}


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("recipe", PAPER_RECIPES)
def test_paper_recipes_build_at_tensor_parallel_sizes_with_real_vocabularies(recipe, tp):
    cfg = load_run_config(REPO / "recipes" / "paper" / f"{recipe}.yaml", [f"parallel.tensor={tp}", "model.num_layers=4"])
    if (recipe, tp) in HEADS_REFUSE:
        with pytest.raises(ConfigError, match=r"heads"):
            build_plan(cfg, world_size=tp)
        return
    plan = build_plan(cfg, world_size=tp)
    vocab = {"bert": 30522, "gpt": 50257}[cfg.model.arch]
    assert plan.config.model.vocab_size == vocab
    padded = plan.padded_vocab_size
    assert padded % (128 * tp) == 0 and vocab <= padded < vocab + 128 * tp
    for level, model_cfg in enumerate(plan.levels, start=1):
        with torch.device("meta"):      # the real shapes, no memory
            model = Transformer(model_cfg, seed=level, padded_vocab_size=padded)
        assert tuple(model.embeddings.word.weight.shape) == (padded, model_cfg.hidden_size)
        if model_cfg.arch == "bert":
            assert tuple(model.head.bias.shape) == (padded,)


def test_padded_sizes_are_megatrons():
    def padded(vocab, tp, multiple=128):
        cfg = load_run_config(REPO / "recipes" / "paper" / "gpt-base-baseline.yaml",
                              [f"model.vocab_size={vocab}", f"model.make_vocab_size_divisible_by={multiple}",
                               f"parallel.tensor={tp}", "model.num_heads=16"])
        return build_plan(cfg, world_size=tp).padded_vocab_size

    assert padded(50257, 1) == 50304 and padded(50257, 2) == 50432 and padded(30522, 4) == 30720
    assert padded(1024, 8) == 1024              # already a multiple: nothing added
    assert padded(1025, 2, multiple=1) == 1026  # only what the tensor-parallel split needs


def test_make_vocab_size_divisible_by_must_be_positive():
    cfg = load_run_config(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml", ["model.make_vocab_size_divisible_by=0"])
    with pytest.raises(ConfigError, match=r"^model\.make_vocab_size_divisible_by: must be positive, got 0$"):
        build_plan(cfg)


def _pair(arch: str, vocab: int = 1000, padded: int = 1024):
    """The same model unpadded and padded (same seed), dropout off."""
    cfg = model_config(f"{arch}-tiny", vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)
    return cfg, Transformer(cfg, seed=7), Transformer(cfg, seed=7, padded_vocab_size=padded)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_padded_rows_are_never_predicted(arch):
    cfg, plain, padded = _pair(arch)
    vocab = cfg.vocab_size
    # The vocabulary's rows are the unpadded model's; the padding starts at zero.
    weight = padded.embeddings.word.weight
    assert torch.equal(weight[:vocab], plain.embeddings.word.weight) and not weight[vocab:].any()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = padded.eval()(ids)
        reference = plain.eval()(ids)
    assert logits.shape[-1] == 1024
    assert torch.isneginf(logits[..., vocab:]).all()
    assert torch.equal(logits.softmax(-1)[..., vocab:], torch.zeros(2, 16, 1024 - vocab))
    assert (logits[..., :vocab] - reference).abs().max() < 1e-5
    loss, plain_loss = padded.train()(ids, labels=labels), plain.train()(ids, labels=labels)
    assert abs(loss.item() - plain_loss.item()) < 1e-5
    loss.backward()
    plain_loss.backward()
    grad = padded.embeddings.word.weight.grad
    assert not grad[vocab:].any()              # no gradient reaches the padding
    assert (grad[:vocab] - plain.embeddings.word.weight.grad).abs().max() < 1e-6
    if arch == "bert":
        assert not padded.head.bias.grad[vocab:].any()


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_export_of_a_padded_model_has_the_unpadded_logits(arch, tmp_path):
    cfg, plain, padded = _pair(arch)
    with torch.no_grad():              # train-like: give the padding rows values an export must drop
        padded.embeddings.word.weight[cfg.vocab_size:] = 1.0
    write_hf(tmp_path / "hf", cfg, model_tensors(padded))
    hf_class = transformers.GPT2LMHeadModel if arch == "gpt" else transformers.BertForMaskedLM
    hf = hf_class.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == cfg.vocab_size
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs, unpadded = padded.eval()(ids)[..., :cfg.vocab_size], hf(ids).logits, plain.eval()(ids)
    assert theirs.shape[-1] == cfg.vocab_size
    assert (ours - theirs).abs().max() < 1e-5 and (unpadded - theirs).abs().max() < 1e-5


def test_transitions_leave_the_vocabulary_axis_alone():
    cfg = model_config("gpt-tiny", vocab_size=1000, num_layers=4)
    model = Transformer(cfg, seed=3, padded_vocab_size=1024)
    level = plan_level(cfg, hidden=2, heads=2, ffn=2, layers=2)
    large = model_tensors(model)
    small = coalesce(large, level)
    back = decoalesce(small, level)
    for tensors in (small, back):
        word = tensors["embeddings.word.weight"]
        assert word.shape[0] == 1024 and not word[1000:].any()
    # The small model's vocabulary rows are the large one's, averaged over hidden groups only.
    assert torch.equal(small["embeddings.word.weight"][:1000],
                       coalesce({k: v[:1000] if k == "embeddings.word.weight" else v for k, v in large.items()},
                                level)["embeddings.word.weight"])


def test_save_model_refuses_padded_tensors_without_the_strip(tmp_path):
    """Model checkpoints hold the vocabulary only: the padded tensors must go through the strip."""
    from msds.errors import MsdsError
    from msds.model.files import without_vocab_padding

    cfg = model_config("bert-tiny", vocab_size=1000)
    tensors = model_tensors(Transformer(cfg, seed=1, padded_vocab_size=1024))
    with pytest.raises(MsdsError, match=r"embeddings\.word\.weight has shape \(1024, 64\), expected \(1000, 64\)"):
        save_model(tmp_path / "a", cfg, tensors)
    save_model(tmp_path / "b", cfg, without_vocab_padding(cfg, tensors))
    _, loaded, _ = load_model(tmp_path / "b")
    assert loaded["embeddings.word.weight"].shape == (1000, 64) and loaded["head.bias"].shape == (1000,)
