"""The large corpus (`msds data prepare --corpus large`): the .deb reader, its kernel-documentation
and dictionary parts, the fetch of Debian packages, and the `--corpus` flag.

No network: every .deb is built here as a real one (an ar archive of debian-binary, control.tar.xz
and data.tar.xz), and apt-get is a stand-in on PATH that copies those files or fails as told.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import re
import sys
import tarfile
from pathlib import Path

import pytest

from msds.cli import main
from msds.data import sources
from msds.data.sources import LARGE_CORPUS, CorpusPart, RegistryArchive, SkipCounts, ar_members
from msds.errors import MsdsError

DOC = "./usr/share/doc/linux-doc-6.1/"
DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _part(name: str) -> CorpusPart:
    return next(part for part in LARGE_CORPUS if part.name == name)


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    """An ar archive as dpkg-deb writes it: 60-byte headers, members padded to even offsets."""
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode("ascii")
        out += data + b"\n" * (len(data) % 2)
    return bytes(out)


def _tar_xz(files: dict[str, bytes], symlinks: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return buffer.getvalue()


def _deb(path: Path, files: dict[str, bytes], symlinks: dict[str, str] | None = None) -> Path:
    control = _tar_xz({"./control": b"Package: tiny\nVersion: 1.0-1\nArchitecture: all\n"})
    path.write_bytes(_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", control),
                          ("data.tar.xz", _tar_xz(files, symlinks))]))
    return path


KERNEL_DOCS = {
    DOC + "Documentation/index.rst.gz": gzip.compress(b"The Linux kernel\n================\n\nStart here.\n"),
    DOC + "Documentation/admin-guide/README.rst.gz": gzip.compress(b"README\n======\n\nBuild it.\n"),
    DOC + "Documentation/translations/it_IT/index.rst.gz": gzip.compress(b"Il kernel Linux\n===\n"),
    DOC + "Documentation/translations/index.rst.gz": gzip.compress(b"Translations\n===\n"),
    DOC + "Documentation/admin-guide/kernel-parameters.txt.gz": gzip.compress(b"not reST\n"),
    DOC + "html/_sources/index.rst.txt": b"The Linux kernel\n================\n\nStart here.\n",
}


def _dictd_number(value: int) -> str:
    digits = ""
    while True:
        value, digit = divmod(value, 64)
        digits = DICTD_DIGITS[digit] + digits
        if not value:
            return digits


def _dictionary(entries: list[tuple[list[str], bytes]], seed: int = 0) -> tuple[bytes, bytes]:
    """(dict text, index) as dictfmt writes them; index lines in shuffled order (a real index is
    sorted by headword, not by place in the file)."""
    text, lines = b"", []
    for headwords, body in entries:
        lines += [f"{word}\t{_dictd_number(len(text))}\t{_dictd_number(len(body))}" for word in headwords]
        text += body + b"\n"
    random.Random(seed).shuffle(lines)
    return text, ("\n".join(lines) + "\n").encode("utf-8")


def _word_entry(number: int) -> tuple[list[str], bytes]:
    return [f"word{number:03d}"], (f"word{number:03d} \\Word{number}\\ n.\n   Definition {number}.\n"
                                   f"      Continued {number}.\n   [1913 Webster]\n").encode("utf-8")


def _word_text(number: int) -> str:
    """What the reader keeps of _word_entry(number): dictfmt's 3-space indent removed, no more."""
    return f"word{number:03d} \\Word{number}\\ n.\nDefinition {number}.\n   Continued {number}.\n[1913 Webster]"


def _gcide_deb(path: Path, words: int, bad_word: int | None = None) -> Path:
    entries = [(["00-database-info", "00-gcide-info"], b"00-database-info\n   Converted; LICENCE TEXT\n"),
               (["00-database-short"], b"00-database-short\n   Tiny dictionary\n")]
    entries += [_word_entry(n) for n in range(words)]
    entries[2][0].append("zero")  # a second headword of the same entry: the entry comes once
    if bad_word is not None:
        headwords, body = entries[2 + bad_word]
        entries[2 + bad_word] = (headwords, body.replace(b"Definition", b"Defini\x92tion"))
    text, index = _dictionary(entries)
    return _deb(path, {"./usr/share/dictd/gcide.dict.dz": gzip.compress(text),
                       "./usr/share/dictd/gcide.index": index,
                       "./usr/share/doc/dict-gcide/copyright": b"GPL\n"})


# --------------------------------------------------------------------------------------------
# Reading the packages
# --------------------------------------------------------------------------------------------

