"""A long random kill campaign (issue 66; BENCHMARKS.md, "Faults"): rounds of msds/bench/kills.py's
campaign over a 3-level V-cycle of 12 steps on 2 processes (recipes/test/test-vcycle-gpt.yaml,
phases of 2, 2, 4, 2 and 2 steps, ZeRO 2, a checkpoint every 2 steps and at transitions, torchrun),
each round a fresh run killed `--per-round` times at seeded random moments (`--startup-per-round`
of them in start-up) and then run to its end, until at least `--kills` kills have struck. Each
round's per-step losses and final validation loss must equal an uninterrupted run's exactly.

    python benchmarks/kill_campaign.py --corpus ~/.cache/msds/test-data/default-bpe-1024 \
        --work /tmp/kill-campaign --out benchmarks/results/kill-campaign.json

`msds report` turns the JSON into BENCHMARKS.md's "Faults" table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from importlib.metadata import version
from pathlib import Path

from msds.bench import kills as campaign
from msds.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
OVERRIDES = ["logging.tensorboard=false", "multilevel.phase_steps=[2,2,4,2,2]", "logging.eval_batches=1",
             "logging.eval_interval=1000", "training.zero_stage=2", "checkpoint.interval=2",
             "checkpoint.at_transitions=true"]


def free_port() -> int:
    """A port for the campaign's rendezvous, every launch the same (torchrun's default, 29500, may
    be another job's on a shared machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(corpus: Path, run_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            "-m", "msds.cli", "train",
            "--config", str(REPO / "recipes" / "test" / "test-vcycle-gpt.yaml"), f"data.path={corpus}",
            f"run_dir={run_dir}", *OVERRIDES]


def outcome(run_dir: Path) -> tuple[dict[int, str], float]:
    """Per-step losses (repr: exact) and the final validation loss of a run."""
    return ({r["step"]: repr(r["loss"]) for r in read_metrics(run_dir, "step")},
            read_metrics(run_dir, "eval")[-1]["val_loss"])


def clean_run(corpus: Path, work: Path, env: dict[str, str], port: int) -> dict:
    """An uninterrupted launch: the reference; its time to a first step and to the end."""
    launch = campaign.Launch(command(corpus, work / "reference", port), env, work / "reference.log",
                             work / "reference" / "metrics.jsonl")
    while launch.poll():
        time.sleep(campaign.POLL_S)
    if launch.proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed; see {work / 'reference.log'}")
    return {"first_step_s": launch.first_step_at - launch.started, "run_s": time.monotonic() - launch.started}


def table(kills: list, rounds: list[dict], clean: dict, args) -> dict:
    """The results file of BENCHMARKS.md's "Faults" table (msds/bench/doc_tables.py), with every kill."""
    summary = campaign.summary(kills)
    columns = [
        {"key": "kills", "label": "kills (in start-up / of both workers)"},
        {"key": "exact", "label": "runs that end with the uninterrupted losses, exactly"},
        {"key": "steps_lost", "label": "steps lost per kill (mean / max)", "format": "mean_worst", "digits": 2,
         "worst": "max"},
        {"key": "resume_s", "label": "time to resume, s (mean / max)", "format": "mean_worst", "digits": 1,
         "worst": "max"},
        {"key": "clean_first_step_s", "label": "an uninterrupted start to its first step, s", "digits": 1}]
    row = {"kills": f"{summary['kills']} ({summary['in_start_up']} / {summary['both_workers']})",
           "exact": f"{sum(r['exact'] for r in rounds)} of {len(rounds)}",
           "steps_lost": [k.steps_lost for k in kills], "resume_s": [k.resume_s for k in kills],
           "clean_first_step_s": clean["first_step_s"]}
    return {"title": "Faults: random SIGKILLs over a 3-level V-cycle on 2 processes",
            "setting": {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs",
                        "versions": f"Python {platform.python_version()}, torch {version('torch')}, "
                                    f"DeepSpeed {version('deepspeed')}",
                        "command": f"python benchmarks/kill_campaign.py --kills {args.kills} --per-round "
                                   f"{args.per_round} --startup-per-round {args.startup_per_round} --seed {args.seed}",
                        "date": time.strftime("%Y-%m-%d")},
            "columns": columns, "rows": [row], "source": "benchmarks/kill_campaign.py",
            "summary": summary, "clean": clean, "rounds": rounds, "kills": campaign.records(kills)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="a prepared corpus with a 1024-entry BPE")
    parser.add_argument("--work", type=Path, required=True, help="a new directory for the runs and logs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kill-campaign.json")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--startup-per-round", type=int, default=2)
    parser.add_argument("--seed", type=int, default=66)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args.work.mkdir(parents=True)
    port = free_port()
    clean = clean_run(args.corpus, args.work, env, port)
    expected = outcome(args.work / "reference")
    kills, rounds = [], []
    while len(kills) < args.kills:
        index = len(rounds)
        run_dir, logs = args.work / f"round-{index}", args.work / f"round-{index}-logs"
        logs.mkdir()
        struck = campaign.campaign(command(args.corpus, run_dir, port), [env], run_dir, STEPS, args.per_round,
                                   args.startup_per_round, args.seed + index, logs)
        rounds.append({"seed": args.seed + index, "kills": len(struck), "exact": outcome(run_dir) == expected})
        kills += struck
        print(f"round {index}: {len(struck)} kills, exact {rounds[-1]['exact']}; {len(kills)} kills so far",
              flush=True)
    result = table(kills, rounds, clean, args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
