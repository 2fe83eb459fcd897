"""The one typed configuration tree of msds.

Every run is described by dataclasses, loaded from YAML (plus `key=value` overrides), checked
field by field before anything trains, and dumped into the run directory. Each field is documented
where it is declared, as megatron-core does for TransformerConfig.

Errors are `ConfigError`s whose message starts with the dotted path of the offending field
(`model.num_heads: ...`) and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown, mistyped or inconsistent."""


# --------------------------------------------------------------------------------------------
# Generic loading / dumping of dataclass trees
# --------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, path: str):
    """Convert a YAML value to the annotated type `tp`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of "
                          f"{', '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        val_tp = args[1] if args else Any
        return {k: _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data, path: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key; known keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{path}.{name}" if path else name)
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{missing[0]}: required, but not given")
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """A plain, YAML-serialisable copy of a dataclass tree."""
    return dataclasses.asdict(obj)


def set_by_path(data: dict, dotted_key: str, value) -> None:
    """Set `data[a][b][c] = value` for `dotted_key` 'a.b.c', creating mappings on the way."""
    keys = dotted_key.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted_key}: '{key}' is not a section, cannot set a key below it")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse `key.path=value` strings; values are read as YAML (numbers, booleans, lists)."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: an override must look like key.path=value")
        key, raw = item.split("=", 1)
        parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
    return parsed


def load_yaml(path: str | Path) -> dict:
    """A run or bench config (`--config`): the YAML file `path`, else the packaged recipe of that
    name (`demo` or `demo.yaml`, msds/resources.py), so an installed msds runs its recipes anywhere."""
    from msds import resources

    path = Path(path)
    if not path.is_file():
        packaged = resources.recipe(str(path))
        if packaged is None:
            raise ConfigError(f"--config: {path} is neither a file nor a packaged recipe; give a path to a "
                              f"YAML file or one of the packaged recipes: {', '.join(resources.recipe_names())}")
        path = packaged
    with open(path) as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping")
    return data


def dump_yaml(obj, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(obj), f, sort_keys=False)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

Arch = Literal["bert", "gpt"]


@dataclass
class ModelConfig:
    """Shape and numerics of one transformer (one level of a V-cycle)."""

    arch: Arch = "gpt"
    """`bert`: post-LN encoder with token types, embedding LayerNorm and an MLM head.
    `gpt`: pre-LN causal decoder with a final LayerNorm. Both tie the output head to the word
    embeddings."""
    vocab_size: int = 8192
    """The vocabulary: the token ids the model reads and predicts. The word embedding (and the tied
    output head) may have more rows: see make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: int = 128
    """Pad the word embedding's rows to a multiple of this times parallel.tensor, as Megatron does:
    every tensor-parallel rank then holds an equal slice, e.g. GPT-2's 50257 becomes 50304 at TP=1
    and 50432 at TP=2 (1 = pad only as far as parallel.tensor needs). The run plan derives the
    padded size; the padded rows start at zero, their logits are masked to -inf (never predicted, no
    gradient), transitions leave them as they are, and exports (`<run_dir>/model`,
    `msds convert-checkpoint`, `msds export-hf`) strip them."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    head_dim: int = 0
    """Channels per head; 0 means hidden_size / num_heads. Kept explicitly because coalescing merges
    heads without changing head_dim, so num_heads * head_dim may differ from hidden_size."""
    ffn_size: int = 0
    """Inner width of the MLP; 0 means 4 * hidden_size."""
    max_positions: int = 512
    """Rows of the learned position embedding (longest sequence)."""
    type_vocab_size: int = 2
    """Token-type (segment) embeddings, BERT only."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon (BERT uses 1e-12, GPT-2 1e-5)."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    """MLP activation: exact GELU (BERT) or its tanh approximation (GPT-2's `gelu_new`)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on each residual branch."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    nsp_head: bool = False
    """BERT only: add the pooler and next-sentence classifier."""
    init_from: str = ""
    """Start the run from these weights instead of random ones: an msds model directory (`msds
    import-hf`, `msds map`, a run's `<run_dir>/model`) or a Hugging Face BERT / GPT-2 directory,
    converted as `msds import-hf` converts it. They load into the run's first level (level 1, or
    the coarsest level of a grow-only run, `multilevel.start_level`), whose shape, arch, activation
    and norm_eps must be the checkpoint's (`msds plan` refuses a mismatch, naming the tensors);
    each rank reads only its pipeline stage's tensors (of an msds directory only its tensor-parallel
    slices of them; a Hugging Face one is converted whole first) and keeps its slices. The
    optimizer, learning-rate schedule and sampler start at step 0. Tensors the checkpoint lacks (the
    MLM head of a `BertModel`, the next-sentence head) keep their initialisation from
    training.seed, tensors the model lacks (a pooler) are ignored; `msds plan` and the start-up
    line list both. A run directory holding a training checkpoint resumes it instead
    (checkpoint.resume). Empty = random initialisation. docs/checkpoints.md, "Start from a
    pretrained model"."""

    def __post_init__(self):
        if self.head_dim == 0 and self.num_heads > 0 and self.hidden_size % self.num_heads == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.ffn_size == 0:
            self.ffn_size = 4 * self.hidden_size

    def validate(self, path: str = "model") -> "ModelConfig":
        for name in ("vocab_size", "make_vocab_size_divisible_by", "hidden_size", "num_layers", "num_heads",
                     "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{path}.{name}: must be positive, got {getattr(self, name)}")
        if self.head_dim <= 0:
            raise ConfigError(
                f"{path}.num_heads: hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}; choose a divisor or set head_dim explicitly")
        if self.ffn_size <= 0:
            raise ConfigError(f"{path}.ffn_size: must be positive, got {self.ffn_size}")
        if self.arch == "bert" and self.type_vocab_size <= 0:
            raise ConfigError(f"{path}.type_vocab_size: BERT needs at least one token type")
        if self.nsp_head and self.arch != "bert":
            raise ConfigError(f"{path}.nsp_head: the next-sentence head exists for BERT only")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{path}.{name}: must be in [0, 1), got {getattr(self, name)}")
        return self

    @property
    def attention_size(self) -> int:
        """Width of the concatenated heads (num_heads * head_dim)."""
        return self.num_heads * self.head_dim


