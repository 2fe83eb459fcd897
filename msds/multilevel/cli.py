"""`msds map`: coalesce, de-coalesce and interpolate checkpoints offline, on the CPU.

    msds map coalesce    --src LARGE --out SMALL --scheme FILE
    msds map decoalesce  --src SMALL --out LARGE [--scheme FILE]
    msds map interpolate --src SMALL_OR_LARGE --saved LARGE --alpha A --out LARGE

Directories are Hugging Face (`config.json`) or msds checkpoints (`config.yaml`); the output has the
input's format. `coalesce` stores the level (`multilevel.json`: configs and groupings) with the small
model, so that `decoalesce` needs no scheme and uses exactly the coalescing's groupings; `--scheme`
there is only for small models without that record. `interpolate` de-coalesces `--src` first unless
it already has the saved model's shape, then mixes (1 - A) * saved + A * de-coalesced; its output
keeps the saved model's level record, for the next de-coalescing of a deeper V-cycle.

A scheme file is JSON, in the authors' format (`width_scheme`, `depth_scheme`: lists of head and
layer groups) or msds's (`hidden`, `heads`, `ffn`, `layers` factors, `layout`, `depth_layout`).
Outputs are written to a temporary directory renamed at the end; inputs are only read.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from msds.model.files import LEVEL_FILE, atomic_directory, load_model, write_model_files
from msds.config import SHAPE_FIELDS, ModelConfig
from msds.errors import MsdsError
from msds.model.hf import read_hf, write_hf
from msds.model.pretrained import HUGGING_FACE, MSDS, directory_format
from msds.multilevel.operators import (AUTHORS_KEYS, LevelMap, check_alpha, coalesce, decoalesce,
                                       interpolate, level_from_scheme)


def _shape(cfg: ModelConfig) -> dict:
    return {field: getattr(cfg, field) for field in SHAPE_FIELDS}


def _read(src: str) -> tuple[str, ModelConfig, dict, dict | None]:
    """(format, config, tensors, level record or None) of an HF or msds directory."""
    path = Path(src)
    if directory_format(path) == MSDS:
        cfg, tensors, level = load_model(path)
        return MSDS, cfg, tensors, level
    cfg, tensors = read_hf(path, report=print)           # e.g. a fresh MLM head for a BertModel
    level_path = path / LEVEL_FILE
    return HUGGING_FACE, cfg, tensors, json.loads(level_path.read_text()) if level_path.is_file() else None


def _write(out: str, fmt: str, cfg: ModelConfig, tensors: dict, level: dict | None) -> None:
    with atomic_directory(out) as tmp:
        if fmt == MSDS:
            write_model_files(tmp, cfg, tensors, level=level)
            return
        write_hf(tmp, cfg, tensors, overwrite=True)   # replaces the (empty) temporary directory
        if level is not None:
            (tmp / LEVEL_FILE).write_text(json.dumps(level, indent=1))


def _read_scheme(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MsdsError(f"--scheme: {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise MsdsError(f"--scheme: {path} is not valid JSON ({exc})") from None


def _scheme_factors(scheme: dict) -> dict[str, int]:
    """The factor per axis that a scheme applies (1 where it does not resize or is malformed:
    level_from_scheme then names the bad field)."""
    def factor(value) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    if not isinstance(scheme, dict):
        return dict.fromkeys(("hidden", "heads", "ffn", "layers"), 1)
    if any(key in scheme for key in AUTHORS_KEYS):
        def group_size(key):
            groups = scheme.get(key)
            return factor(len(groups[0])) if isinstance(groups, list) and groups and isinstance(groups[0], list) else 1
        width = group_size("width_scheme")
        return {"hidden": width, "heads": width, "ffn": width, "layers": group_size("depth_scheme")}
    return {axis: factor(scheme.get(axis, 1)) for axis in ("hidden", "heads", "ffn", "layers")}


def _level_for_small(src: str, cfg: ModelConfig, record: dict | None, scheme_file: str | None) -> LevelMap:
    """The level whose small model `src` is: its stored record, or --scheme applied to the large
    config that the scheme's factors imply."""
    if record is not None and scheme_file is not None:
        raise MsdsError(f"--scheme: {src} carries its level ({LEVEL_FILE}); drop --scheme so that "
                        f"de-coalescing uses the groupings coalescing used")
    if record is not None:
        level = LevelMap.from_dict(record, f"{src}/{LEVEL_FILE}")
    elif scheme_file is not None:
        scheme = _read_scheme(scheme_file)
        factors = _scheme_factors(scheme)
        large = dataclasses.replace(
            cfg, hidden_size=cfg.hidden_size * factors["hidden"], num_heads=cfg.num_heads * factors["heads"],
            ffn_size=cfg.ffn_size * factors["ffn"], num_layers=cfg.num_layers * factors["layers"])
        level = level_from_scheme(large, scheme, "--scheme")
    else:
        raise MsdsError(f"--scheme: {src} has no {LEVEL_FILE} (it was not written by msds map "
                        f"coalesce); pass the scheme it was coalesced with")
    if _shape(level.small) != _shape(cfg):
        raise MsdsError(f"{src}: its model {_shape(cfg)} is not the small model of the level "
                        f"{_shape(level.small)}; shapes disagree, pass the checkpoint this level produced")
    return level


