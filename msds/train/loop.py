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
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from msds import startup
from msds.model.files import save_model, without_vocab_padding
from msds.config import RunConfig, dump_yaml, load_run_config
from msds.data import eval_batches, train_batches
from msds.errors import MsdsError
from msds.distributed import data_parallel_group, init_distributed, launched_world_size, seed_generators
from msds.plan import RunPlan, build_plan, check_environment
from msds.plan.pretrained import describe
from msds.train import checkpointing, relayout
from msds.train.guards import BAD_STEPS, HangWatchdog, StartupWatchdog, StepGuard
from msds.train.init_from import pretrained_engine
from msds.train.engine import (build_engine, destroy_engine, evaluate, full_weights, gather_pipeline_stages,
                               gather_tensor_parallel, train_step)
from msds.train.metrics import MetricsLogger
from msds.train.transition import SavedLevel, run_transition


# What a start waits on in its last two stages (msds.startup; the start-up watchdog names it).
ENGINE_BUILD = ("the engine build or resume (deepspeed.initialize and the checkpoint load: collectives with the "
                "other ranks)")
FIRST_STEP = "the first training step (its collectives with the other ranks)"

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
    # msds.train.guards.StepGuard's counts: skipped steps, and the losses a spike is measured against.
    bad_steps: int = 0
    bad_steps_in_row: int = 0
    recent_losses: list[float] = field(default_factory=list)


@dataclass
class RunSummary:
    state: TrainState
    final_val_loss: float | None
    exited_early: bool
    transitions: list[dict] = field(default_factory=list)


