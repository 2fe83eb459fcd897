"""`msds report`: every marked table of the documents regenerated from its committed JSON, so that a
published figure has one source.

    msds report [--check] [--doc PATH ...] [--root DIR]

A marked table in a markdown file:

    <!-- table: benchmarks/results/<name>.json -->
    | generated | table |
    |---|---|
    <!-- end table -->

The command rewrites the lines between the two markers from the JSON (its path relative to the
repository root); everything else in the file is prose. `--check` changes nothing and exits 1
naming each table that differs from its JSON. The JSON file:

    {"title": "...", "setting": {"machine": ..., "versions": ..., "command": ..., "date": ...},
     "columns": [{"key": "flops", "label": "FLOPs saved (mean / worst)", "format": "mean_worst",
                  "digits": 1, "suffix": "%", "worst": "min"}, ...],
     "rows": [{"flops": [41.8, 48.5, 37.8], ...}], "source": "..."}

Column formats (`format`):
- absent: a string as is; a number with `digits` decimals (as written without `digits`) and `suffix`;
- `mean_worst`: a list of per-seed numbers as "mean / worst", each with `digits` and `suffix`; the
  worst is the list's `min` or `max` (`worst`, default min);
- `list`: a list of numbers as "a, b, c" with `digits` (and `suffix` after each, if given).
null renders "n/a" in every format, and so does a mean or worst over a list holding a null.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from msds.errors import MsdsError

DEFAULT_DOCS = ("BENCHMARKS.md", "README.md")
START = re.compile(r"^<!-- table: (\S+) -->\s*$")
END = "<!-- end table -->"
FORMATS = ("plain", "mean_worst", "list")
WORSTS = {"min": min, "max": max}
MISSING = "n/a"


@dataclass(frozen=True)
class Column:
    """One column of a results table: the row key it shows, its header and how a value renders."""
    key: str
    label: str
    format: str = "plain"
    digits: Optional[int] = None
    suffix: str = ""
    worst: str = "min"


@dataclass(frozen=True)
class ResultsTable:
    """A committed results file (benchmarks/results/<name>.json): its columns and rows."""
    path: str
    title: str
    columns: list[Column]
    rows: list[dict]


@dataclass(frozen=True)
class MarkedTable:
    """A marked table in a document: the JSON it names and the lines between its markers."""
    json_path: str
    first: int      # the index of the first line after the start marker
    end: int        # the index of the end marker


def _number(value, column: Column) -> str:
    if value is None:
        return MISSING
    if isinstance(value, str):
        return value
    return (str(value) if column.digits is None else f"{value:.{column.digits}f}") + column.suffix


def _mean_worst(values: list, column: Column) -> str:
    if any(v is None for v in values):
        return f"{MISSING} / {MISSING}"
    return f"{_number(statistics.fmean(values), column)} / {_number(WORSTS[column.worst](values), column)}"


def render_cell(value, column: Column) -> str:
    """One cell, by its column's format; a '|' in a string is escaped so that it stays one cell."""
    if value is None:
        return MISSING
    if column.format == "mean_worst":
        return _mean_worst(value, column)
    if column.format == "list":
        return ", ".join(_number(v, column) for v in value)
    return _number(value, column).replace("|", "\\|")


