"""Training a bench's runs: which are still to train (a finished run of the same config is reused,
one of another config refused), one after the other or `--jobs` at a time in worker processes, each
run's summary.json with the load it was timed under."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import threading
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from msds.bench.runs import SUMMARY_FILE, Load
from msds.config import ConfigError, RunConfig, load_yaml

def _computes_the_same(stored: dict, record: dict) -> bool:
    """Whether a finished run's config record and a new one train the same run. A run without
    multi-level training reads nothing of its `multilevel` section, so a changed default there
    (e.g. phase_warmup_steps) leaves a finished baseline reusable."""
    def used(config: dict) -> dict:
        return config if config["multilevel"]["enabled"] else {k: v for k, v in config.items() if k != "multilevel"}
    return used(stored) == used(record)


def _first_difference(stored: dict, record: dict, prefix: str = "") -> str:
    """The first dotted field whose value differs between two config records, with both values."""
    for key in sorted(set(stored) | set(record)):
        old, new = stored.get(key), record.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found = _first_difference(old, new, f"{prefix}{key}.")
            if found:
                return found
        elif old != new:
            return f"{prefix}{key}: {old!r} there, {new!r} now"
    return ""


def _with_new_fields(stored: dict, defaults: dict) -> dict:
    """A record written before some config fields existed, with those fields at their defaults:
    every field added since keeps, at its default, the behaviour from before it (e.g.
    optimizer.schedule: cosine), so an earlier run stays reusable."""
    out = dict(stored)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_new_fields(out[key], value)
    return out


def _stored_record(run_dir: Path) -> Optional[tuple[dict, bool]]:
    """What a run directory says it computes, and whether it finished: a finished run's summary.json,
    else the config.yaml a started run wrote (its checkpoints are what a new start would resume);
    fields added to the config since, at their defaults."""
    done, started = run_dir / SUMMARY_FILE, run_dir / "config.yaml"
    defaults = config_record(RunConfig())
    if done.is_file():
        return _with_new_fields(json.loads(done.read_text())["config"], defaults), True
    if started.is_file():
        record = json.loads(json.dumps(load_yaml(started)))
        return _with_new_fields({k: v for k, v in record.items() if k != "run_dir"}, defaults), False
    return None


def config_record(cfg: RunConfig) -> dict:
    """What a run computes, as JSON; where it was written does not count (a bench directory may move)."""
    return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(cfg))).items() if k != "run_dir"}


def pending_runs(configs: dict[str, RunConfig], seed_dir: Path) -> list[tuple[str, RunConfig, dict]]:
    """The runs of a seed still to train: those without a summary.json of the same config. A run
    directory of another config is refused, not trained again: the trainer would resume its
    checkpoints, so the old run would be reported under the new config."""
    pending = []
    for name, cfg in configs.items():
        record = config_record(cfg)
        stored = _stored_record(seed_dir / name)
        if stored is not None and not _computes_the_same(stored[0], record):
            raise ConfigError(f"variants.{name}: {seed_dir / name} {'finished' if stored[1] else 'started'} with "
                              f"another config ({_first_difference(stored[0], record)}); a new start would resume "
                              f"its checkpoints, not train this config: move that directory away (or bench into "
                              f"another --out) to train it, or restore the config to reuse it")
        if stored is not None and stored[1]:
            print(f"bench: {cfg.run_dir} already finished, reusing it", flush=True)
        else:
            pending.append((name, cfg, record))
    return pending


class _LoadWatch:
    """The machine's load while a run trains: its 1-minute load average (every process on the
    machine, not only this bench's), sampled every 30 s by a daemon thread and once at the end."""

    def __init__(self):
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(30):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "_LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


def _train_one(name: str, cfg: RunConfig, record: dict, runs_at_once: int = 1) -> None:
    """One run, and its summary.json: the config it computed, its final loss and the load it was
    timed under (threads, runs the bench trained at once, the machine's mean load average), which
    the report compares before it sets two wall-clocks against each other. A run resumed after a
    stop records the load of its last start only: its wall-clock spans every start."""
    import torch

    from msds.train.loop import train

    with _LoadWatch() as watch:
        summary = train(cfg)
    if summary.exited_early:
        raise SystemExit(f"bench: {name} stopped early; run the same command again to continue")
    if dist.get_rank() == 0:
        load = Load(os.cpu_count(), torch.get_num_threads(), runs_at_once, round(statistics.fmean(watch.samples), 2))
        (Path(cfg.run_dir) / SUMMARY_FILE).write_text(json.dumps(
            {"config": record, "final_val_loss": summary.final_val_loss, "load": dataclasses.asdict(load)}))