class Trainer:
    def __init__(self, plan: RunPlan, startup_watchdog: StartupWatchdog):
        self.plan, self.startup_watchdog = plan, startup_watchdog
        cfg = self.cfg = plan.config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Data parallelism is what is left of the world after tensor and pipeline parallelism; the
        # tensor-parallel ranks and pipeline stages of one model replica read the same samples.
        self.dp_rank = dist.get_rank(data_parallel_group())
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.state = TrainState()
        self.saved: list[SavedLevel] = []
        self.transitions: list[dict] = []
        self.saved_at_step = -1
        # Early, so that a stop signal during start-up (imports done, engine build, resume) is noted
        # rather than killing the process with the signal's default action.
        self.install_exit_signal()
        self.log = MetricsLogger(self.run_dir, self.rank == 0, cfg.logging.interval, plan.total_steps,
                                 cfg.logging.tensorboard)
        self.eval_set = eval_batches(cfg.data, cfg.logging.eval_split, cfg.model.arch, cfg.data.seq_len,
                                     cfg.training.micro_batch_size, cfg.logging.eval_batches, seed=cfg.data.seed)
        self.guard = StepGuard(cfg.training, self.world, self.log)
        self.watchdog = HangWatchdog(cfg.training.hang_timeout_s, self.run_dir, self.rank)

    # -- helpers --------------------------------------------------------------------------

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    @property
    def phase(self):
        return self.plan.phases[self.state.phase]

    def batches(self):
        return train_batches(self.cfg.data, self.cfg.model.arch, self.cfg.data.seq_len,
                             self.cfg.training.micro_batch_size, self.cfg.data.seed, self.dp_rank,
                             self.plan.layout.data,
                             consumed_samples=self.state.consumed_samples, prefetch=self.cfg.data.prefetch,
                             pin_memory=torch.cuda.is_available())

    def log_eval(self, engine) -> float:
        loss, sop_accuracy = evaluate(engine, self.eval_set)
        # With sentence-order pairs val_loss is the sum of the masked-LM and sentence-order losses.
        extra = {} if sop_accuracy is None else {"val_sop_accuracy": sop_accuracy}
        self.log.eval({"step": self.state.step, "level": self.phase.level, "val_loss": loss,
                       "val_ppl": math.exp(min(loss, 50.0)), **extra, "flops": self.state.flops,
                       "train_seconds": self.state.train_seconds})
        return loss

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, engine, reason: str) -> None:
        if self.saved_at_step == self.state.step:
            return   # e.g. a transition checkpoint followed by exit_after_steps at the same step
        self.saved_at_step = self.state.step
        state = {"train": asdict(self.state), "transitions": self.transitions,
                 "model": asdict(self.plan.model(self.phase.level)),
                 "tensor_parallel": self.cfg.parallel.tensor, "pipeline_parallel": self.cfg.parallel.pipeline,
                 **relayout.layout_record(self.plan)}
        rank_state = {"saved": [s.state_dict() for s in self.saved], "rng": checkpointing.rng_state()}
        layout_free = (lambda tag_dir: relayout.write(engine, self.plan, self.saved, tag_dir)) \
            if self.cfg.checkpoint.layout_free else None
        tag = checkpointing.save(engine, self.ckpt_dir, self.state.step, state, rank_state, self.cfg.checkpoint.keep,
                                 extra=layout_free)
        self.log.event("checkpoint", {"step": self.state.step, "tag": tag, "reason": reason},
                       f"checkpoint {self.ckpt_dir / tag} ({reason})")

    def resume(self):
        """An engine restored from the newest complete checkpoint, or None to start afresh."""
        if self.cfg.checkpoint.resume != "auto":
            return None
        tag = checkpointing.find_resumable(self.ckpt_dir, self.say)
        if tag is None:
            return None
        state = checkpointing.read_state(self.ckpt_dir, tag)
        same_layout = relayout.check_resume(state, self.plan, self.ckpt_dir / tag)
        self.state = TrainState(**state["train"])
        self.saved_at_step = self.state.step   # a checkpoint of this step exists: never rewritten in place
        self.transitions = state["transitions"]
        if same_layout:
            engine = build_engine(self.plan, self.phase, None)
            _, rank_state = checkpointing.load(engine, self.ckpt_dir, tag)
            self.saved = [SavedLevel(**s) for s in rank_state["saved"]]
            checkpointing.restore_rng_state(rank_state["rng"])
        else:   # another data x tensor x pipeline layout: from the layout-free copy
            engine, self.saved = relayout.resume(self.plan, self.phase, self.ckpt_dir / tag, self.state.step)
        self.log.event("resume", {"step": self.state.step, "tag": tag, "same_layout": same_layout},
                       f"resumed from {self.ckpt_dir / tag} at step {self.state.step} (level {self.phase.level})"
                       + ("" if same_layout else " on another layout (layout-free copy; generators re-seeded)")
                       + ("" if self.plan.init_from is None else
                          f"; model.init_from ({self.plan.init_from.source.path}) is not loaded: the run "
                          f"continues from its own training checkpoint"))
        return engine

    def export(self, engine) -> None:
        """The trained model as an msds model checkpoint with TP=1 shapes and no vocabulary padding
        (<run_dir>/model), ready for `msds export-hf`, whatever the run's parallel layout."""
        tensors = gather_pipeline_stages(gather_tensor_parallel(full_weights(engine)))
        cfg = self.plan.model(self.phase.level)
        tensors = without_vocab_padding(cfg, {name: t.cpu() for name, t in tensors.items()})
        if self.rank == 0:
            save_model(self.run_dir / "model", cfg, tensors, overwrite=True)
            self.say(f"model written to {self.run_dir / 'model'} (msds export-hf can convert it)")
        dist.barrier()

    # -- transitions ------------------------------------------------------------------------

    def transition(self, engine):
        """Leave the current phase for the next one; returns the next phase's engine."""
        following = self.plan.phases[self.state.phase + 1]
        engine, entry = run_transition(engine, self.plan, self.phase, following, self.saved, self.eval_set,
                                       self.state.step)
        self.state.phase += 1
        self.state.transition_seconds += entry["seconds"]
        self.state.train_seconds += entry["seconds"]
        self.state.flops += entry["flops"]
        self.transitions.append(entry)
        note = (f" (saved large model: {entry['loss_before_coalescing']:.4f}, alpha {entry['alpha']})"
                if "loss_before_coalescing" in entry else " (grown, not interpolated)" if entry["direction"] == "up"
                else "")
        self.log.event("transition", entry,
                       f"transition {entry['direction']} level {entry['from_level']} -> {entry['to_level']} at step "
                       f"{entry['step']} in {entry['seconds']:.2f} s: val loss {entry['loss_before']:.4f} -> "
                       f"{entry['loss_after']:.4f}{note}")
        if self.cfg.checkpoint.at_transitions:
            self.save(engine, "transition")
        return engine

    # -- stopping on a signal -----------------------------------------------------------------

    def install_exit_signal(self) -> None:
        self.signalled = False
        name = self.cfg.training.exit_signal   # a signal name: the plan checked it
        if not name:
            return

        def note(signum, frame):
            self.signalled = True
            print(f"rank {self.rank}: received {name}; checkpointing after this step", flush=True)

        signal.signal(getattr(signal, name), note)

    # -- the loop ---------------------------------------------------------------------------

    def first_engine(self):
        """This start's engine: resumed from the newest complete checkpoint, or a fresh one."""
        engine = self.resume()
        if engine is not None:
            return engine
        seed_generators(self.cfg.training.seed)
        cfg, plan = self.cfg, self.plan
        engine = build_engine(plan, self.phase, None) if plan.init_from is None else \
            pretrained_engine(plan, self.phase)
        # A start from step 0: what metrics.jsonl holds of an attempt killed before its first
        # checkpoint is abandoned (read_metrics drops the records before this one).
        self.log.event("start", {"step": 0},
                       f"training {cfg.model.arch} for {plan.total_steps} steps in {len(plan.phases)} phase(s) "
                       f"on {self.world} process(es) (tensor parallel {plan.layout.tensor}, pipeline parallel "
                       f"{plan.layout.pipeline}, data parallel {plan.layout.data}), ZeRO {cfg.training.zero_stage}, "
                       f"{cfg.training.precision}"
                       + ("" if plan.init_from is None else f"; model.init_from: {describe(plan.init_from)}"))
        if plan.init_from is not None:
            self.log_eval(engine)   # where the loaded weights start: the validation loss at step 0
        return engine

    def run(self) -> RunSummary:
        cfg, plan = self.cfg, self.plan
        with startup.waiting_on(ENGINE_BUILD):
            engine = self.first_engine()
        batches = self.batches()
        steps_here, exited_early, any_rank_signalled = 0, False, False
        total = plan.total_steps
        while self.state.step < total:
            if self.state.step == self.phase.end_step:
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
            keep = plan.keep_tokens(self.state.step)
            with startup.waiting_on(FIRST_STEP):
                train_step(engine, batches, cfg.training.grad_accum, keep,
                           lambda loss: self.guard.check(loss, self.signalled, self.state))
            self.startup_watchdog.stop()
            loss, any_rank_signalled = self.guard.verdict.loss, self.guard.verdict.signalled
            seconds = time.perf_counter() - start
            self.state.flops += plan.flops_per_step(self.phase.level, self.state.step)
            self.state.step += 1
            self.state.consumed_samples += plan.samples_per_step
            self.state.train_seconds += seconds
            steps_here += 1
            self.log.step({"step": self.state.step, "level": self.phase.level, "loss": loss,
                           "lr": engine.get_lr()[0], "tokens_per_s": plan.tokens_per_step / seconds,
                           "flops": self.state.flops, "train_seconds": self.state.train_seconds,
                           "consumed_samples": self.state.consumed_samples,
                           "keep_tokens": keep or cfg.data.seq_len, "bad_steps": self.state.bad_steps})
            self.watchdog.arm()
            stop = self.guard.give_up(self.state)
            if stop:
                self.save(engine, BAD_STEPS)
                raise MsdsError(stop)
            if self.state.step % cfg.logging.eval_interval == 0 and self.state.step < total:
                self.log_eval(engine)
            if cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0 and self.state.step < total:
                self.save(engine, "interval")
        batches.close()   # a prefetching loader's thread stops (also when `batches` is dropped)
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