def render_table(table: ResultsTable) -> list[str]:
    """The markdown lines of a results table: the header, the rule, one line per row."""
    lines = ["| " + " | ".join(c.label for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    for row in table.rows:
        lines.append("| " + " | ".join(render_cell(row[c.key], c) for c in table.columns) + " |")
    return lines


def _column(spec: dict, path: str, index: int) -> Column:
    where = f"{path}: columns[{index}]"
    if not isinstance(spec, dict) or "key" not in spec or "label" not in spec:
        raise MsdsError(f"{where}: a column needs a \"key\" and a \"label\"; add them")
    column = Column(**{k: v for k, v in spec.items() if k in Column.__dataclass_fields__})
    if column.format not in FORMATS:
        raise MsdsError(f"{where}.format: unknown format {column.format!r}; use one of {', '.join(FORMATS)} "
                        f"(or add it to msds/bench/doc_tables.py)")
    if column.worst not in WORSTS:
        raise MsdsError(f"{where}.worst: {column.worst!r} is not min or max; give the direction that is worse")
    return column


def _check_rows(table: ResultsTable) -> None:
    for index, row in enumerate(table.rows):
        missing = [c.key for c in table.columns if c.key not in row]
        if missing:
            raise MsdsError(f"{table.path}: rows[{index}] has no {missing[0]!r}, which a column shows; add the key "
                            f"(null renders {MISSING})")
        lists = [c.key for c in table.columns if c.format != "plain" and not isinstance(row[c.key], (list, type(None)))]
        if lists:
            raise MsdsError(f"{table.path}: rows[{index}].{lists[0]} should be a list of numbers for its column's "
                            f"format; give the per-seed values")


def load_table(json_path: str, root: Path, doc: Path) -> ResultsTable:
    """The results file a marker names, read and checked; errors name the file and the fix."""
    path = root / json_path
    if not path.is_file():
        raise MsdsError(f"{doc}: the table marker names {json_path}, which does not exist under {root}; commit "
                        f"that results file or fix the marker's path (relative to the repository root)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MsdsError(f"{json_path}: not valid JSON ({exc}); fix the file") from None
    if not isinstance(data.get("columns"), list) or not isinstance(data.get("rows"), list):
        raise MsdsError(f"{json_path}: a results file needs \"columns\" and \"rows\" lists; add them")
    table = ResultsTable(json_path, data.get("title", ""),
                         [_column(spec, json_path, i) for i, spec in enumerate(data["columns"])], data["rows"])
    _check_rows(table)
    return table


def find_tables(lines: list[str], doc: Path) -> list[MarkedTable]:
    """Every marked table of a document, in order; an unclosed or nested marker is an error."""
    tables, open_at = [], None
    for index, line in enumerate(lines):
        start = START.match(line)
        if start and open_at is not None:
            raise MsdsError(f"{doc}:{open_at[0] + 1}: the table marker for {open_at[1]} has no {END!r} before the "
                            f"next marker (line {index + 1}); add it")
        if start:
            open_at = (index, start.group(1))
        elif line.strip() == END:
            if open_at is None:
                raise MsdsError(f"{doc}:{index + 1}: {END!r} without a table marker before it; remove it or add "
                                f"<!-- table: benchmarks/results/<name>.json --> above the table")
            tables.append(MarkedTable(open_at[1], open_at[0] + 1, index))
            open_at = None
    if open_at is not None:
        raise MsdsError(f"{doc}:{open_at[0] + 1}: the table marker for {open_at[1]} is never closed; add "
                        f"{END!r} after the table")
    return tables


@dataclass(frozen=True)
class Regenerated:
    """A document with its marked tables rendered: the new text, how many tables it marks, and the
    JSON paths of those that changed."""
    text: str
    tables: int
    changed: list[str]


def regenerate(text: str, doc: Path, root: Path) -> Regenerated:
    """The document with every marked table rendered from its JSON."""
    lines = text.split("\n")
    marked_tables = find_tables(lines, doc)
    changed = []
    for marked in reversed(marked_tables):
        rendered = render_table(load_table(marked.json_path, root, doc))
        if lines[marked.first:marked.end] != rendered:
            lines[marked.first:marked.end] = rendered
            changed.append(marked.json_path)
    return Regenerated("\n".join(lines), len(marked_tables), changed[::-1])


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def report(docs: list[Path], root: Path, check: bool) -> int:
    """Regenerate (or with `check`, compare) every marked table of `docs`; 1 when a check finds one
    that differs, else 0."""
    stale = []
    for doc in docs:
        if not doc.is_file():
            raise MsdsError(f"--doc: {doc} does not exist; give a markdown file (default: {', '.join(DEFAULT_DOCS)} "
                            f"in the repository root)")
        text = doc.read_text()
        result = regenerate(text, doc, root)
        stale += [f"{doc}: the table from {path} differs from its JSON" for path in result.changed]
        if not check and result.text != text:
            _write_atomically(doc, result.text)
        print(f"{doc}: {result.tables} table(s), {len(result.changed)} {'differ' if check else 'regenerated'}",
              flush=True)
    for line in stale if check else []:
        print(line, file=sys.stderr)
    if check and stale:
        print("run `msds report` to regenerate them (the JSON files are the source)", file=sys.stderr)
    return 1 if check and stale else 0


def _run(args) -> int:
    root = Path(args.root)
    docs = [Path(d) for d in args.doc] if args.doc else [root / d for d in DEFAULT_DOCS]
    return report(docs, root, args.check)


def add_parser(subparsers, name: str, doc: str) -> None:
    import argparse

    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming each table that differs from its JSON")
    parser.add_argument("--doc", nargs="+", metavar="PATH",
                        help=f"markdown files to regenerate (default: {' and '.join(DEFAULT_DOCS)} in --root)")
    parser.add_argument("--root", default=".", metavar="DIR",
                        help="the repository root, which the markers' JSON paths are relative to "
                             "(default: the current directory)")
    parser.set_defaults(run=_run)