def run_coalesce(args) -> int:
    scheme = _read_scheme(args.scheme)
    fmt, cfg, tensors, _ = _read(args.src)
    level = level_from_scheme(cfg, scheme, "--scheme")
    _write(args.out, fmt, level.small, coalesce(tensors, level), level.to_dict())
    print(f"coalesced {args.src} -> {args.out}: {_summary(level.large)} -> {_summary(level.small)}")
    return 0


def run_decoalesce(args) -> int:
    fmt, cfg, tensors, record = _read(args.src)
    level = _level_for_small(args.src, cfg, record, args.scheme)
    _write(args.out, fmt, level.large, decoalesce(tensors, level), None)
    print(f"de-coalesced {args.src} -> {args.out}: {_summary(level.small)} -> {_summary(level.large)}")
    return 0


def run_interpolate(args) -> int:
    check_alpha(args.alpha, "--alpha")                    # before reading anything
    fmt, cfg, tensors, record = _read(args.src)
    _, saved_cfg, saved, saved_record = _read(args.saved)
    if _shape(cfg) != _shape(saved_cfg):
        level = _level_for_small(args.src, cfg, record, args.scheme)
        if _shape(level.large) != _shape(saved_cfg):
            raise MsdsError(f"--saved: {args.saved} holds {_shape(saved_cfg)}, but {args.src} de-coalesces "
                            f"to {_shape(level.large)}; shapes disagree, pass the large model saved "
                            f"before coalescing")
        tensors = decoalesce(tensors, level)
    _write(args.out, fmt, saved_cfg, interpolate(tensors, saved, args.alpha), saved_record)
    print(f"interpolated {args.src} with {args.saved} (alpha {args.alpha}) -> {args.out}")
    return 0


def _summary(cfg: ModelConfig) -> str:
    return f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, ffn {cfg.ffn_size}"


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__.split("\n\n")[0])
    ops = parser.add_subparsers(dest="map_op", metavar="OP", required=True)
    specs = {
        "coalesce": ("large model -> small model, as --scheme says", run_coalesce),
        "decoalesce": ("small model -> large model, with the level stored by coalesce", run_decoalesce),
        "interpolate": ("(1 - alpha) * saved + alpha * de-coalesced --src", run_interpolate),
    }
    for op, (help_text, run) in specs.items():
        sub = ops.add_parser(op, help=help_text, description=help_text)
        sub.add_argument("--src", required=True, metavar="DIR", help="input directory (HF or msds)")
        sub.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist)")
        sub.add_argument("--scheme", metavar="FILE", required=op == "coalesce",
                         help="JSON scheme: the authors' width_scheme/depth_scheme, or msds's factors, "
                              "e.g. {\"hidden\": 2, \"heads\": 2, \"ffn\": 2, \"layers\": 2}")
        if op == "interpolate":
            sub.add_argument("--saved", required=True, metavar="DIR",
                             help="the large model saved before coalescing")
            sub.add_argument("--alpha", required=True, type=float, metavar="A",
                             help="weight of the de-coalesced model, in [0, 1]")
        sub.set_defaults(run=run)