# The fields that give a model's tensors their names and shapes.
SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "ffn_size",
                "max_positions", "type_vocab_size", "nsp_head")


# Named sizes. The paper's models, and small ones for CPU work.
MODEL_PRESETS: dict[str, dict] = {
    "bert-base": dict(arch="bert", vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12,
                      max_positions=512, norm_eps=1e-12, activation="gelu"),
    "bert-large": dict(arch="bert", vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16,
                       max_positions=512, norm_eps=1e-12, activation="gelu"),
    "gpt-base": dict(arch="gpt", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                     max_positions=1024, norm_eps=1e-5, activation="gelu_tanh"),
    "bert-small": dict(arch="bert", vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
                       max_positions=128, norm_eps=1e-12, activation="gelu"),
    "gpt-small": dict(arch="gpt", vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8,
                      max_positions=128, norm_eps=1e-5, activation="gelu_tanh"),
    "bert-tiny": dict(arch="bert", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                      max_positions=64, norm_eps=1e-12, activation="gelu"),
    "gpt-tiny": dict(arch="gpt", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                     max_positions=64, norm_eps=1e-5, activation="gelu_tanh"),
}


def expand_preset(model: dict, path: str = "model") -> dict:
    """A model section with its `preset` (a named size) replaced by the preset's fields; fields given
    next to the preset win."""
    model = dict(model)
    preset = model.pop("preset", None)
    if preset is None:
        return model
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"{path}.preset: unknown size {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    return {**MODEL_PRESETS[preset], **model}


def model_config(preset: Optional[str] = None, **overrides) -> ModelConfig:
    """A validated ModelConfig from a named size plus field overrides."""
    fields = expand_preset({"preset": preset, **overrides} if preset is not None else overrides)
    return from_dict(ModelConfig, fields, "model").validate()


# --------------------------------------------------------------------------------------------
# Training run
# --------------------------------------------------------------------------------------------

