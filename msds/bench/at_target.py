"""Each variant's model where it first reaches the target (`eval.at: target`): the run trained
again to that evaluation's step in <run_dir>/at-target, its checkpoint there kept as a model."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from msds.bench.runs import read_evals
from msds.bench.saving import SeedResult, crossing_index
from msds.bench.training import config_record, train_runs
from msds.config import ConfigError, RunConfig
from msds.plan import build_plan

AT_TARGET = "at-target"           # <run_dir>/at-target: the run again, stopped at its target step
AT_TARGET_FILE = "at_target.json"


@dataclass
class ModelAtTarget:
    """Where a variant's model at the target is: its directory, the step (None: the target never
    reached, the final model), the model's validation loss and the run's own evaluation there."""
    run_dir: Path
    step: Optional[int]
    val_loss: float
    run_val_loss: float

    def to_json(self) -> dict:
        return {"step": self.step, "val_loss": self.val_loss, "run_val_loss": self.run_val_loss}


def rerun_config(cfg: RunConfig, step: int) -> RunConfig:
    """`cfg` again in <run_dir>/at-target, stopped with a checkpoint after `step` steps: the same
    schedule, seeds and data order (the trainer is deterministic on the same threads), so the run's
    own model at that step. Its checkpoints go to its own directory and are not resumed."""
    rerun = copy.deepcopy(cfg)
    rerun.run_dir = str(Path(cfg.run_dir) / AT_TARGET)
    rerun.training.exit_after_steps = step
    rerun.checkpoint = dataclasses.replace(cfg.checkpoint, dir="", interval=0, at_transitions=False, keep=1,
                                           resume="never", layout_free=False)
    rerun.logging.tensorboard = False
    phase_end = next((p for p in build_plan(cfg, 1).phases[:-1] if p.end_step == step), None)
    if phase_end is not None:   # the trainer would leave the phase before it stops
        raise ConfigError(f"eval.at: {cfg.run_dir} first reaches the target at step {step}, where phase "
                          f"{phase_end.index} ends, and its model there is not kept; evaluate final models "
                          f"(eval.at: final)")
    return rerun


def train_to_target(name: str, cfg: RunConfig, record: dict, runs_at_once: int = 1) -> None:
    """One rerun to its target step: its checkpoint there converted to <run_dir>/model and removed,
    then at_target.json (the config, the step, the rerun's validation loss there)."""
    from msds.train.checkpointing import convert_to_model
    from msds.train.loop import train

    summary = train(cfg)
    run_dir, step = Path(cfg.run_dir), cfg.training.exit_after_steps
    if not summary.exited_early or summary.state.step != step:
        raise SystemExit(f"bench: {name}'s rerun to step {step} ended at step {summary.state.step}")
    if dist.get_rank() == 0:
        convert_to_model(run_dir / "checkpoints", None, run_dir / "model")
        shutil.rmtree(run_dir / "checkpoints")
        last = read_evals(run_dir)[-1]
        (run_dir / AT_TARGET_FILE).write_text(json.dumps({"config": record, "step": last.step,
                                                          "val_loss": last.val_loss}))


def _where(run_dir: Path, target: float) -> ModelAtTarget:
    """Where the run first reaches `target` by its own evaluations."""
    evals = read_evals(run_dir)
    index = crossing_index(evals, target)
    run_val_loss = evals[-1 if index is None else index].val_loss
    return ModelAtTarget(run_dir, None if index is None else evals[index].step, run_val_loss, run_val_loss)


def _rerun_if_needed(entry: ModelAtTarget, cfg: RunConfig, name: str, pending: list) -> None:
    """Point `entry` at its rerun; queue the rerun in `pending` unless an at_target.json of the same
    config is there. A run whose target step is its last evaluation, or that never reaches it, is its
    final model."""
    if entry.step is None or entry.step == read_evals(entry.run_dir)[-1].step:
        return
    rerun = rerun_config(cfg, entry.step)
    record, done = config_record(rerun), Path(rerun.run_dir) / AT_TARGET_FILE
    entry.run_dir = Path(rerun.run_dir)
    if done.is_file() and json.loads(done.read_text())["config"] == record:
        print(f"bench: {rerun.run_dir} is up to date, reusing it", flush=True)
    else:
        shutil.rmtree(rerun.run_dir, ignore_errors=True)   # a stopped rerun starts again
        pending.append((name, rerun, record))


def models_at_target(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path],
                     per_seed: dict[str, SeedResult], names: list[str],
                     jobs: int) -> dict[str, dict[str, ModelAtTarget]]:
    """seed label -> variant -> where its model at the target is; the runs that need it are trained
    again to their target step (`jobs` at a time)."""
    where, pending = {}, []
    for label, seed_dir in seed_dirs.items():
        where[label] = {name: _where(seed_dir / name, per_seed[label].target_val_loss) for name in names}
        for name, entry in where[label].items():
            _rerun_if_needed(entry, configs[label][name], name, pending)
    train_runs(pending, jobs, train_to_target)
    for records in where.values():
        for entry in records.values():
            done = entry.run_dir / AT_TARGET_FILE
            if done.is_file():
                entry.val_loss = json.loads(done.read_text())["val_loss"]
    return where