def test_ar_reader_gives_each_member_whole_across_odd_sizes(tmp_path):
    members = [("debian-binary", b"2.0\n"), ("odd", b"x" * 7), ("data.tar.xz", b"\n" * 3), ("last/", b"end")]
    path = tmp_path / "odd.deb"
    path.write_bytes(_ar(members))
    assert ar_members(path) == {"debian-binary": b"2.0\n", "odd": b"x" * 7, "data.tar.xz": b"\n" * 3,
                                "last": b"end"}
    path.write_bytes(_ar(members)[:-3])
    with pytest.raises(MsdsError, match="ar member last ends past the end of the file"):
        ar_members(path)


def test_kernel_docs_one_document_per_rst_file_without_translations(tmp_path):
    deb = _deb(tmp_path / "linux-doc.deb", KERNEL_DOCS,
               symlinks={DOC + "Documentation/Changes.rst.gz": "admin-guide/README.rst.gz"})
    skipped = SkipCounts()
    documents = list(_part("linux_doc").read(deb, skipped))
    # In path order; not the translations, the html/_sources copies, other files or the symlink.
    assert [d.text for d in documents] == ["README\n======\n\nBuild it.",
                                           "The Linux kernel\n================\n\nStart here."]
    assert {d.source for d in documents} == {"linux_doc"} and skipped.as_dict() == {"empty": 0, "non_utf8": 0}


def test_dictionary_documents_are_blocks_of_32_entries_without_dictd_overhead(tmp_path):
    deb = _gcide_deb(tmp_path / "gcide.deb", words=70, bad_word=40)
    skipped = SkipCounts()
    documents = [d.text for d in _part("gcide").read(deb, skipped)]
    # Blocks of entries 0-31, 32-63 (dropped: entry 40 is not UTF-8) and the last 6, in file order.
    assert documents == ["\n\n".join(_word_text(n) for n in range(0, 32)),
                         "\n\n".join(_word_text(n) for n in range(64, 70))]
    assert skipped.non_utf8 == 1
    assert not any("00-database" in text or "LICENCE" in text for text in documents)


@pytest.mark.parametrize("member", ["./usr/../../etc/passwd", "/etc/passwd"])
def test_a_data_member_outside_the_package_is_refused(tmp_path, member):
    deb = _deb(tmp_path / "evil.deb", {**KERNEL_DOCS, member: b"root:x:0:0\n"})
    with pytest.raises(MsdsError, match=f"member '{member}' points outside the package"):
        list(_part("linux_doc").read(deb, SkipCounts()))


def test_an_ar_member_with_a_path_is_refused(tmp_path):
    path = tmp_path / "evil.deb"
    path.write_bytes(_ar([("debian-binary", b"2.0\n"), ("../data.tar.xz", _tar_xz(KERNEL_DOCS))]))
    with pytest.raises(MsdsError, match=r"ar member name '\.\./data\.tar\.xz' is not a plain"):
        list(_part("linux_doc").read(path, SkipCounts()))


# --------------------------------------------------------------------------------------------
# Fetching: a stand-in apt-get
# --------------------------------------------------------------------------------------------