def _train_in_child(work, name: str, cfg: RunConfig, record: dict, threads: int, runs_at_once: int,
                    log: str) -> None:
    """One run (`work`: `_train_one`, or `train_to_target` of at_target.py) in a worker process of `--jobs`: its own
    share of the cores, its output in its log."""
    import sys

    import torch

    torch.set_num_threads(threads)
    # Each run is a one-process job of its own: drop the launcher variables the parent may hold (a
    # one-process launcher's, or those an earlier in-process run set), or they would name one group.
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(variable, None)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        work(name, cfg, record, runs_at_once)


def _last_line(path: Path, starts: tuple[str, ...] = ("step", "eval")) -> str:
    """The last line of a run's output that starts with one of `starts` ("" for any line)."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((line for line in reversed(lines) if line.strip() and line.startswith(starts)), "")


def _stop(running: dict) -> None:
    """Send each running child its `training.exit_signal`, as a preemption would (a checkpoint after
    its current step; terminated if it has none), and wait for it to exit."""
    import signal

    for process, (cfg, _) in running.items():
        try:
            if cfg.training.exit_signal:
                os.kill(process.pid, getattr(signal, cfg.training.exit_signal))
            else:
                process.terminate()
        except ProcessLookupError:    # it exited on its own meanwhile (e.g. on the same Ctrl-C)
            pass
    for process in running:
        process.join()


def _train_concurrently(runs: list[tuple[str, RunConfig, dict]], jobs: int, work) -> None:
    """Train `runs` `jobs` at a time, each in its own process with 1/jobs of the threads (side by side
    on the same cores, so their wall-clock stays comparable); every minute, each running job's
    latest progress line. If one fails, or the bench itself is stopped (SIGTERM, Ctrl-C), the
    running ones get their `training.exit_signal` (a checkpoint after the current step), so that
    running the command again continues them and no run is left training on its own."""
    import multiprocessing
    import multiprocessing.connection
    import signal
    import time

    import torch

    def stopped(signum, _frame):
        raise SystemExit(f"bench: stopped by {signal.Signals(signum).name}; the running runs were sent "
                         "training.exit_signal (a checkpoint after their current step); run the same command "
                         "again to continue them")

    threads = max(1, torch.get_num_threads() // jobs)
    spawn = multiprocessing.get_context("spawn")
    queue, running, started = list(runs), {}, time.monotonic()
    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                name, cfg, record = queue.pop(0)
                log = Path(cfg.run_dir) / "bench.log"
                process = spawn.Process(target=_train_in_child, args=(work, name, cfg, record, threads, jobs, str(log)))
                process.start()
                running[process] = (cfg, log)
                print(f"bench: training {cfg.run_dir} ({threads} thread(s); its output goes to {log})", flush=True)
            ready = multiprocessing.connection.wait([process.sentinel for process in running], timeout=60)
            # A ready sentinel means the child is exiting, not yet reaped (its exitcode can still read
            # None): join it, or this loop would spin on it printing progress lines.
            for process in [p for p in running if p.sentinel in ready]:
                process.join()
                cfg, log = running.pop(process)
                if process.exitcode != 0:
                    raise SystemExit(f"bench: {cfg.run_dir} failed (exit code {process.exitcode}): "
                                     f"{_last_line(log, ('',)) or 'no message'}; its output: {log}. The other "
                                     "runs were sent training.exit_signal (a checkpoint after their current step); "
                                     "run the same command again to continue them")
                print(f"bench: finished {cfg.run_dir}", flush=True)
            minutes = (time.monotonic() - started) / 60
            for cfg, log in running.values():
                print(f"bench: [{minutes:.1f} min] {cfg.run_dir}: {_last_line(log) or 'starting'}", flush=True)
    except BaseException:
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_in_process(runs: list[tuple[str, RunConfig, dict]], work) -> None:
    """`work` each run in this process, one after the other. A SIGTERM to the bench becomes the
    running run's `training.exit_signal` (a checkpoint after its current step, then the bench
    stops), as with `--jobs`: running the command again continues the run instead of restarting it."""
    import signal

    current: list[RunConfig] = []

    def forward(signum, _frame):
        if current and current[0].training.exit_signal:
            os.kill(os.getpid(), getattr(signal, current[0].training.exit_signal))
        else:
            raise SystemExit(f"bench: stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        for name, cfg, record in runs:
            print(f"bench: training {cfg.run_dir}", flush=True)
            current[:] = [cfg]
            work(name, cfg, record)
            current.clear()
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_runs(runs: list[tuple[str, RunConfig, dict]], jobs: int, work=_train_one) -> None:
    """`work` each run: one after the other, or `jobs` at a time."""
    if jobs == 1:
        _train_in_process(runs, work)
    elif runs:
        _train_concurrently(runs, jobs, work)


def train_missing(configs: dict[str, dict[str, RunConfig]], seed_dirs: dict[str, Path], jobs: int) -> None:
    """Train every run (seed label -> variant -> config) that has not finished."""
    train_runs([run for label, seed_configs in configs.items() for run in pending_runs(seed_configs, seed_dirs[label])],
                jobs)