@dataclass
class DataConfig:
    """Where the tokenized corpus is and how samples are cut from it."""

    path: str = "data/default-bpe-8192"
    """Output directory of `msds data prepare`, or the prefix of a Megatron dataset (PATH.bin and
    PATH.idx, as Megatron's preprocess_data.py writes them; see `tokenizer` and `split`)."""
    seq_len: int = 128
    """Tokens per sample (GPT windows read seq_len + 1 tokens)."""
    seed: int = 1234
    """Seeds the sample order and BERT masking; the order depends only on (seed, epoch, position)."""
    blend: list[list[Any]] = field(default_factory=list)
    """A weighted mix of datasets, [[weight, path], ...], each path as `path` takes it; when given,
    `path` is not read. Samples are interleaved as megatron-core's BlendedDataset interleaves them
    (weights need not sum to 1), deterministically and resumably (msds/data/blend.py). Every
    dataset needs the same tokenizer."""
    tokenizer: str = ""
    """Megatron datasets only (they name no tokenizer): the tokenizer their ids come from, for the
    vocabulary size and special-token ids: gpt2, bert, a tokenizer.json file, or a prepared msds
    corpus directory that has it."""
    split: str = "969,30,1"
    """Megatron datasets only: train,valid,test weights cutting the documents into contiguous
    ranges, as Megatron's --split does (e.g. 969,30,1)."""
    sentence_order: bool = False
    """BERT: sentence-order prediction pairs (ALBERT's SOP): half of the samples swap segments A and
    B, and the next-sentence head (`model.nsp_head`, required) learns which; the loss, validation
    loss included, is masked-LM plus that cross entropy."""
    max_predictions_per_seq: int = 0
    """BERT: at most this many masked-LM predictions per sample (NVIDIA's BERT's
    max_predictions_per_seq), and the batch then carries their positions ([batch, this], padded
    with position 0, which has no label), so that the head gathers a fixed number of positions:
    static shapes, no host read of the mask's count (an accelerator's step waits for none and can be
    captured or compiled). A sample that draws more chosen tokens keeps the ones drawn first (the
    smallest draws), so its losses differ from the default's; with none capped the loss is the same
    up to summation order. 0 (default) = every chosen token, selected by a boolean mask (a host sync
    per forward). Evidence: docs/experiments/2026-12-06-host-overhead.md."""
    prefetch: int = 2
    """Training batches a background thread builds ahead of the step that takes them (0 = each batch
    built in the step, in the training thread). On CUDA they are built in pinned (page-locked) host
    memory, so that their copy to the GPU runs asynchronously. The same batches in the same order
    either way, and resuming is unaffected (the loader restarts from the trainer's consumed-sample
    count): tests/test_data.py::test_prefetched_batches_are_the_same_batches."""


@dataclass
class OptimizerConfig:
    """AdamW, run by DeepSpeed. The learning rate of each level is set in `multilevel.levels`."""

    lr: float = 1e-3
    """Peak learning rate of the full-size model (level 1)."""
    min_lr_ratio: float = 0.1
    """The decay (`schedule`) ends at this fraction of the peak, 0 to 1 (0: decay to zero)."""
    warmup_steps: int = 20
    """Linear warmup at the start of the run (and of each phase: `multilevel.phase_warmup_steps`)."""
    schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    """The learning rate after the warmup: `cosine` or `linear` decay from the peak to min_lr_ratio
    of it over the rest of the run (or phase, under `multilevel.lr_schedule: phase`); `wsd`
    (warmup-stable-decay): the peak held, then a linear decay to min_lr_ratio over the last
    `decay_fraction` of the run. A V-cycle under `wsd` wants `multilevel.lr_schedule: run`: its
    smaller levels then train in the stable stretch and the decay ends the run at full size (the
    plan refuses a decay that would start before the last, full-size phase). How the schedules
    compare, and how the saving moves with the budget: BENCHMARKS.md, "Against size and budget"."""
    decay_fraction: float = 0.2
    """`schedule: wsd` only: the share of the run's steps (of each phase's, under
    `multilevel.lr_schedule: phase`) over which the rate decays at the end, in (0, 1]; the warmup
    must end before the decay starts."""
    weight_decay: float = 0.01
    """Decoupled weight decay on weight matrices (not on biases, norms)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: off)."""


