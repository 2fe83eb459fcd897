"""`model.init_from` in the run plan: which of a pretrained directory's tensors the run's first
level loads, which of its parameters it initialises (the checkpoint lacks them) and which of the
checkpoint's tensors it ignores (the model lacks them); a checkpoint that does not fit is refused.

What may differ between the checkpoint and the model are BERT's heads only (`head.*`: the MLM head
a `BertModel` lacks, the pooler and next-sentence head of `nsp_head`). Everything else (every
other tensor's presence and shape, and the fields below that change what the weights compute) must
be the same, or the run would not start from the function the checkpoint computes.
"""
from __future__ import annotations

from dataclasses import dataclass

from msds.config import SHAPE_FIELDS, ConfigError, ModelConfig
from msds.errors import MsdsError
from msds.model import pretrained
from msds.model.roles import expected_shapes

# The fields that must be the checkpoint's: its shape, and what its weights compute.
FIELDS = tuple(name for name in SHAPE_FIELDS if name != "nsp_head") + ("activation", "norm_eps")
SHOWN = 3   # tensors named in a refusal


@dataclass(frozen=True)
class InitFrom:
    """What a run started from `model.init_from` does with it (`msds plan` prints it)."""

    source: pretrained.Source
    level: int
    loaded: tuple[str, ...]
    initialised: tuple[str, ...]
    """Parameters of the model the checkpoint lacks: they keep their initialisation (training.seed)."""
    ignored: tuple[str, ...]
    """Tensors of the checkpoint the model lacks (msds names; a Hugging Face directory's unused
    tensors by their names there)."""


def _optional(name: str, cfg: ModelConfig) -> bool:
    """A tensor one side may lack: BERT's heads."""
    return cfg.arch == "bert" and name.startswith("head.")


def plan_init_from(path: str, cfg: ModelConfig, level: int, grow_only: bool) -> InitFrom:
    """The InitFrom of loading `path` into the level-`level` model `cfg`, or one ConfigError naming
    the tensors that do not fit and the fields to set."""
    try:
        source = pretrained.inspect(path)
    except MsdsError as exc:
        raise ConfigError(f"model.init_from: {exc}") from exc
    expected = expected_shapes(cfg)
    misfits = _misfits(source.shapes, expected, cfg)
    fields = [name for name in FIELDS if getattr(source.cfg, name) != getattr(cfg, name)
              and (name != "type_vocab_size" or cfg.arch == "bert")]
    if misfits or fields:
        raise ConfigError(_refusal(source, cfg, level, grow_only, misfits, fields))
    return InitFrom(source=source, level=level, loaded=tuple(sorted(set(expected) & set(source.shapes))),
                    initialised=tuple(sorted(set(expected) - set(source.shapes))),
                    ignored=tuple(sorted(set(source.shapes) - set(expected))) + source.unused)


def _misfits(found: dict[str, tuple], expected: dict[str, tuple], cfg: ModelConfig) -> list[str]:
    """Each tensor of the checkpoint (`found`) or the model (`expected`) that keeps the first from
    loading into the second."""
    misfits = [f"{name} is {found[name]} there, {expected[name]} here" for name in sorted(set(expected) & set(found))
               if found[name] != expected[name]]
    misfits += [f"{name} is missing there" for name in sorted(set(expected) - set(found)) if not _optional(name, cfg)]
    return misfits + [f"{name} has no place here" for name in sorted(set(found) - set(expected))
                      if not _optional(name, cfg)]


def describe(init: InitFrom) -> str:
    """What a run does with model.init_from, in one line (`msds plan`, the start-up line)."""
    return (f"{init.source.path} ({init.source.format}) into the level-{init.level} model: loads {len(init.loaded)} "
            f"tensors; initialises (training.seed): {', '.join(init.initialised) or 'none'}; ignores: "
            f"{', '.join(init.ignored) or 'none'}")


def _refusal(source: pretrained.Source, cfg: ModelConfig, level: int, grow_only: bool, misfits: list[str],
             fields: list[str]) -> str:
    """One line: what does not fit, and the fields that make it fit."""
    what = f"the level-{level} model (the first of this grow-only run)" if grow_only else "the model"
    found = [f"{name} {getattr(source.cfg, name)} there, {getattr(cfg, name)} here" for name in fields]
    if misfits:
        more = f" ({len(misfits)} tensors in all)" if len(misfits) > SHOWN else ""
        found.insert(0, "tensor " + "; ".join(misfits[:SHOWN]) + more)
    return (f"model.init_from: {source.path} ({source.format}, {source.cfg.arch}) does not fit {what}: "
            f"{'; '.join(found)}; {_fix(source.cfg, level, grow_only, fields)}, or another model.init_from")


def _fix(theirs: ModelConfig, level: int, grow_only: bool, fields: list[str]) -> str:
    if not fields:
        return "give a checkpoint of this model's shape"
    if grow_only:
        wanted = ", ".join(f"{name}={getattr(theirs, name)}" for name in fields)
        return f"choose model and multilevel.levels whose level-{level} model has {wanted} (the checkpoint's)"
    return "set " + ", ".join(f"model.{name}={getattr(theirs, name)}" for name in fields) + " (the checkpoint's)"
