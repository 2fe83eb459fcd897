"""`msds train`: one DeepSpeed job that walks the V-cycle without stopping.

    msds train --config recipes/NAME.yaml [key=value ...]                      # one process
    torchrun --nproc_per_node 2 -m msds.cli train --config ...                  # data parallel
    deepspeed --num_gpus 2 --module msds.cli train --config ...

The loop asks `transition.py` for the next level's engine at each phase boundary; the data order
and the consumed-sample counter run on across transitions, so a V-cycle run and its baseline see
the same samples in the same order.
"""
from __future__ import annotations

import argparse
import math
import resource
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from msds.checkpoint import save_model
from msds.config import ConfigError, RunConfig, dump_yaml, load_run_config
from msds.data import eval_batches, load_tokenizer_info, train_batches
from msds.distributed import data_parallel_group, init_distributed
from msds.model.roles import expected_shapes
from msds.multilevel.operators import LevelMap
from msds.train import checkpointing, random_ltd
from msds.train.engine import (build_engine, destroy_engine, evaluate, full_weights, gather_pipeline_stages,
                               gather_tensor_parallel, read_ds_template, train_step)
from msds.train.metrics import MetricsLogger
from msds.train.schedule import flops_per_sample, level_maps, level_model, lr_multiplier, plan_phases
from msds.train.transition import SavedLevel, coalesce_engine, decoalesce_engine


# The checkpoint reason of a finished run. slurm/train.sh reads it from metrics.jsonl to decide
# between "requeue" and "done": keep it stable.
FINISHED = "end of training"


@dataclass
class TrainState:
    """What a resumed run needs besides the engine: position in the V-cycle and the counters."""

    step: int = 0
    phase: int = 0
    consumed_samples: int = 0
    flops: float = 0.0
    train_seconds: float = 0.0
    transition_seconds: float = 0.0


@dataclass
class RunSummary:
    state: TrainState
    final_val_loss: float | None
    exited_early: bool
    transitions: list[dict] = field(default_factory=list)