@dataclass
class TrainingConfig:
    """Batching, precision, the DeepSpeed engine and the stopping rule."""

    micro_batch_size: int = 16
    """Samples per data-parallel rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; global batch = micro_batch_size * grad_accum * dp size."""
    steps: int = 0
    """Optimizer steps of a run without multi-level training (the baseline; required there). With
    multilevel enabled the run length is the sum of `multilevel.phase_steps`; leave this 0, set it
    to that sum, or (with `multilevel.budget_steps`) to budget_steps."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Mixed precision as DeepSpeed implements it (fp16 with dynamic loss scaling)."""
    zero_stage: int = 1
    """ZeRO stage 0-3."""
    ds_config: str = ""
    """DeepSpeed JSON to start from; empty = ds_configs/zero{zero_stage}.json. The batch sizes,
    optimizer, clipping and precision of this config are filled in; values it sets that contradict
    them are an error."""
    seed: int = 1234
    """Seeds weight initialisation and dropout."""
    exit_after_steps: int = 0
    """Stop (after checkpointing) once this many steps have run in this process; 0 = never.
    Lets a job end cleanly before a time limit and resume later."""
    exit_signal: str = "SIGUSR1"
    """On this signal (e.g. Slurm's `--signal=USR1@120` before the time limit) every rank finishes
    its step, the run checkpoints and exits cleanly; `resume: auto` continues it. Empty = off."""
    max_bad_steps: int = 5
    """A step whose loss (averaged over data-parallel replicas) is NaN or infinite, or a spike (see
    `spike_factor`), is skipped: no update of the weights or Adam's moments, a `bad_step` record in
    metrics.jsonl (msds.train.guards). After this many bad steps in a row the run checkpoints and
    stops with an error. 0 = no checks: every step is applied. Pipelines too (docs/cluster.md,
    "Faults and what they cost")."""
    spike_factor: float = 0.0
    """A step whose loss exceeds this multiple of the mean loss of the last `spike_window` applied
    steps is a bad step (see `max_bad_steps`); more than 1, or 0 = off."""
    spike_window: int = 20
    """How many recent applied steps' losses `spike_factor` compares with; spikes are checked once
    that many steps have run."""
    compile: bool = False
    """torch.compile each transformer block (not the whole model, so ZeRO's hooks and the engines
    a V-cycle rebuilds at each transition keep working): every level's blocks are compiled when its
    engine is built, the first steps of each level pay the compilation. megatron-core's linear
    layers break a block's graph into several, and every level and evaluation (no_grad) compiles
    again: past torch._dynamo's recompile limit (8 per function) the functions over it run eagerly.
    Not with a pipeline, tensor parallelism or ZeRO 3 (the run plan refuses them). Evidence:
    benchmarks/gpu_check.py's `fast_step` section (BENCHMARKS.md, "The GPU check")."""
    hang_timeout_s: float = 1800.0
    """If no training step completes within this many seconds (start-up, evaluations, transitions
    and checkpoint writes included), every rank writes the stack of each of its threads to
    `<run_dir>/stacks/rank-<rank>.txt` and exits with status 1, so the job fails instead of hanging
    (docs/cluster.md, "Faults and what they cost"). 0 = off."""
    startup_timeout_s: float = 900.0
    """If a rank has not completed its first training step this many seconds after its `msds train`
    command started (imports, DeepSpeed's JIT-built ops, the rendezvous, the engine build, a resume and the
    first step), it writes the stack of each of its threads to `<run_dir>/stacks/rank-<rank>.txt`,
    prints one line naming what it waits on (a lock file and its age, the rendezvous address, the
    collectives of the engine build or first step) and exits with status 4, which slurm/train.sh
    does not requeue (docs/cluster.md, "Faults and what they cost"). The default leaves room for
    a first build of DeepSpeed's ops on a loaded machine. 0 = off."""