FAKE_APT = """#!{python}
import os, shutil, signal, sys
name, version = sys.argv[2].split("=")
with open(os.environ["FAKE_APT_LOG"], "a") as log:
    log.write(os.getcwd() + " " + " ".join(sys.argv[1:]) + "\\n")
source = os.path.join(os.environ["FAKE_APT_DEBS"], f"{{name}}_{{version}}_all.deb")
mode = os.environ["FAKE_APT_MODE"]
if mode == "missing" or not os.path.exists(source):
    sys.exit(f"E: Unable to locate package {{name}}")
data = open(source, "rb").read()
with open(f"{{name}}_{{version}}_all.deb", "wb") as target:
    target.write(data[: len(data) // 2] if mode == "killed" else data)
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def fake_apt(tmp_path, monkeypatch) -> Path:
    """An apt-get on PATH that serves the .debs put in the returned folder (FAKE_APT_MODE ok), says
    it cannot find the package (missing), or writes half of it and dies by SIGKILL (killed)."""
    folder, bin_dir = tmp_path / "debs", tmp_path / "bin"
    folder.mkdir()
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT.format(python=sys.executable))
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APT_DEBS", str(folder))
    monkeypatch.setenv("FAKE_APT_LOG", str(tmp_path / "apt.log"))
    monkeypatch.setenv("FAKE_APT_MODE", "ok")
    return folder


def _pinned(deb: Path, requirement: str) -> RegistryArchive:
    return RegistryArchive("debian", requirement, deb.name, hashlib.sha256(deb.read_bytes()).hexdigest())


def test_a_download_killed_half_way_does_not_poison_the_next_fetch(tmp_path, fake_apt, monkeypatch):
    deb = _deb(fake_apt / "tiny-doc_1.0-1_all.deb", KERNEL_DOCS)
    archive, cache = _pinned(deb, "tiny-doc=1.0-1"), tmp_path / "cache"
    monkeypatch.setenv("FAKE_APT_MODE", "killed")
    with pytest.raises(MsdsError, match=r"could not download tiny-doc=1\.0-1 \(exit code -9\)"):
        archive.fetch(cache)
    assert list(cache.iterdir()) == [], "the half-written file went with its scratch folder"
    # A kill of msds itself leaves its scratch folder, with the half file in it, behind.
    (cache / ".download-killed").mkdir()
    (cache / ".download-killed" / deb.name).write_bytes(deb.read_bytes()[:1000])
    monkeypatch.setenv("FAKE_APT_MODE", "ok")
    assert archive.fetch(cache).read_bytes() == deb.read_bytes()
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith(f"{cache.absolute()}/.download-") and
                                   c.endswith(" download tiny-doc=1.0-1") for c in calls)
    assert archive.fetch(cache) == cache / deb.name and len(calls) == 2, "the cached archive is reused"


def test_a_package_apt_cannot_find_is_one_line_naming_the_fix(tmp_path, fake_apt, monkeypatch):
    monkeypatch.setenv("FAKE_APT_MODE", "missing")
    archive = RegistryArchive("debian", "tiny-doc=1.0-1", "tiny-doc_1.0-1_all.deb", "0" * 64)
    with pytest.raises(MsdsError) as failure:
        archive.fetch(tmp_path / "cache")
    message = str(failure.value)
    assert "\n" not in message and "(E: Unable to locate package tiny-doc)" in message
    assert "`apt-get update` first" in message and "`apt-cache policy tiny-doc`" in message
    assert f"run: cd {tmp_path / 'cache'} && apt-get download tiny-doc=1.0-1" in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_cached_package_with_another_sha256_is_refused(tmp_path, fake_apt):
    archive, cache = _part("gcide").archive, tmp_path / "cache"
    cache.mkdir()
    _gcide_deb(cache / archive.filename, words=3)
    pinned = rf"{re.escape(archive.filename)}: sha256 [0-9a-f]{{64}} differs from the pinned {archive.sha256}"
    with pytest.raises(MsdsError, match=rf"{pinned} of dict-gcide=0\.48\.5\+nmu2; delete the file"):
        archive.fetch(cache)
    assert not (tmp_path / "apt.log").exists(), "a cached file is checked, not downloaded again"


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("corpus", ["large", "default"])
@pytest.mark.parametrize("files", [["--text-files", "docs/*.txt"], ["--jsonl", "docs.jsonl"]])
def test_corpus_with_own_files_is_one_line_naming_both_flags(tmp_path, capsys, corpus, files):
    argv = ["data", "prepare", "--tokenizer", "bpe-1024", "--corpus", corpus, *files, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--corpus {corpus} and {files[0]} both choose the input" in error
    assert "drop one of them" in error and not (tmp_path / "o").exists()


def test_large_corpus_manifest_names_the_corpus_and_its_pinned_parts(tmp_path, fake_apt, monkeypatch, capsys):
    """`--corpus large` end to end on small packages of the same layout, fetched through apt-get:
    the manifest's request says which corpus and which parts (requirement with the version, file,
    sha256), and each part's documents are counted."""
    docs = _deb(fake_apt / "linux-doc-6.1_6.1.176-1_all.deb", KERNEL_DOCS)
    gcide = _gcide_deb(fake_apt / "dict-gcide_0.48.5+nmu2_all.deb", words=32 * 400)
    parts = tuple(CorpusPart(part.name, _pinned(deb, part.archive.requirement), part.read)
                  for part, deb in ((_part("linux_doc"), docs), (_part("gcide"), gcide)))
    monkeypatch.setitem(sources.CORPORA, "large", sources.Corpus(parts, None))
    out = tmp_path / "large"
    assert main(["data", "prepare", "--tokenizer", "bpe-300", "--corpus", "large", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    inputs = manifest["request"]["inputs"]
    assert inputs["kind"] == "large"
    assert inputs["sources"] == [
        {"name": "linux_doc", "registry": "debian", "requirement": "linux-doc-6.1=6.1.176-1",
         "file": docs.name, "sha256": hashlib.sha256(docs.read_bytes()).hexdigest()},
        {"name": "gcide", "registry": "debian", "requirement": "dict-gcide=0.48.5+nmu2",
         "file": gcide.name, "sha256": hashlib.sha256(gcide.read_bytes()).hexdigest()}]
    assert [(s["name"], s["documents"]) for s in manifest["sources"]] == [("linux_doc", 2), ("gcide", 400)]
    assert sum(manifest["splits"][split]["documents"] for split in ("train", "valid", "test")) == 402