def resident_memory_mb() -> float:
    """Current resident set size of this process (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def check_data(cfg: RunConfig) -> None:
    info = load_tokenizer_info(cfg.data.path)
    if info.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({info.vocab_size}) of {cfg.data.path}; set model.vocab_size="
                          f"{info.vocab_size} or more")


class Trainer:
    def __init__(self, cfg: RunConfig, maps: list[LevelMap]):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Data parallelism is what is left of the world after tensor and pipeline parallelism; the
        # tensor-parallel ranks and pipeline stages of one model replica read the same samples.
        self.dp_rank, self.dp_size = dist.get_rank(data_parallel_group()), dist.get_world_size(data_parallel_group())
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.maps = maps
        self.phases = plan_phases(cfg)
        self.state = TrainState()
        self.saved: list[SavedLevel] = []
        self.transitions: list[dict] = []
        self.saved_at_step = -1
        # Early, so that a stop signal during start-up (imports done, engine build, resume) is noted
        # rather than killing the process with the signal's default action.
        self.install_exit_signal()
        self.samples_per_step = cfg.training.micro_batch_size * cfg.training.grad_accum * self.dp_size
        self.tokens_per_step = self.samples_per_step * cfg.data.seq_len
        self.random_ltd = random_ltd.parse(read_ds_template(cfg), cfg.model, cfg.data.seq_len)
        self.log = MetricsLogger(self.run_dir, self.rank == 0, cfg.logging.interval, cfg.training.steps,
                                 cfg.logging.tensorboard)
        self.eval_set = eval_batches(cfg.data.path, cfg.logging.eval_split, cfg.model.arch, cfg.data.seq_len,
                                     cfg.training.micro_batch_size, cfg.logging.eval_batches, seed=cfg.data.seed)

    # -- helpers --------------------------------------------------------------------------

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    @property
    def phase(self):
        return self.phases[self.state.phase]

    def keep_tokens(self, step: int) -> int | None:
        return self.random_ltd.keep_tokens(step) if self.random_ltd else None

    def lr_lambda(self, phase):
        min_ratio = self.cfg.optimizer.min_lr_ratio
        if self.cfg.multilevel.enabled and self.cfg.multilevel.lr_schedule == "run":
            whole_run = plan_phases(self.cfg, single=True)[0]

            def on_the_run_curve(step_in_phase):
                rewarm = 1.0 if phase.index == 0 else min(1.0, (step_in_phase + 1) / max(1, phase.warmup_steps))
                return rewarm * lr_multiplier(whole_run, phase.first_step + step_in_phase, min_ratio)
            return on_the_run_curve
        if not (self.random_ltd and self.random_ltd.layer_token_lr):
            return lambda step_in_phase: lr_multiplier(phase, step_in_phase, min_ratio)
        # LayerToken schedule: the phase's warmup and decay advance with consumed layer-tokens, so
        # the early steps (short sequences in the routed layers) move the schedule less.
        model = level_model(self.cfg, self.maps, phase.level)
        tokens = [self.random_ltd.layer_tokens(phase.first_step + k, model, self.samples_per_step)
                  for k in range(phase.steps)]
        consumed = [0.0]
        for t in tokens:
            consumed.append(consumed[-1] + t)
        total = consumed[-1]
        return lambda step_in_phase: lr_multiplier(
            phase, consumed[min(step_in_phase, phase.steps)] / total * phase.steps, min_ratio)

    def new_engine(self, phase, tensors=None):
        return build_engine(self.cfg, level_model(self.cfg, self.maps, phase.level), tensors,
                            phase.peak_lr, self.lr_lambda(phase))

    def batches(self):
        return train_batches(self.cfg.data.path, self.cfg.model.arch, self.cfg.data.seq_len,
                             self.cfg.training.micro_batch_size, self.cfg.data.seed, self.dp_rank, self.dp_size,
                             consumed_samples=self.state.consumed_samples)

    def log_eval(self, engine) -> float:
        loss = evaluate(engine, self.eval_set)
        self.log.eval({"step": self.state.step, "level": self.phase.level, "val_loss": loss,
                       "val_ppl": math.exp(min(loss, 50.0)), "flops": self.state.flops,
                       "train_seconds": self.state.train_seconds})
        return loss

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, engine, reason: str) -> None:
        if self.saved_at_step == self.state.step:
            return   # e.g. a transition checkpoint followed by exit_after_steps at the same step
        self.saved_at_step = self.state.step
        state = {"train": asdict(self.state), "transitions": self.transitions,
                 "model": asdict(level_model(self.cfg, self.maps, self.phase.level)),
                 "tensor_parallel": self.cfg.parallel.tensor, "pipeline_parallel": self.cfg.parallel.pipeline}
        rank_state = {"saved": [s.state_dict() for s in self.saved], "rng": torch.get_rng_state()}
        tag = checkpointing.save(engine, self.ckpt_dir, self.state.step, state, rank_state, self.cfg.checkpoint.keep)
        self.log.event("checkpoint", {"step": self.state.step, "tag": tag, "reason": reason},
                       f"checkpoint {self.ckpt_dir / tag} ({reason})")

    def resume(self):
        """An engine restored from the newest complete checkpoint, or None to start afresh."""
        if self.cfg.checkpoint.resume != "auto":
            return None
        tag = checkpointing.find_resumable(self.ckpt_dir, self.world, self.say)
        if tag is None:
            return None
        self.state = TrainState(**checkpointing.read_state(self.ckpt_dir, tag)["train"])
        engine = self.new_engine(self.phase)
        state, rank_state = checkpointing.load(engine, self.ckpt_dir, tag)
        self.transitions = state["transitions"]
        self.saved = [SavedLevel(**s) for s in rank_state["saved"]]
        torch.set_rng_state(rank_state["rng"])
        self.log.event("resume", {"step": self.state.step, "tag": tag},
                       f"resumed from {self.ckpt_dir / tag} at step {self.state.step} (level {self.phase.level})")
        return engine

    def export(self, engine) -> None:
        """The trained model as an msds model checkpoint with TP=1 shapes (<run_dir>/model), ready
        for `msds export-hf`, whatever the run's parallel layout."""
        tensors = gather_pipeline_stages(gather_tensor_parallel(full_weights(engine)))
        tensors = {name: t.cpu() for name, t in tensors.items()}
        if self.rank == 0:
            save_model(self.run_dir / "model", level_model(self.cfg, self.maps, self.phase.level), tensors,
                       overwrite=True)
            self.say(f"model written to {self.run_dir / 'model'} (msds export-hf can convert it)")
        dist.barrier()

    # -- transitions ------------------------------------------------------------------------

    def transition(self, engine):
        """Leave the current phase for the next one; returns the next phase's engine."""
        current, following = self.phase, self.phases[self.state.phase + 1]
        ml = self.cfg.multilevel
        map_moments = ml.optimizer_policy == "map"
        loss_before = evaluate(engine, self.eval_set)
        rss_before = resident_memory_mb()
        if following.level > current.level:
            level_map = self.maps[current.level - 1]
            engine, saved, record = coalesce_engine(engine, self.cfg, level_map, current.level,
                                                    following.peak_lr, self.lr_lambda(following),
                                                    map_moments, loss_before)
            self.saved.append(saved)
            extra = {}
        else:
            saved = self.saved.pop()
            level_map = self.maps[following.level - 1]
            engine, record = decoalesce_engine(engine, self.cfg, level_map, saved, ml.alpha,
                                               following.peak_lr, self.lr_lambda(following), map_moments)
            extra = {"loss_before_coalescing": saved.val_loss, "alpha": ml.alpha}
        self.state.phase += 1
        self.state.transition_seconds += record.seconds
        self.state.train_seconds += record.seconds
        # A transition costs about ten elementwise passes over the parameters and moments of the
        # larger model on every rank: negligible next to a training step, but counted.
        larger = level_model(self.cfg, self.maps, min(current.level, following.level))
        self.state.flops += 10 * sum(math.prod(s) for s in expected_shapes(larger).values()) * self.dp_size
        loss_after = evaluate(engine, self.eval_set)
        entry = {"step": self.state.step, "direction": record.direction, "from_level": record.from_level,
                 "to_level": record.to_level, "seconds": record.seconds, "loss_before": loss_before,
                 "loss_after": loss_after, "rss_mb_before": rss_before, "rss_mb_after": resident_memory_mb(),
                 **extra}
        self.transitions.append(entry)
        note = (f" (saved large model: {extra['loss_before_coalescing']:.4f}, alpha {ml.alpha})"
                if extra else "")
        self.log.event("transition", entry,
                       f"transition {record.direction} level {record.from_level} -> {record.to_level} at step "
                       f"{self.state.step} in {record.seconds:.2f} s: val loss {loss_before:.4f} -> "
                       f"{loss_after:.4f}{note}")
        if self.cfg.checkpoint.at_transitions:
            self.save(engine, "transition")
        return engine

    # -- stopping on a signal -----------------------------------------------------------------

    def install_exit_signal(self) -> None:
        self.signalled = False
        name = self.cfg.training.exit_signal
        if not name:
            return
        if not hasattr(signal, name):
            raise ConfigError(f"training.exit_signal: {name!r} is not a signal name (e.g. SIGUSR1, SIGTERM)")

        def note(signum, frame):
            self.signalled = True
            print(f"rank {self.rank}: received {name}; checkpointing after this step", flush=True)

        signal.signal(getattr(signal, name), note)

    def reduce_step(self, loss: torch.Tensor) -> tuple[float, bool]:
        """The step's loss averaged over data-parallel replicas, and whether any rank received the
        stop signal (it may reach only some; all must stop at the same step), in one collective.
        Summing over every rank is the data-parallel mean: the tensor-parallel ranks and pipeline
        stages of one replica hold the same loss."""
        packed = torch.stack([loss.float(), torch.tensor(float(self.signalled), device=loss.device)])
        dist.all_reduce(packed)
        return packed[0].item() / self.world, packed[1].item() > 0

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> RunSummary:
        cfg = self.cfg
        engine = self.resume()
        if engine is None:
            torch.manual_seed(cfg.training.seed)
            engine = self.new_engine(self.phase)
            self.say(f"training {cfg.model.arch} for {cfg.training.steps} steps in {len(self.phases)} phase(s) "
                     f"on {self.world} process(es) (tensor parallel {cfg.parallel.tensor}, pipeline parallel "
                     f"{cfg.parallel.pipeline}, data parallel {self.dp_size}), ZeRO {cfg.training.zero_stage}, {cfg.training.precision}")
        batches = self.batches()
        steps_here, exited_early, any_rank_signalled = 0, False, False
        total = cfg.training.steps
        while self.state.step < total:
            if self.state.step == self.phase.last_step:
                engine = self.transition(engine)
                continue
            stop = "exit_after_steps" if cfg.training.exit_after_steps and steps_here >= cfg.training.exit_after_steps \
                else cfg.training.exit_signal if any_rank_signalled else None
            if stop:
                self.save(engine, stop)
                self.say(f"stopped at step {self.state.step} ({stop}); run again with the same config to resume")
                exited_early = True
                break
            start = time.perf_counter()
            keep = self.keep_tokens(self.state.step)
            loss = train_step(engine, batches, cfg.training.grad_accum, keep)
            loss, any_rank_signalled = self.reduce_step(loss)
            seconds = time.perf_counter() - start
            model_cfg = level_model(cfg, self.maps, self.phase.level)
            self.state.step += 1
            self.state.consumed_samples += self.samples_per_step
            self.state.flops += flops_per_sample(model_cfg, cfg.data.seq_len, keep) * self.samples_per_step
            self.state.train_seconds += seconds
            steps_here += 1
            self.log.step({"step": self.state.step, "level": self.phase.level, "loss": loss,
                           "lr": engine.get_lr()[0], "tokens_per_s": self.tokens_per_step / seconds,
                           "flops": self.state.flops, "train_seconds": self.state.train_seconds,
                           "consumed_samples": self.state.consumed_samples,
                           "keep_tokens": keep or cfg.data.seq_len})
            if self.state.step % cfg.logging.eval_interval == 0 and self.state.step < total:
                self.log_eval(engine)
            if cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0 and self.state.step < total:
                self.save(engine, "interval")
        final_loss = None
        if not exited_early:
            final_loss = self.log_eval(engine)
            self.save(engine, FINISHED)
            self.export(engine)
            self.say(f"done: {self.state.step} steps, val loss {final_loss:.4f}, {self.state.flops:.3e} FLOPs, "
                     f"{self.state.train_seconds:.1f} s training ({self.state.transition_seconds:.2f} s in transitions)")
        destroy_engine(engine)
        self.log.close()
        return RunSummary(self.state, final_loss, exited_early, list(self.transitions))


def train(cfg: RunConfig) -> RunSummary:
    """Run (or resume) a training run in this process group; callable repeatedly in one process."""
    # Every level first: a V-cycle that does not fit the parallel layout fails before any process
    # group or engine is made.
    maps = level_maps(cfg)
    init_distributed(tensor_parallel=cfg.parallel.tensor, pipeline_parallel=cfg.parallel.pipeline,
                     seed=cfg.training.seed)
    check_data(cfg)
    run_dir = Path(cfg.run_dir)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, run_dir / "config.yaml")
    return Trainer(cfg, maps).run()


def _run(args) -> int:
    cfg = load_run_config(args.config, args.overrides)
    train(cfg)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=False, help="YAML run config (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override config fields, e.g. training.zero_stage=3 multilevel.alpha=0.25")
    parser.set_defaults(run=_run)