@dataclass
class LevelConfig:
    """One coarser level of the V-cycle, relative to the level above it."""

    hidden: int = 2
    """Factor by which the hidden size (residual width) shrinks."""
    heads: int = 2
    """Factor by which the number of heads shrinks (head_dim is kept)."""
    ffn: int = 2
    """Factor by which the MLP width shrinks."""
    layers: int = 2
    """Factor by which the number of layers shrinks."""
    layout: Literal["strided", "adjacent"] = "strided"
    """Width grouping: strided merges neuron j with j + n/g (the paper), adjacent merges g neighbours."""
    depth_layout: Literal["adjacent", "strided"] = "adjacent"
    """Layer grouping: adjacent merges consecutive layers (the paper), strided layer i with i + L/g."""
    lr: float = 0.0
    """Peak learning rate at this level; 0 = optimizer.lr times the product of the hidden and layers
    factors down to this level (4x for half width and half depth, the paper's rule). Tune
    optimizer.lr as for the baseline and keep this default: what decides a V-cycle's saving is a
    tuned full-size learning rate, not this factor (BENCHMARKS.md, "The speedup at the prototype
    scale"; docs/method.md §7)."""


@dataclass
class MultilevelConfig:
    """The V-cycle: levels, how long each phase lasts, and what happens at transitions."""

    enabled: bool = False
    levels: list[LevelConfig] = field(default_factory=lambda: [LevelConfig()])
    """Levels 2..K, each relative to the previous; K = len(levels) + 1."""
    phase_steps: list[int] = field(default_factory=list)
    """Steps of each phase, in order: level 1, 2, .., K, then K-1, .., 1 (2K - 1 phases per cycle,
    repeated for each cycle with the shared level-1 phase counted once between cycles). Leave it
    empty to size the V-cycle from `budget_steps` instead. A grow-only run (`start_level` K > 1) has
    K phases: levels K, K-1, .., 1."""
    budget_steps: int = 0
    """Size the V-cycle from its baseline: it spends the FLOPs of this many full-size (level-1)
    steps, e.g. the baseline recipe's training.steps. Every phase but the last lasts its
    `phase_fractions` share of budget_steps; the last (full-size) phase gets the steps that bring
    the run's FLOPs, transitions included, to the budget. 0 = use `phase_steps`. training.steps may
    stay the baseline's (equal to budget_steps): adding this section converts a baseline recipe."""
    phase_fractions: list[float] = field(default_factory=list)
    """With budget_steps: the length of every phase but the last, as fractions of budget_steps.
    Empty = the default for one cycle of two levels, [0.1, 0.8]: coalesce after 10% of the
    budget, train the small model for 80% of its steps (at half width and depth about a quarter of their
    FLOPs), then full size for the FLOPs left (the evidence: BENCHMARKS.md, "The speedup at the
    prototype scale"; docs/method.md §7.7). A grow-only
    run has no default: give its first K - 1 phases."""
    cycles: int = 1
    """How many V-cycles to run."""
    start_level: int = 1
    """1: V-cycles that start from the full-size model. K > 1, the coarsest level (len(levels) + 1):
    a grow-only run (docs/method.md §9): a fresh model of level K (initialised from training.seed, as
    any fresh model, or loaded from model.init_from) trains first, and the run only goes up, phases
    K, K-1, .., 1. Nothing was saved, so de-coalescing is not interpolated (alpha is unused): with
    `depth_layout: strided` a depth transition stacks the whole small model (G_stack), with
    `adjacent` it repeats each layer in place. Needs cycles = 1."""
    alpha: float = 0.75
    """Interpolation on the way up: large = (1 - alpha) * saved + alpha * de-coalesced. 0.75 is the
    value of the V-cycles that saved the most so far (docs/method.md §7); the paper used 0.25-0.5
    with Adam reset, which lost in the first measurements. For BERT 0.5 fine-tunes better and saves
    fewer FLOPs than 0.75 (docs/method.md §7.7)."""
    optimizer_policy: Literal["map", "reset"] = "map"
    """`map`: transform Adam's moments with the same grouping and keep the step count (the default:
    in the first measurements it decided between a saving and a loss, docs/method.md §7.2). `reset`:
    fresh optimizer state at every transition, as in the paper."""
    phase_warmup_steps: int = 48
    """Linear warmup at the start of every phase after the first, at most the phase's length. The
    default, 48, is a tenth of the 480-step budget it was chosen at, where a shorter re-warmup saved
    less or missed the reference's loss (BENCHMARKS.md, "The speedup at the prototype scale";
    docs/method.md §7.7). A run at another budget sets its own."""
    lr_schedule: Literal["phase", "run"] = "phase"
    """`phase`: every phase warms up to its level's peak and decays (optimizer.schedule) over its
    own steps. `run`: one schedule over the whole run, as the baseline's, scaled by each level's
    peak relative to optimizer.lr; after a transition the LR warms up to that curve over
    phase_warmup_steps. Under `optimizer.schedule: wsd` the decay must fall within the last,
    full-size phase."""
    shards: int = 0
    """Group heads and FFN inside each of this many contiguous shards (docs/method.md §2.3, shard-local
    grouping); 0 = the tensor-parallel size, so transitions need no tensor-parallel communication.
    Must be a multiple of parallel.tensor. Set it explicitly to keep the same grouping (and so the
    same training) when the tensor-parallel size changes."""
    transition_backend: Literal["auto", "torch"] = "auto"
    """What runs the transition operators: `auto` = the fused Triton kernels (msds/multilevel/
    backends.py) for CUDA tensors when triton is installed, PyTorch otherwise (always on a CPU);
    `torch` = PyTorch everywhere, the reference the kernels are checked against
    (benchmarks/gpu_check.py compares the two in training)."""


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Where checkpoints go; empty = <run_dir>/checkpoints."""
    interval: int = 0
    """Save every this many steps (0 = only at the end, at transitions if asked, and on exit)."""
    at_transitions: bool = False
    """Also save right after every level transition."""
    keep: int = 3
    """Complete checkpoints to keep (older ones are deleted)."""
    resume: Literal["auto", "never"] = "auto"
    """`auto`: continue from the latest complete checkpoint in `dir` if there is one."""
    layout_free: bool = True
    """Also write a layout-free copy of the training state (full fp32 weights, Adam moments, the
    V-cycle's saved levels) into every checkpoint, so that the run can resume on another data x
    tensor x pipeline layout (docs/cluster.md, "Coming back on fewer or more GPUs"). It adds about
    the size of the checkpoint's optimizer state and saved levels again, and the time to gather and
    write them; false saves that, and the checkpoint then resumes only on the layout that wrote it."""


@dataclass
class LoggingConfig:
    interval: int = 10
    """Print a progress line every this many steps (metrics.jsonl gets every step)."""
    eval_interval: int = 50
    """Validation loss every this many steps (and at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation (fixed across the run, so evaluations are comparable)."""
    eval_split: str = "valid"
    tensorboard: bool = True


@dataclass
class ParallelConfig:
    """How the model is split over processes; the rest of the world size is data parallelism."""

    tensor: int = 1
    """Tensor-parallel size (megatron-core layers): heads, FFN and vocabulary are split over this
    many ranks at every level, and transitions group heads and FFN inside each rank's shard."""
    pipeline: int = 1
    """Pipeline-parallel size (DeepSpeed's PipelineModule): each stage holds the same number of
    layers at every level (the first stage also the embeddings, the last the head), and transitions
    group layers inside each stage. Pipelines run with ZeRO stage 1 (see docs/parallelism.md)."""


@dataclass
class RunConfig:
    """A training run: everything `msds train` needs, from one YAML file plus overrides."""

    run_dir: str = "runs/default"
    """Receives config.yaml, metrics.jsonl, TensorBoard events and (by default) checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    multilevel: MultilevelConfig = field(default_factory=MultilevelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """RunConfig from a YAML file plus `key.path=value` overrides, with every field's type checked.
    Cross-field checks and derived values are the run plan's (msds.plan.build_plan)."""
    data = load_yaml(path) if path else {}
    for key, value in parse_overrides(list(overrides)):
        set_by_path(data, key, value)
    return run_config_from_dict(data)


def run_config_from_dict(data: dict, path: str = "") -> RunConfig:
    """RunConfig from a mapping whose `model` may name a `preset` (errors start with `path`)."""
    data = dict(data)
    if isinstance(data.get("model"), dict):
        data["model"] = expand_preset(data["model"], f"{path}model")
    return from_dict(RunConfig, data, path.rstrip("."))
