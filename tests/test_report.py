"""`msds report`: the documents' tables generated from their results JSON, and checked against it."""
import json
import re
import tokenize
from pathlib import Path

import pytest

from msds.bench.doc_tables import DEFAULT_DOCS, START, Column, find_tables, render_cell
from msds.cli import main

ROOT = Path(__file__).resolve().parents[1]

RESULTS = {
    "title": "a caption", "setting": {"machine": "m", "versions": "v", "command": "c", "date": "2026-12-06"},
    "columns": [{"key": "arch", "label": "architecture"},
                {"key": "flops", "label": "FLOPs saved (mean / worst)", "format": "mean_worst", "digits": 1,
                 "suffix": "%", "worst": "min"},
                {"key": "flops", "label": "per seed", "format": "list", "digits": 1},
                {"key": "loss", "label": "final loss", "digits": 4}],
    "rows": [{"arch": "GPT", "flops": [41.8, 48.5, 37.8], "loss": 5.25164},
             {"arch": "a | b", "flops": [30.0, None], "loss": None}],
    "source": "a test",
}
TABLE = ["| architecture | FLOPs saved (mean / worst) | per seed | final loss |", "|---|---|---|---|",
         "| GPT | 42.7% / 37.8% | 41.8, 48.5, 37.8 | 5.2516 |",
         "| a \\| b | n/a / n/a | 30.0, n/a | n/a |"]


def test_each_format_renders():
    assert render_cell("as is", Column("k", "l")) == "as is"
    assert render_cell(3, Column("k", "l")) == "3"
    assert render_cell(2.5, Column("k", "l", digits=2, suffix=" s")) == "2.50 s"
    assert render_cell(None, Column("k", "l", digits=1)) == "n/a"
    assert render_cell([1.0, 3.0], Column("k", "l", "mean_worst", 1, "%", worst="max")) == "2.0% / 3.0%"
    assert render_cell([1.0, 3.0], Column("k", "l", "mean_worst", 0)) == "2 / 1"
    assert render_cell([1.25, 2.0], Column("k", "l", "list", 2)) == "1.25, 2.00"


def _repo(tmp_path: Path, results: dict = RESULTS, table: list[str] = ("| stale |",)) -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "t.json").write_text(json.dumps(results))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Report\n\nProse.\n<!-- table: benchmarks/results/t.json -->\n" + "\n".join(table)
                   + "\n<!-- end table -->\n\nMore prose.\n")
    (tmp_path / "README.md").write_text("# msds\n")
    return doc


def test_write_mode_regenerates_and_is_idempotent(tmp_path, capsys):
    doc = _repo(tmp_path)
    assert main(["report", "--root", str(tmp_path)]) == 0
    text = doc.read_text()
    assert text == ("# Report\n\nProse.\n<!-- table: benchmarks/results/t.json -->\n" + "\n".join(TABLE)
                    + "\n<!-- end table -->\n\nMore prose.\n")
    assert main(["report", "--root", str(tmp_path)]) == 0 and doc.read_text() == text
    assert main(["report", "--check", "--root", str(tmp_path)]) == 0
    assert f"{doc}: 1 table(s), 0 differ" in capsys.readouterr().out


def test_check_names_a_doctored_table_and_changes_nothing(tmp_path, capsys):
    doctored = [TABLE[0], TABLE[1], TABLE[2].replace("42.7%", "45.0%"), TABLE[3]]
    doc = _repo(tmp_path, table=doctored)
    before = doc.read_text()
    assert main(["report", "--check", "--root", str(tmp_path)]) == 1
    assert doc.read_text() == before
    err = capsys.readouterr().err
    assert f"{doc}: the table from benchmarks/results/t.json differs from its JSON" in err and "msds report" in err


@pytest.mark.parametrize("change, message", [
    (lambda r, d: d.write_text(d.read_text().replace("t.json", "gone.json")),
     r"BENCHMARKS\.md: the table marker names benchmarks/results/gone\.json, which does not exist"),
    (lambda r, d: r["rows"][0].pop("loss"), r"benchmarks/results/t\.json: rows\[0\] has no 'loss'.*add the key"),
    (lambda r, d: r["columns"][1].update(format="median"),
     r"t\.json: columns\[1\]\.format: unknown format 'median'; use one of plain, mean_worst, list"),
    (lambda r, d: d.write_text(d.read_text().replace("<!-- end table -->\n", "")),
     r"BENCHMARKS\.md:4: the table marker for benchmarks/results/t\.json is never closed; add '<!-- end table -->'"),
])
def test_bad_input_is_one_line_naming_the_file_and_the_fix(tmp_path, capsys, change, message):
    results = json.loads(json.dumps(RESULTS))
    doc = _repo(tmp_path, results)
    change(results, doc)
    (tmp_path / "benchmarks" / "results" / "t.json").write_text(json.dumps(results))
    before = doc.read_text()
    assert main(["report", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert doc.read_text() == before


def test_the_repository_s_tables_agree_with_their_json(capsys):
    """The one test that keeps BENCHMARKS.md and README.md from disagreeing with their JSON."""
    docs = [ROOT / d for d in DEFAULT_DOCS]
    marked = sum(len(find_tables(d.read_text().split("\n"), d)) for d in docs)
    if (ROOT / "benchmarks" / "results" / "report_headline.json").is_file():
        assert marked >= 2, "BENCHMARKS.md and README.md should each mark at least one table"
    assert main(["report", "--check", "--root", str(ROOT)]) == 0, capsys.readouterr().err
    assert all(START.match(line) is None or line.split()[2].startswith("benchmarks/results/")
               for d in docs for line in d.read_text().split("\n"))


def _prose(path: Path):
    """The comments and plain (not f-) string literals of a source file, with their line numbers."""
    with path.open() as source:
        for token in tokenize.generate_tokens(source.readline):
            prefix = token.string[:2].lower()
            if token.type == tokenize.COMMENT or token.type == tokenize.STRING and "f" not in prefix.strip("'\""):
                yield token.start[0], token.string


def test_no_measured_percentage_in_code_docs():
    """Docstrings and comments say what a setting does and where the evidence is (a BENCHMARKS.md
    section, a docs/ file), never a measured figure: a copied figure goes stale when a rerun moves
    it. A format string's percentage is not prose and does not count."""
    figure = re.compile(r"\d+\.\d+ ?%")
    quoted = [f"{path.relative_to(ROOT)}:{line}: {figure.search(text).group()}"
              for path in sorted((ROOT / "msds").rglob("*.py")) for line, text in _prose(path) if figure.search(text)]
    assert quoted == [], "measured figures in msds/ docstrings or comments; cite the BENCHMARKS.md section instead"