def train(cfg: RunConfig, started: float | None = None) -> RunSummary:
    """Run (or resume) a training run in this process group; callable repeatedly in one process.
    `started`: when this start began (epoch seconds; default now), for the start-up watchdog."""
    startup_watchdog = StartupWatchdog(cfg.training.startup_timeout_s, Path(cfg.run_dir), int(os.environ.get("RANK", 0)),
                                       time.time() if started is None else started)
    try:
        return _train(cfg, startup_watchdog)
    finally:
        startup_watchdog.stop()


def _train(cfg: RunConfig, startup_watchdog: StartupWatchdog) -> RunSummary:
    # The whole plan first: a V-cycle that does not fit the parallel layout fails before any
    # process group or engine is made.
    plan = build_plan(cfg, launched_world_size())
    check_environment(plan)
    init_distributed(tensor_parallel=plan.layout.tensor, pipeline_parallel=plan.layout.pipeline,
                     seed=cfg.training.seed)
    assert dist.get_world_size(data_parallel_group()) == plan.layout.data, "the plan's layout is the process group's"
    run_dir = Path(cfg.run_dir)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(plan.config, run_dir / "config.yaml")
    trainer = Trainer(plan, startup_watchdog)
    if cfg.training.hang_timeout_s:
        trainer.say(f"hang watchdog: a rank with no step for {cfg.training.hang_timeout_s:g} s writes its stacks to "
                    f"{trainer.watchdog.stacks_file.parent}/rank-<rank>.txt and exits (training.hang_timeout_s)")
    with trainer.watchdog:   # from here to the end, a hang ends the process (training.hang_timeout_s)
        return trainer.run()


def _run(args) -> int:
    train(load_run_config(args.config, args.overrides), started=args.started)
    return 0


def add_parser(subparsers, name: str, doc: str) -> None:
    parser = subparsers.add_parser(name, help=doc, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=False, help="YAML run config, or a packaged recipe's name")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override config fields, e.g. training.zero_stage=3 multilevel.alpha=0.25")
    parser.set_defaults(run=_run)
